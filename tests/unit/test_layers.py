"""The package's structure (docs/architecture.md, "Layers"): imports run one way, from the
format at the bottom to the API, scheduling and command line at the top; no module
imports another in a circle; no module uses another's underscored names.

Read from the source with ast, so a lazy import inside a function counts too; imports
under ``if TYPE_CHECKING:`` are for annotations only and do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "snapcore"

# Lowest first. A module may import modules of its own layer or below.
LAYERS: dict[str, int] = {
    "snapcore.errors": 0,
    "snapcore.settings": 0,
    "snapcore.durable": 0,
    "snapcore._native": 0,
    "snapcore.manifest": 1,  # format
    "snapcore.tree": 1,
    "snapcore.values": 1,
    "snapcore.codec": 1,
    "snapcore.io_types": 1,  # the types the stages pass each other
    "snapcore.planning": 2,
    "snapcore.sharding": 2,
    "snapcore.assemble": 2,  # a sharded snapshot's parts into one manifest
    "snapcore.objstore": 3,  # the object-storage client
    "snapcore.directory": 4,  # tiers
    "snapcore.tiers": 4,
    "snapcore.staging": 5,
    "snapcore.distributed": 5,  # the job: ranks, snapcore's gloo group and key-value store
    "snapcore.peer": 6,  # the peer tier: copies in partner nodes' memory
    "snapcore.write": 6,
    "snapcore.read": 6,
    "snapcore.api": 7,
    "snapcore.rng": 7,
    "snapcore.scheduling": 8,
    "snapcore.convert": 8,  # snapcore convert: formats to and from snapshots
    "snapcore.cli": 9,
    "snapcore.demo": 9,
    "snapcore.__main__": 9,
    "snapcore": 9,  # the package's __init__: the public API, re-exported
}


def layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in LAYERS:
            return LAYERS[name]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to the docs)")


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every runtime import."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, list[str], int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend(
                (a.name, [], node.lineno) for a in node.names if a.name.startswith("snapcore")
            )
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "snapcore" or target.startswith("snapcore."):
                names = [a.name for a in node.names]
                submodules = [n for n in names if f"{target}.{n}" in known]
                if submodules:  # `from . import manifest`: the submodules are imported
                    out.extend((f"{target}.{n}", [], node.lineno) for n in submodules)
                rest = [n for n in names if n not in submodules]
                if rest or not submodules:
                    out.append((target, rest, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


MODULES = modules()
KNOWN = {*MODULES, "snapcore._native"}  # the extension: a compiled module of layer 0
GRAPH = {m: imports(m, p, KNOWN) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    for m in MODULES:
        layer(m)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_one_way(module):
    mine = layer(module)
    upward = [
        f"line {line}: {target} (layer {layer(target)})"
        for target, _, line in GRAPH[module]
        if target != module and layer(target) > mine
    ]
    assert not upward, f"{module} (layer {mine}) imports a higher layer: {upward}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_underscored_names_of_another_module(module):
    taken = [
        f"line {line}: {n} from {target}"
        for target, names, line in GRAPH[module]
        for n in names
        if n.startswith("_") and not n.startswith("__") and target != module and n != "_native"
    ]
    assert not taken, f"{module} takes private names: {taken}"


def test_no_import_cycles():
    edges = {
        m: {t for t, _, _ in deps if t in MODULES and t != m and not m.startswith(t + ".")}
        for m, deps in GRAPH.items()
    }
    # a package's __init__ is imported before its modules: `from .x import` in a module
    # of package p does not depend on p's __init__ in a way that can loop (edges to a
    # parent package are dropped above)
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycle = [*stack[stack.index(t) :], t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                dfs(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            dfs(m)


def test_the_checker_sees_a_violation(tmp_path):
    """The checks above can fail: a lower module importing a higher one is caught."""
    bad = tmp_path / "snapcore" / "manifest.py"
    bad.parent.mkdir()
    bad.write_text("def f():\n    from .write.engine import _x\n")
    found = imports("snapcore.manifest", bad, {"snapcore.write.engine"})
    assert found == [("snapcore.write.engine", ["_x"], 2)]
    assert layer(found[0][0]) > layer("snapcore.manifest")

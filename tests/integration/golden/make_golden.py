"""Write the golden format-2 stores under tests/integration/golden/ (issue 10: format 2
stays readable).

Run ONCE, with the snapcore release that writes format 2, and commit the output::

    .venv/bin/python tests/integration/golden/make_golden.py

Do not run it again after the format changes: the point of the committed stores is that
they were written by the old writer. The script refuses to overwrite existing stores
unless given ``--force``.

Each case ``tests/integration/golden/<case>/`` holds:

- ``store/``: a snapcore store (local tier) with one or more committed steps;
- ``expected/step-<N>.json`` + ``expected/step-<N>/<i>.bin``: what ``snapcore.load`` of
  step N must return, written without snapcore and without pickle. The JSON is a tagged
  tree (see ``encode``); each tensor is its contiguous raw bytes, little-endian, in its own
  ``.bin`` file, with dtype, shape and the bytes' sha256 in the JSON.

Content is deterministic (fixed seeds, CPU only). What varies between runs: the
manifests' ``created_unix`` and ``writer`` fields and the random token in data file names.
The builders below are also used by tests/integration/test_golden.py to make a fresh live
state of the same structure (another seed) to restore into.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent

# dtype <-> name for the expected files; a dtype not listed here is refused.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


# ---------------------------------------------------------------- the states


def tensors_state(seed: int) -> dict[str, Any]:
    """A plain dict of tensors: several dtypes, 0-d, empty, a non-contiguous view, ties."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 8, generator=g)
    tied = torch.randn(5, 3, generator=g)
    return {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(4, 9, generator=g).to(torch.bfloat16),
        "f16": torch.randn(3, 3, 2, generator=g).to(torch.float16),
        "f64": torch.randn(4, generator=g).double(),
        "i64": torch.randint(-(2**40), 2**40, (10,), generator=g, dtype=torch.int64),
        "i8": torch.randint(-128, 127, (3, 4), generator=g, dtype=torch.int8),
        "mask": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.randn((), generator=g),
        "empty": torch.empty(0, 4),
        "base": base,
        "strided": base[1:, ::2],  # non-contiguous view of "base"
        "transposed": torch.randn(3, 5, generator=g).t(),  # non-contiguous, own storage
        "tied_a": tied,
        "tied_b": tied,  # the same tensor under two keys
        "tied_rows": tied[1:4],  # a view into the tied storage
    }


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 11, bias=False)
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(torch.relu(self.fc1(self.embed(x)))))


def module_state(seed: int) -> dict[str, Any]:
    """nn.Module + Adam after one step + Python scalars, strings, None, nested lists/tuples."""
    torch.manual_seed(seed)
    model = TinyNet()
    optim = torch.optim.Adam(model.parameters(), lr=1e-3 * (seed + 1))
    x = torch.randint(0, 11, (4, 3))
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    model.counter.add_(seed + 7)
    return {
        "model": model,
        "optim": optim,
        "meta": {
            "epoch": 3 + seed,
            "lr": 0.1 + seed,
            "neg_zero": -0.0 if seed == 0 else 1.0,
            "nan": float("nan") if seed == 0 else 2.0,
            "big": 2**62 + seed,
            "name": f"golden-{seed}",
            "unicode": "größe ✓" if seed == 0 else "x",
            "flag": seed == 0,
            "nothing": None,
            "nested": [1 + seed, [2.5, (f"t{seed}", None)], (3, [False])],
            "pair": (seed, "b"),
        },
    }


def codec_state(seed: int) -> dict[str, Any]:
    """Compressible and incompressible tensors, for the zstd and shuffle-zstd stores."""
    g = torch.Generator().manual_seed(seed)
    return {
        "ramp": torch.arange(2048, dtype=torch.float32) * (seed + 1) / 7,
        "noise": torch.randn(1024, generator=g),
        "bf16": torch.randn(512, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 50, (700,), generator=g, dtype=torch.int64),
        "zeros": torch.zeros(300, dtype=torch.float16),
        "scalar": torch.tensor(seed + 0.25, dtype=torch.float64),
        "step": 10 + seed,
    }


def frozen_state(seed: int, step: int = 1) -> dict[str, Any]:
    """A frozen tensor (the same at every step, so step 2 shares its chunk) and a trained one."""
    g = torch.Generator().manual_seed(seed)
    frozen = torch.randn(1500, generator=g)
    trained = torch.randn(40, 3, generator=g)
    g2 = torch.Generator().manual_seed(1000 * seed + step)
    trained += torch.randn(40, 3, generator=g2) * step
    return {"frozen": frozen, "trained": trained, "step": step, "note": f"step {step}"}


# Each case: store options and the steps to save, each with a builder of its state.
Builder = Callable[[int], Any]
CASES: dict[str, tuple[dict[str, Any], list[tuple[int, Builder]]]] = {
    "tensors": ({}, [(1, tensors_state)]),
    "module_optim": ({}, [(5, module_state)]),
    "codec_zstd": ({"codec": "zstd"}, [(3, codec_state)]),
    "codec_shuffle_zstd": ({"codec": "shuffle-zstd"}, [(3, codec_state)]),
    "shared_chunk": (
        {},
        [(1, lambda s: frozen_state(s, 1)), (2, lambda s: frozen_state(s, 2))],
    ),
}
GOLDEN_SEED = 0


# ---------------------------------------------------------------- expected values


def plain(obj: Any) -> Any:
    """What ``snapcore.load`` returns for ``obj``: stateful objects become state dicts."""
    if isinstance(obj, torch.Tensor):
        return obj
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        return plain(obj.state_dict())
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(plain(v) for v in obj)
    return obj


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements in row-major order, little-endian."""
    if sys.byteorder != "little":
        raise SystemExit("the expected files are little-endian: run this on a little-endian host")
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def encode(obj: Any, out: Path, files: list[int]) -> dict[str, Any]:
    """A tagged JSON node for ``obj``; tensors are written to ``out/<i>.bin``."""
    if isinstance(obj, torch.Tensor):
        if obj.dtype not in DTYPE_NAMES:
            raise TypeError(f"dtype {obj.dtype} has no name in DTYPES")
        data = tensor_bytes(obj)
        i = len(files)
        files.append(i)
        (out / f"{i}.bin").write_bytes(data)
        return {
            "t": "tensor",
            "dtype": DTYPE_NAMES[obj.dtype],
            "shape": list(obj.shape),
            "sha256": hashlib.sha256(data).hexdigest(),
            "file": f"{i}.bin",
        }
    if obj is None:
        return {"t": "none"}
    if isinstance(obj, bool):
        return {"t": "bool", "v": obj}
    if isinstance(obj, int):
        return {"t": "int", "v": str(obj)}
    if isinstance(obj, float):
        return {"t": "float", "v": obj.hex()}  # bit-exact, incl. -0.0 and nan
    if isinstance(obj, str):
        return {"t": "str", "v": obj}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, str | int):
                raise TypeError(f"key {k!r}: only str and int keys")
            items.append([{"t": "int", "v": str(k)} if isinstance(k, int) else k, v])
        return {"t": "dict", "items": [[k, encode(v, out, files)] for k, v in items]}
    if isinstance(obj, list | tuple):
        kind = "list" if isinstance(obj, list) else "tuple"
        return {"t": kind, "items": [encode(v, out, files) for v in obj]}
    raise TypeError(f"cannot encode {type(obj).__name__}")


def write_expected(state: Any, case_dir: Path, step: int) -> None:
    out = case_dir / "expected" / f"step-{step}"
    out.mkdir(parents=True)
    tree = encode(plain(state), out, [])
    doc = {"step": step, "byteorder": "little", "tree": tree}
    text = json.dumps(doc, indent=1, ensure_ascii=False, sort_keys=True) + "\n"
    (case_dir / "expected" / f"step-{step}.json").write_text(text, encoding="utf-8")


# ---------------------------------------------------------------- main


def make(root: Path, force: bool) -> None:
    import snapcore

    for name, (options, steps) in CASES.items():
        case_dir = root / name
        if case_dir.exists():
            if not force:
                raise SystemExit(f"{case_dir} exists: the golden stores are written once")
            shutil.rmtree(case_dir)
        case_dir.mkdir(parents=True)
        store = snapcore.Store(local=case_dir / "store", retention={"local": 0}, **options)
        with store:
            for step, builder in steps:
                state = builder(GOLDEN_SEED)
                snapcore.save(state, store, step=step)
                write_expected(state, case_dir, step)
        (case_dir / "store" / "writer.lock").unlink(missing_ok=True)  # not part of the format
        print(f"wrote {case_dir}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE, help="where to write (default: here)")
    p.add_argument("--force", action="store_true", help="replace existing cases")
    args = p.parse_args()
    make(args.out, args.force)


if __name__ == "__main__":
    main()

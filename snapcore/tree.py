"""The state tree: turning a training state into JSON nodes + a list of tensors, and back.

A state is a tree of dicts, lists, tuples, tensors, None/bool/int/float/str, objects
with ``state_dict()`` / ``load_state_dict()``, and the values of values.py (NumPy arrays
and scalars, bytes, generators, enums, paths, dataclasses...). Anything else is refused
with an error that names its path, because snapcore never pickles.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import values
from .errors import InvalidManifest, StateMismatch, UnsupportedState

Node = dict[str, Any]

# Values of these exact types skip values.encode (subclasses such as IntEnum do not).
_PLAIN_TYPES = frozenset([bool, int, float, str, dict, list, tuple])


def is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def join_path(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def type_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def encode_float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x.hex()


def decode_float(s: str) -> float:
    if s in ("nan", "inf", "-inf"):
        return float(s)
    return float.fromhex(s)


@dataclass
class Flattened:
    """A state split into its JSON skeleton and its tensors (by first-seen order)."""

    tree: Node
    tensors: list[torch.Tensor] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # path of each tensor's first leaf
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    # Whether each tensor is rank-local (under torch.distributed: saved by its own rank
    # and never shared): the bytes of a NumPy array, a generator or a ``bytes`` value, and
    # every tensor of an object marked ``__snapcore_rank_local__`` (snapcore.RNGState,
    # snapcore.distributed.RankLocal).
    local: list[bool] = field(default_factory=list)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (without importing torch.distributed when unused)."""
    dt = sys.modules.get("torch.distributed.tensor")
    return dt is not None and isinstance(t, dt.DTensor)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (any other tensor: itself). Reads the shard DTensor holds
    (as DCP does) instead of calling ``to_local()``, an autograd function of about 30 us:
    the training thread pays this per tensor at every save."""
    if not is_dtensor(t):
        return t
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()  # type: ignore[attr-defined]


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    if is_dtensor(t):  # no storage of its own: the same object is the same tensor
        return ("dtensor", id(t))
    # Identical views (same memory, dtype, shape, strides) are one tensor: tied weights.
    return (
        t.device,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        t.dtype,
        tuple(t.shape),
        tuple(t.stride()),
    )


def flatten(state: object) -> Flattened:
    """Walk ``state``; stateful objects are replaced by their ``state_dict()``."""
    out = Flattened(tree={})
    index: dict[tuple[Any, ...], int] = {}
    # Looked up once per walk (the training thread walks the state at every save).
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    strided, plain_tensor = torch.strided, torch.Tensor

    def walk(obj: object, path: str, seen: tuple[int, ...], local: bool = False) -> Node:
        tp = type(obj)
        # The leaves of a state dict first, by exact type (as below, without values.py).
        if tp is str:
            return {"str": obj}
        if tp is int:
            return {"int": obj}
        if tp is float:
            return {"float": encode_float(obj)}  # type: ignore[arg-type]
        if isinstance(obj, plain_tensor):
            if obj.layout != strided:
                raise UnsupportedState(
                    f"{path or '<root>'}: {obj.layout} tensors are not supported; "
                    "convert to a dense tensor first",
                    path=path,
                )
            # DTensor first: Parameter's isinstance check is Python code (~15 us).
            is_dt = dtensor is not None and isinstance(obj, dtensor)
            if tp is not plain_tensor and not is_dt and not isinstance(obj, torch.nn.Parameter):
                raise UnsupportedState(
                    f"{path or '<root>'}: tensor subclass {type_name(obj)} is not supported",
                    path=path,
                )
            key = ("dtensor", id(obj)) if is_dt else _tensor_key(obj)
            i = index.get(key)
            if i is None:
                i = index[key] = len(out.tensors)
                # state_dict() tensors are detached already; detach costs ~20 us a tensor
                out.tensors.append(obj.detach() if obj.requires_grad else obj)
                out.paths.append(path)
                out.local.append(local)
            return {"tensor": i}
        if obj is None:
            return {"none": None}
        if type(obj) not in _PLAIN_TYPES:  # NumPy values, enums, dataclasses...: values.py
            if id(obj) in seen:
                raise UnsupportedState(f"{path or '<root>'}: the state contains a cycle", path=path)
            inner = (*seen, id(obj))
            node = values.encode(obj, path, lambda v, p: walk(v, p, inner, True))
            if node is not None:
                return node
        if isinstance(obj, bool):
            return {"bool": obj}
        if isinstance(obj, int):
            return {"int": int(obj)}
        if isinstance(obj, float):
            return {"float": encode_float(float(obj))}
        if isinstance(obj, str):
            return {"str": str(obj)}
        if id(obj) in seen:
            raise UnsupportedState(f"{path or '<root>'}: the state contains a cycle", path=path)
        seen = (*seen, id(obj))
        if isinstance(obj, Mapping):
            items = []
            for k, v in obj.items():
                if isinstance(k, bool) or not isinstance(k, str | int):
                    raise UnsupportedState(
                        f"{join_path(path, repr(k))}: dict keys must be str or int, "
                        f"not {type(k).__name__}",
                        path=join_path(path, repr(k)),
                    )
                items.append([k, walk(v, join_path(path, k), seen, local)])
            return {"dict": items}
        if isinstance(obj, list):
            return {"list": [walk(v, join_path(path, i), seen, local) for i, v in enumerate(obj)]}
        if isinstance(obj, tuple) and type(obj) is tuple:
            return {"tuple": [walk(v, join_path(path, i), seen, local) for i, v in enumerate(obj)]}
        if is_stateful(obj):
            if isinstance(obj, torch.optim.Optimizer):
                out.optimizers.append(obj)
            # An object whose state holds optimizers' tensors (AppState) names them, for
            # overlap mode (their next step() waits for the copies).
            out.optimizers.extend(getattr(obj, "__snapcore_optimizers__", ()))
            local = local or bool(getattr(type(obj), "__snapcore_rank_local__", False))
            state = walk(obj.state_dict(), path, seen, local)
            return {"stateful": {"type": type_name(obj), "state": state}}
        raise UnsupportedState(
            f"{path or '<root>'}: cannot save a value of type {type_name(obj)}; snapcore saves "
            "tensors, dicts, lists, tuples, None/bool/int/float/str and objects with "
            "state_dict()/load_state_dict(), and never pickles",
            path=path,
        )

    out.tree = walk(state, "", ())
    return out


TensorFactory = Callable[[int, str], torch.Tensor]


def tensor_paths(node: Node, path: str = "", out: dict[int, str] | None = None) -> dict[int, str]:
    """The path of each tensor index's first leaf (for messages)."""
    out = {} if out is None else out
    (kind, value), *_ = node.items()
    if kind == "tensor":
        out.setdefault(value, path or "<root>")
    elif kind == "dict":
        for k, v in value:
            tensor_paths(v, join_path(path, k), out)
    elif kind in ("list", "tuple"):
        for i, v in enumerate(value):
            tensor_paths(v, join_path(path, i), out)
    elif kind == "stateful":
        tensor_paths(value["state"], path, out)
    elif kind in values.KINDS:
        for key, child in values.children(kind, value):
            tensor_paths(child, path if key is None else join_path(path, key), out)
    return out


def build(node: Node, tensor: TensorFactory, path: str = "") -> Any:
    """Turn a saved node into plain Python values; ``tensor(i, path)`` gives tensor ``i``.

    Stateful nodes become their state dicts.
    """
    (kind, value), *_ = node.items()
    if kind == "tensor":
        return tensor(value, path)
    if kind == "dict":
        return {k: build(v, tensor, join_path(path, k)) for k, v in value}
    if kind == "list":
        return [build(v, tensor, join_path(path, i)) for i, v in enumerate(value)]
    if kind == "tuple":
        return tuple(build(v, tensor, join_path(path, i)) for i, v in enumerate(value))
    if kind == "stateful":
        return build(value["state"], tensor, path)
    if kind == "float":
        return decode_float(value)
    if kind in ("int", "str", "bool", "none"):
        return value
    if kind in values.KINDS:
        return values.build(kind, value, path, lambda n, p: build(n, tensor, p))
    raise InvalidManifest(f"{path or '<root>'}: unknown node kind {kind!r}")


InPlace = Callable[[int, str, torch.Tensor], None]
Thunk = Callable[[TensorFactory], Any]  # builds a value once the snapshot's tensors are read

# Node kinds that hold structure: everything else is a value, replaced on restore.
_STRUCTURED = ("tensor", "dict", "list", "tuple", "stateful")
# The wrappers torch.distributed.checkpoint.state_dict strips from a module's keys:
# torch.compile's OptimizedModule (``_orig_mod.``) and DDP / DataParallel (``module.``).
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "module"})


@dataclass
class RestorePlan:
    """How a saved tree fills a live state, worked out before a byte is read.

    ``fresh``: the saved tensors built as new tensors (read before ``apply``);
    ``missing``: paths of the live state the snapshot holds nothing for (left alone);
    ``unexpected``: paths of the snapshot the live state has no place for (neither read
    nor added anywhere); ``unexpected_in_modules``: those of them inside a module's state
    dict (a model of another shape, which strict restore refuses, as
    ``load_state_dict(strict=True)`` does).
    """

    fresh: set[int] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    unexpected_in_modules: list[str] = field(default_factory=list)
    writes: list[tuple[Any, Any, Thunk]] = field(default_factory=list)
    loaders: list[tuple[Any, str, Thunk]] = field(default_factory=list)

    def apply(self, tensor: TensorFactory) -> list[tuple[Any, str, Any]]:
        """Write the values into the state's containers; ``tensor(i, path)`` gives the
        fresh tensors. Returns the stateful objects (innermost first), each with its path
        and the state dict to give its ``load_state_dict`` now that the tensors hold
        their data."""
        for container, key, value in self.writes:
            container[key] = value(tensor)
        return [(obj, path, state(tensor)) for obj, path, state in self.loaders]


def plan_restore(state: Any, node: Node, into: InPlace) -> RestorePlan:
    """Match a saved tree against a live ``state``: the live state is the schema.

    ``into(i, path, target)`` is called for each tensor of the state that saved tensor
    ``i`` fills in place (it raises when the two do not fit). Nothing is read or changed
    here; ``RestorePlan.apply`` makes the changes. Raises ``StateMismatch`` for a type
    change that cannot be honoured.
    """
    if not isinstance(state, dict | list):
        raise StateMismatch("restore() needs a dict (or list) state that it can update in place")
    planner = _Planner(into)
    planner.live(state, node, "")
    return planner.plan


def _const(value: Any) -> Thunk:
    return lambda _tensor: value


def _describe(node: Node) -> str:
    (kind, value), *_ = node.items()
    if kind == "stateful":
        return f"a {value['type']}"
    if kind == "none":
        return "None"
    if kind in _VALUE_NAMES:
        return f"a {_VALUE_NAMES[kind]}"
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


# How messages name the node kinds of values.py.
_VALUE_NAMES = {
    "ndarray": "numpy.ndarray",
    "npscalar": "NumPy scalar",
    "generator": "torch.Generator",
    "random": "random.Random",
    "size": "torch.Size",
    "dataclass": "dataclass",
}


def _plain(obj: object) -> bool:
    """A plain value (no tensor, dict or stateful object), or a list/tuple of them."""
    if isinstance(obj, list) or type(obj) is tuple:
        return all(_plain(v) for v in obj)
    return not isinstance(obj, torch.Tensor | Mapping | list | tuple) and not is_stateful(obj)


def _plain_node(node: Node) -> bool:
    (kind, value), *_ = node.items()
    if kind in ("list", "tuple"):
        return all(_plain_node(v) for v in value)
    return kind not in _STRUCTURED


def canonical_key(key: object) -> object:
    """A module's state-dict key without the segments of wrappers (``_orig_mod``,
    ``module``), as torch.distributed.checkpoint.state_dict names parameters."""
    if not isinstance(key, str):
        return key
    return ".".join(p for p in key.split(".") if p not in WRAPPER_SEGMENTS)


def match_keys(
    live: list[Any], saved: list[Any], *, normalise: bool
) -> tuple[dict[Any, Any], list[Any], list[Any]]:
    """Pair a live dict's keys with a saved dict's: equal keys first, then (``normalise``)
    keys equal once wrapper segments are dropped, where that is unambiguous on both sides.
    Returns {live key: saved key}, the live keys left (missing) and the saved keys left
    (unexpected)."""
    saved_set = set(saved)
    pairs = {k: k for k in live if k in saved_set}
    if normalise and len(pairs) < len(live):
        taken = set(pairs.values())
        rest_live = _by_canonical([k for k in live if k not in pairs])
        rest_saved = _by_canonical([k for k in saved if k not in taken])
        for c, k in rest_live.items():
            if c in rest_saved:
                pairs[k] = rest_saved[c]
    taken = set(pairs.values())
    return pairs, [k for k in live if k not in pairs], [k for k in saved if k not in taken]


def _by_canonical(keys: list[Any]) -> dict[Any, Any]:
    """{canonical key: key} for the keys whose canonical form no other key shares."""
    out: dict[Any, Any] = {}
    clashes = set()
    for k in keys:
        c = canonical_key(k)
        if c in out:
            clashes.add(c)
        out[c] = k
    return {c: k for c, k in out.items() if c not in clashes}


class _Planner:
    def __init__(self, into: InPlace) -> None:
        self.into = into
        self.plan = RestorePlan()

    def mismatch(self, current: Any, node: Node, path: str) -> StateMismatch:
        return StateMismatch(
            f"{path or '<root>'}: the snapshot holds {_describe(node)} here but the state "
            f"has {type_name(current)}"
        )

    def fresh(self, node: Node, path: str) -> Thunk:
        self.plan.fresh.update(tensor_paths(node, path))
        return lambda tensor: build(node, tensor, path)

    def live(self, current: Any, node: Node, path: str) -> Thunk:
        """A value of the caller's state: its dicts and lists are filled in place, key by
        key (their keys are the schema); its tensors in place; its objects through
        ``load_state_dict``; its plain values (None, numbers, strings) are replaced."""
        (kind, value), *_ = node.items()
        of_object = kind == "stateful"
        inner = value["state"] if of_object else node
        inner_kind, inner_value = next(iter(inner.items()))
        if isinstance(current, torch.Tensor):
            if kind != "tensor":
                raise self.mismatch(current, node, path)
            self.into(value, path, current)
            return _const(current)
        if isinstance(current, dict):
            # a dict in the state takes a saved object's state dict (a module's: its keys
            # are normalised as the module's own would be)
            if inner_kind != "dict":
                raise self.mismatch(current, node, path)
            self.live_dict(current, inner_value, path, normalise=of_object)
            return _const(current)
        if isinstance(current, list) or type(current) is tuple:  # as flatten() saves them
            if inner_kind not in ("list", "tuple"):
                raise self.mismatch(current, node, path)
            if _plain(current) and _plain_node(inner):
                # a sequence of plain values is a value (a loss history, an RNG state): it
                # takes the saved one whole, whatever its length
                value = self.fresh(inner, path)
                if isinstance(current, list):
                    self.plan.writes.append((current, slice(None), value))
                    return _const(current)
                return lambda tensor: tuple(value(tensor))
            return self.live_sequence(current, inner_value, path)
        if is_stateful(current):
            holder = getattr(type(current), "__snapcore_holds__", None)
            if holder is not None and inner_kind == "dict":
                # a holder of one value (RankLocal): its value is planned as the state's
                # own, strictly and in place (the caller's dict stays the same object)
                self.live_dict(vars(current), inner_value, path, normalise=False)
                return _const(current)
            if isinstance(current, torch.nn.Module):
                if inner_kind != "dict":
                    raise self.mismatch(current, node, path)
                state = self.module(current, inner_value, path)
            elif inner_kind == "dict" or of_object:
                # An optimizer's or a scheduler's own load_state_dict judges its state
                # (a fresh optimizer has no per-parameter state yet): it gets the saved
                # state dict whole, with the live tensors filled in place where they fit.
                state = self.loose(current.state_dict(), inner, path)
            else:
                raise self.mismatch(current, node, path)
            self.plan.loaders.append((current, path, state))
            return _const(current)
        if kind in values.KINDS and current is not None:
            return self.value(current, node, path)
        if current is None or kind not in _STRUCTURED:
            return self.fresh(node, path)
        raise self.mismatch(current, node, path)

    def value(self, current: Any, node: Node, path: str) -> Thunk:
        """A NumPy array, generator, ``random.Random``, dataclass... of the live state:
        values.restore_value fills it in place (or replaces an immutable one) once the
        snapshot's tensors are read; its type checks run then too."""
        self.plan.fresh.update(tensor_paths(node, path))

        def fill(tensor: TensorFactory) -> Any:
            def merge(c: Any, n: Node, p: str) -> Any:
                (k, _), *_ = n.items()
                if k in values.KINDS and c is not None:
                    return values.restore_value(c, n, p, lambda m, q: build(m, tensor, q), merge)
                new = build(n, tensor, p)
                if isinstance(c, torch.Tensor) and isinstance(new, torch.Tensor):
                    if c.shape != new.shape or c.dtype != new.dtype:
                        raise StateMismatch(f"{p or '<root>'}: a tensor of another shape/dtype")
                    with torch.no_grad():
                        c.copy_(new)
                    return c
                return new

            return values.restore_value(
                current, node, path, lambda m, q: build(m, tensor, q), merge
            )

        return fill

    def live_dict(
        self, current: dict[Any, Any], items: list[Any], path: str, *, normalise: bool
    ) -> None:
        saved = {k: v for k, v in items}
        pairs, missing, unexpected = match_keys(list(current), list(saved), normalise=normalise)
        self.plan.missing.extend(join_path(path, k) for k in missing)
        self.plan.unexpected.extend(join_path(path, k) for k in unexpected)
        for k, sk in pairs.items():
            self.plan.writes.append(
                (current, k, self.live(current[k], saved[sk], join_path(path, k)))
            )

    def live_sequence(
        self, current: list[Any] | tuple[Any, ...], items: list[Node], path: str
    ) -> Thunk:
        n = min(len(current), len(items))
        self.plan.missing.extend(join_path(path, i) for i in range(n, len(current)))
        self.plan.unexpected.extend(join_path(path, i) for i in range(n, len(items)))
        values = [self.live(current[i], items[i], join_path(path, i)) for i in range(n)]
        if isinstance(current, list):
            self.plan.writes.extend((current, i, v) for i, v in enumerate(values))
            return _const(current)
        kept = [_const(v) for v in current[n:]]
        return lambda tensor: tuple(v(tensor) for v in [*values, *kept])

    def module(self, module: torch.nn.Module, items: list[Any], path: str) -> Thunk:
        """A module's state dict: its keys are the schema, as for load_state_dict(strict)."""
        template = module.state_dict()
        saved = {k: v for k, v in items}
        pairs, missing, unexpected = match_keys(list(template), list(saved), normalise=True)
        self.plan.missing.extend(join_path(path, k) for k in missing)
        self.plan.unexpected.extend(join_path(path, k) for k in unexpected)
        self.plan.unexpected_in_modules.extend(join_path(path, k) for k in unexpected)
        values = {
            k: self.loose(template[k], saved[sk], join_path(path, k)) for k, sk in pairs.items()
        }

        def state(tensor: TensorFactory) -> Any:
            # the module's own state dict (its _metadata kept), missing keys as they are
            for k, v in values.items():
                template[k] = v(tensor)
            return template

        return state

    def loose(self, current: Any, node: Node, path: str) -> Thunk:
        """A value inside an object's state dict: the result has the snapshot's shape;
        live tensors at the same place are filled in place."""
        (kind, value), *_ = node.items()
        if kind == "stateful":
            return self.loose(current, value["state"], path)
        if kind == "tensor" and isinstance(current, torch.Tensor):
            self.into(value, path, current)
            return _const(current)
        if kind == "dict" and isinstance(current, Mapping):
            entries = [
                (k, self.loose(current[k], v, p) if k in current else self.fresh(v, p))
                for k, v in value
                for p in [join_path(path, k)]
            ]
            return lambda tensor: {k: v(tensor) for k, v in entries}
        if kind in ("list", "tuple") and isinstance(current, list | tuple):
            parts = [
                self.loose(current[i], v, p) if i < len(current) else self.fresh(v, p)
                for i, v in enumerate(value)
                for p in [join_path(path, i)]
            ]
            kind_of = list if kind == "list" else tuple
            return lambda tensor: kind_of(v(tensor) for v in parts)
        return self.fresh(node, path)

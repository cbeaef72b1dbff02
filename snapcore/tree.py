"""The state tree: turning a training state into JSON nodes + a list of tensors, and back.

A state is a tree of dicts, lists, tuples, tensors, None/bool/int/float/str, objects
with ``state_dict()`` / ``load_state_dict()``, and the values of values.py (NumPy arrays
and scalars, bytes, generators, enums, paths, dataclasses...). Anything else is refused
with an error that names its path, because snapcore never pickles.
"""

from __future__ import annotations

import math
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


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
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

    def walk(obj: object, path: str, seen: tuple[int, ...]) -> Node:
        if isinstance(obj, torch.Tensor):
            if obj.is_sparse or obj.layout != torch.strided:
                raise UnsupportedState(
                    f"{path or '<root>'}: {obj.layout} tensors are not supported; "
                    "convert to a dense tensor first",
                    path=path,
                )
            if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
                raise UnsupportedState(
                    f"{path or '<root>'}: tensor subclass {type_name(obj)} is not supported",
                    path=path,
                )
            key = _tensor_key(obj)
            i = index.get(key)
            if i is None:
                i = index[key] = len(out.tensors)
                # state_dict() tensors are detached already; detach costs ~20 us a tensor
                out.tensors.append(obj.detach() if obj.requires_grad else obj)
                out.paths.append(path)
            return {"tensor": i}
        if obj is None:
            return {"none": None}
        if type(obj) not in _PLAIN_TYPES:  # NumPy values, enums, dataclasses...: values.py
            if id(obj) in seen:
                raise UnsupportedState(f"{path or '<root>'}: the state contains a cycle", path=path)
            inner = (*seen, id(obj))
            node = values.encode(obj, path, lambda v, p: walk(v, p, inner))
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
                items.append([k, walk(v, join_path(path, k), seen)])
            return {"dict": items}
        if isinstance(obj, list):
            return {"list": [walk(v, join_path(path, i), seen) for i, v in enumerate(obj)]}
        if isinstance(obj, tuple) and type(obj) is tuple:
            return {"tuple": [walk(v, join_path(path, i), seen) for i, v in enumerate(obj)]}
        if is_stateful(obj):
            if isinstance(obj, torch.optim.Optimizer):
                out.optimizers.append(obj)
            return {
                "stateful": {"type": type_name(obj), "state": walk(obj.state_dict(), path, seen)}
            }
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


InPlace = Callable[[int, str, torch.Tensor], torch.Tensor]


Loader = tuple[Any, Any]


def restore_into(state: Any, node: Node, fresh: TensorFactory, into: InPlace) -> list[Loader]:
    """Match a saved tree against a live ``state`` and update its containers in place.

    ``into(i, path, target)`` is called for each tensor of the state that the snapshot
    fills (it returns the tensor to keep there); ``fresh(i, path)`` for saved tensors with
    no counterpart. Values in mutable containers are replaced. The stateful objects are
    returned, innermost first, with the state dict to give their ``load_state_dict``
    once the tensors hold their data.
    """
    if not isinstance(state, dict | list):
        raise StateMismatch("restore() needs a dict (or list) state that it can update in place")
    loaders: list[Loader] = []
    _merge_container(state, node, "", fresh, into, loaders)
    return loaders


def _merge(
    current: Any, node: Node, path: str, fresh: TensorFactory, into: InPlace, loaders: list[Loader]
) -> Any:
    """Return the value to put where ``current`` was, filling ``current`` in place if possible."""
    (kind, value), *_ = node.items()
    if kind == "tensor":
        if isinstance(current, torch.Tensor):
            return into(value, path, current)
        return fresh(value, path)
    if kind in values.KINDS:  # NumPy arrays, generators, dataclasses... filled in place
        return values.restore_value(
            current,
            node,
            path,
            lambda n, p: build(n, fresh, p),
            lambda c, n, p: _merge(c, n, p, fresh, into, loaders),
        )
    if kind == "stateful":
        if not is_stateful(current):
            raise StateMismatch(
                f"{path or '<root>'}: the snapshot holds a {value['type']} here but the state "
                f"has {type_name(current)}"
            )
        merged = _merge(current.state_dict(), value["state"], path, fresh, into, loaders)
        loaders.append((current, merged))
        return current
    if kind in ("dict", "list") and isinstance(current, dict | list):
        _merge_container(current, node, path, fresh, into, loaders)
        return current
    if kind == "tuple" and isinstance(current, tuple) and len(current) == len(value):
        return tuple(
            _merge(c, v, join_path(path, i), fresh, into, loaders)
            for i, (c, v) in enumerate(zip(current, value, strict=True))
        )
    return build(node, fresh, path)


def _merge_container(
    current: dict[Any, Any] | list[Any],
    node: Node,
    path: str,
    fresh: TensorFactory,
    into: InPlace,
    loaders: list[Loader],
) -> None:
    (kind, value), *_ = node.items()
    if kind == "dict" and isinstance(current, dict):
        for k, v in value:
            p = join_path(path, k)
            if k in current:
                current[k] = _merge(current[k], v, p, fresh, into, loaders)
            else:
                current[k] = build(v, fresh, p)
        return
    if kind == "list" and isinstance(current, list):
        for i, v in enumerate(value):
            p = join_path(path, i)
            if i < len(current):
                current[i] = _merge(current[i], v, p, fresh, into, loaders)
            else:
                current.append(build(v, fresh, p))
        del current[len(value) :]
        return
    raise StateMismatch(
        f"{path or '<root>'}: the snapshot holds a {kind} here but the state has "
        f"{type(current).__name__}"
    )

"""The values beyond containers, tensors and Python scalars, each saved as one tree node.

NumPy arrays and scalars, ``bytes``, ``torch.Generator``, ``random.Random``,
``torch.Size``, enum members, ``pathlib`` paths and dataclasses: docs/format.md ("Tree")
gives each node's JSON encoding. Nothing here pickles, and nothing here imports a module
that a snapshot names: building a value from a hostile manifest can fail, never run code.

tree.py calls ``encode`` while it flattens a state, ``build`` while it loads one and
``restore_value`` while it matches a snapshot against a live state; manifest.py calls
``check`` on every node before anything is built; ``children`` lists the nodes inside a
node (for walkers of the tree) and ``describe`` gives a one-line summary (for inspect).

NumPy is never imported to save: a value can only be a NumPy object when NumPy is loaded
already. Loading a snapshot that holds NumPy values imports it (an error says so if it is
not installed).
"""

from __future__ import annotations

import base64
import binascii
import copy
import ctypes
import dataclasses
import enum
import math
import pathlib
import random
import struct
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from .errors import InvalidManifest, StateMismatch, UnsupportedState

Node = dict[str, Any]
Child = Callable[[object, str], Node]  # walks a value inside a value: returns its node
Build = Callable[[Node, str], Any]  # builds a node inside a node
Merge = Callable[[Any, Node, str], Any]  # restores a node inside a node into a live value

KINDS = frozenset(
    ["ndarray", "npscalar", "bytes", "generator", "random", "size", "enum", "path", "dataclass"]
)

# Arrays, bytes and generator states of at most this many bytes are inlined in the
# manifest as base64; larger ones are tensors in the data file (hashed, compressible,
# and not counted against the manifest's 64 MiB cap).
INLINE_MAX_BYTES = 1024

# NumPy dtypes that torch has too, under the same name: the bytes go through the data file
# as a tensor of that dtype. Others (object, str, structured, datetime64, longdouble) are
# refused.
NP_DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
_ITEMSIZE = {
    "bool": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}
_STRUCT = {  # little-endian struct formats, for describe() without NumPy
    "bool": "<?",
    "int8": "<b",
    "int16": "<h",
    "int32": "<i",
    "int64": "<q",
    "uint8": "<B",
    "uint16": "<H",
    "uint32": "<I",
    "uint64": "<Q",
    "float16": "<e",
    "float32": "<f",
    "float64": "<d",
    "complex64": "<ff",
    "complex128": "<dd",
}
_PATHS: dict[str, type[pathlib.PurePath]] = {
    "PurePosixPath": pathlib.PurePosixPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
    "PosixPath": pathlib.PosixPath,
    "WindowsPath": pathlib.WindowsPath,
}
_PURE = {"PosixPath": pathlib.PurePosixPath, "WindowsPath": pathlib.PureWindowsPath}
_MT_WORDS = 624  # random.Random's Mersenne Twister: 624 words, then the position
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _where(path: str) -> str:
    return path or "<root>"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _printable(s: str) -> str:
    """A string from a manifest, with control characters escaped (for messages)."""
    return repr(s)[1:-1]


# -- save ---------------------------------------------------------------------------------


def encode(obj: object, path: str, child: Child) -> Node | None:
    """The node of ``obj`` if it is one of this module's kinds, else None.

    ``child(value, path)`` walks a value held inside ``obj`` (a dataclass field, a tensor
    of bytes) through the whole tree walk. Raises ``UnsupportedState`` for a value of a
    kind handled here that cannot be saved (an object array, a combination of flags).
    """
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(obj, np.ndarray):
            return _encode_array(np, obj, path, child)
        if isinstance(obj, np.generic) and not isinstance(obj, str | bytes):
            return _encode_npscalar(np, obj, path)
    if isinstance(obj, enum.Enum):
        return _encode_enum(obj, path)
    if isinstance(obj, bytes):
        if len(obj) <= INLINE_MAX_BYTES:
            return {"bytes": {"b64": base64.b64encode(obj).decode()}}
        return {"bytes": child(torch.frombuffer(bytearray(obj), dtype=torch.uint8), path)}
    if isinstance(obj, torch.Generator):
        state = obj.get_state()
        return {"generator": {"device": str(obj.device), "data": _encode_data(state, path, child)}}
    if type(obj) is random.Random:
        version, key, gauss_next = obj.getstate()
        return {
            "random": {"version": version, "key": list(key), "gauss_next": child(gauss_next, path)}
        }
    if type(obj) is torch.Size:
        return {"size": [int(d) for d in obj]}
    if type(obj) in _PATHS.values():
        return {"path": {"type": type(obj).__name__, "str": str(obj)}}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not _is_stateful(obj):
        fields = [
            [f.name, child(getattr(obj, f.name), _join(path, f.name))]
            for f in dataclasses.fields(obj)
        ]
        return {"dataclass": {"type": _type_name(obj), "fields": fields}}
    return None


def _is_stateful(obj: object) -> bool:
    # A dataclass with state_dict()/load_state_dict() is saved through them (tree.py).
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _np_dtype_name(dtype: Any, what: str, path: str) -> str:
    if dtype.fields is None and dtype.subdtype is None and dtype.name in _ITEMSIZE:
        return str(dtype.name)
    raise UnsupportedState(
        f"{_where(path)}: cannot save a NumPy {what} of dtype {dtype}; snapcore saves NumPy "
        f"values of dtype {', '.join(NP_DTYPES)} (convert first, e.g. a datetime64 array "
        "with .view('int64')), and never pickles",
        path=path,
    )


def _encode_array(np: ModuleType, a: Any, path: str, child: Child) -> Node:
    if type(a) is not np.ndarray:
        raise UnsupportedState(
            f"{_where(path)}: cannot save a {_type_name(a)} (a NumPy array subclass: what it "
            "adds, such as a mask, would be lost); save np.asarray(value) and what it adds",
            path=path,
        )
    name = _np_dtype_name(a.dtype, "array", path)
    little = a.dtype.newbyteorder("<")
    node: Node = {"dtype": name, "shape": [int(d) for d in a.shape]}
    if a.nbytes <= INLINE_MAX_BYTES:
        node["data"] = {"b64": base64.b64encode(a.astype(little, copy=False).tobytes()).decode()}
        return {"ndarray": node}
    # The array's own memory is staged like a tensor's when torch can view it; a copy is
    # made only for what torch.from_numpy cannot take (read-only, strided, big-endian).
    usable = (
        a.flags.c_contiguous
        and a.flags.aligned
        and a.flags.writeable
        and a.dtype == little
        and sys.byteorder == "little"
    )
    tensor = torch.from_numpy(a if usable else np.array(a, dtype=little, order="C"))
    node["data"] = child(tensor, path)
    return {"ndarray": node}


def _encode_npscalar(np: ModuleType, x: Any, path: str) -> Node:
    name = _np_dtype_name(x.dtype, "scalar", path)
    raw = np.asarray(x).astype(x.dtype.newbyteorder("<")).tobytes()
    return {"npscalar": {"dtype": name, "b64": base64.b64encode(raw).decode()}}


def _encode_enum(member: enum.Enum, path: str) -> Node:
    cls = type(member)
    name = member.name
    if name is None or cls.__members__.get(name) is not member:
        raise UnsupportedState(
            f"{_where(path)}: cannot save {member!r}: it is not one member of "
            f"{cls.__qualname__} (a combination of flags); save its .value instead",
            path=path,
        )
    return {"enum": {"module": cls.__module__, "qualname": cls.__qualname__, "name": name}}


def _encode_data(t: torch.Tensor, path: str, child: Child) -> Node:
    """A 1-D uint8 CPU tensor's bytes: inline base64 when small, else a tensor node."""
    if t.numel() <= INLINE_MAX_BYTES:
        return {"b64": base64.b64encode(_tensor_bytes(t)).decode()}
    return child(t, path)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


# -- load ---------------------------------------------------------------------------------


def build(kind: str, value: Any, path: str, child: Build) -> Any:
    """The Python value of a node of one of this module's kinds (a checked manifest's).

    ``child(node, path)`` builds a node held inside this one (a field, a tensor).
    Dataclasses come back as plain dicts of their fields. Raises ``StateMismatch`` when
    this process cannot hold the value (no NumPy, no CUDA device for a CUDA generator, an
    enum whose class is not imported: snapcore never imports a module a snapshot names).
    """
    if kind == "ndarray":
        return _build_array(value, path, child)
    if kind == "npscalar":
        np = _need_numpy(path)
        little = np.dtype(value["dtype"]).newbyteorder("<")
        raw = _b64(value["b64"], path)
        if len(raw) != little.itemsize:
            raise InvalidManifest(f"{_where(path)}: a {value['dtype']} scalar of {len(raw)} bytes")
        return np.frombuffer(raw, dtype=little)[0]
    if kind == "bytes":
        return _data_bytes(value, path, child)
    if kind == "generator":
        g = _new_generator(value["device"], path)
        _set_generator(g, value, path, child)
        return g
    if kind == "random":
        r = random.Random()
        _set_random(r, value, path, child)
        return r
    if kind == "size":
        return torch.Size(value)
    if kind == "enum":
        return _resolve_enum(value, path)
    if kind == "path":
        cls = _PATHS[value["type"]]
        try:
            return cls(value["str"])
        except NotImplementedError:  # a concrete path of the other OS: its pure form
            return _PURE[value["type"]](value["str"])
    if kind == "dataclass":
        return {k: child(v, _join(path, k)) for k, v in value["fields"]}
    raise InvalidManifest(f"{_where(path)}: unknown node kind {kind!r}")


def _need_numpy(path: str) -> ModuleType:
    try:
        import numpy
    except ImportError:
        raise StateMismatch(
            f"{_where(path)}: the snapshot holds a NumPy value here and NumPy is not "
            "installed (pip install numpy)"
        ) from None
    return numpy


def _b64(s: str, path: str) -> bytes:
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidManifest(f"{_where(path)}: invalid base64 data") from None


def _data_tensor(data: Node, path: str, child: Build) -> torch.Tensor:
    if "b64" in data:
        raw = _b64(data["b64"], path)
        return (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(0, dtype=torch.uint8)
        )
    t = child(data, path)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise InvalidManifest(f"{_where(path)}: the bytes' tensor is not a 1-D uint8 tensor")
    return t


def _data_bytes(data: Node, path: str, child: Build) -> bytes:
    if "b64" in data:
        return _b64(data["b64"], path)
    return _tensor_bytes(_data_tensor(data, path, child))


def _build_array(value: Node, path: str, child: Build) -> Any:
    np = _need_numpy(path)
    dtype = np.dtype(value["dtype"])
    shape = tuple(value["shape"])
    data = value["data"]
    try:
        if "b64" in data:
            raw = _b64(data["b64"], path)
            flat = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype)
            return flat.reshape(shape)
        t = child(data, path)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise InvalidManifest(f"{_where(path)}: the array's tensor has another shape")
        a = t.numpy()
        if a.dtype != dtype:
            raise InvalidManifest(f"{_where(path)}: the array's tensor has another dtype")
        return a
    except ValueError as e:  # more dimensions than this NumPy allows, a size mismatch
        raise InvalidManifest(f"{_where(path)}: cannot build the array: {e}") from None


def _new_generator(device: str, path: str) -> torch.Generator:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InvalidManifest(f"{_where(path)}: invalid device {_printable(device)!r}") from None
    if dev.type == "cuda" and not (
        torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
    ):
        raise StateMismatch(
            f"{_where(path)}: the snapshot holds a torch.Generator of {dev} and this process "
            "has no such CUDA device; restore it into a live generator, or load where it is"
        )
    try:
        return torch.Generator(device=dev)
    except RuntimeError as e:
        raise StateMismatch(f"{_where(path)}: cannot create a generator on {dev}: {e}") from None


def _set_generator(g: torch.Generator, value: Node, path: str, child: Build) -> None:
    state = _data_tensor(value["data"], path, child)
    try:
        g.set_state(state.contiguous())
    except (RuntimeError, ValueError) as e:
        raise StateMismatch(
            f"{_where(path)}: torch refuses the saved state of a {value['device']} generator "
            f"for this generator on {g.device}: {e}"
        ) from None


def _set_random(r: random.Random, value: Node, path: str, child: Build) -> None:
    gauss = child(value["gauss_next"], path)
    try:
        r.setstate((value["version"], tuple(value["key"]), gauss))
    except (ValueError, TypeError, OverflowError) as e:
        raise InvalidManifest(f"{_where(path)}: invalid random.Random state: {e}") from None


def _resolve_enum(value: Node, path: str, live: type[enum.Enum] | None = None) -> enum.Enum:
    module, qualname, name = value["module"], value["qualname"], value["name"]
    what = _printable(f"{module}.{qualname}.{name}")
    if live is not None:
        cls: Any = live
    else:
        # Only an already imported module is looked in: importing the module a snapshot
        # names would run its code. Lookups go through __dict__, so no __getattr__ runs.
        cls = sys.modules.get(module)
        if cls is None:
            raise StateMismatch(
                f"{_where(path)}: the snapshot holds the enum member {what} and module "
                f"{_printable(module)} is not imported; snapcore never imports a module a "
                "snapshot names (that would run its code): import it before loading, or "
                "restore into a state that holds a member of that enum"
            )
        for part in qualname.split("."):
            cls = getattr(cls, "__dict__", {}).get(part)
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise StateMismatch(f"{_where(path)}: {what}: {_printable(qualname)} is not an Enum class")
    member = cls.__members__.get(name)
    if member is None:
        raise StateMismatch(
            f"{_where(path)}: the snapshot holds {what} and {cls.__qualname__} has no member "
            f"{_printable(name)}"
        )
    return member


# -- restore into a live state ------------------------------------------------------------


def restore_value(current: Any, node: Node, path: str, build: Build, merge: Merge) -> Any:
    """The value to put where ``current`` was, for a node of one of this module's kinds.

    NumPy arrays (same dtype and shape), generators, ``random.Random`` and dataclasses are
    filled in place and returned; a frozen dataclass, a read-only array and the immutable
    values (NumPy scalars, bytes, sizes, enum members, paths) are replaced. ``current``
    must be of the saved type (an enum member of the saved class): ``StateMismatch``
    names the path otherwise. ``build(node, path)`` builds a child node; ``merge(value,
    node, path)`` restores a child node into a live value (a field, an array's tensor).
    """
    (kind, value), *_ = node.items()
    if kind == "ndarray":
        return _restore_array(current, value, node, path, build, merge)
    if kind == "generator":
        _expect(isinstance(current, torch.Generator), current, "torch.Generator", path)
        if current.device.type != torch.device(value["device"]).type:  # check() parsed it
            raise StateMismatch(
                f"{_where(path)}: the snapshot holds a generator of "
                f"{_printable(value['device'])}, the state has one of {current.device}"
            )
        _set_generator(current, value, path, build)
        return current
    if kind == "random":
        _expect(type(current) is random.Random, current, "random.Random", path)
        _set_random(current, value, path, build)
        return current
    if kind == "dataclass":
        return _restore_dataclass(current, value, path, merge)
    if kind == "enum":
        _expect(isinstance(current, enum.Enum), current, "enum member", path)
        cls = type(current)
        if (cls.__module__, cls.__qualname__) != (value["module"], value["qualname"]):
            raise StateMismatch(
                f"{_where(path)}: the snapshot holds a member of "
                f"{_printable(value['module'] + '.' + value['qualname'])}, the state one of "
                f"{_type_name(current)}"
            )
        return _resolve_enum(value, path, live=cls)
    new = build(node, path)
    # A path may change flavour with the snapshot; npscalar, bytes, size: the same type.
    same = isinstance(current, pathlib.PurePath) if kind == "path" else type(current) is type(new)
    _expect(same, current, _type_name(new), path)
    return new


def _expect(ok: bool, current: Any, saved: str, path: str) -> None:
    if not ok:
        raise StateMismatch(
            f"{_where(path)}: the snapshot holds a {saved} here but the state has "
            f"{_type_name(current)}"
        )


def _valid_device(device: str) -> bool:
    try:
        torch.device(device)
    except RuntimeError:
        return False
    return True


def _restore_array(
    current: Any, value: Node, node: Node, path: str, build: Build, merge: Merge
) -> Any:
    np = sys.modules.get("numpy")
    _expect(np is not None and type(current) is np.ndarray, current, "numpy.ndarray", path)
    if current.dtype.name != value["dtype"] or list(current.shape) != value["shape"]:
        raise StateMismatch(
            f"{_where(path)}: the snapshot holds a {value['dtype']}{value['shape']} array, "
            f"the state has {current.dtype.name}{list(current.shape)}"
        )
    if not current.flags.writeable:
        return build(node, path)
    data = value["data"]
    if (
        "tensor" in data
        and current.flags.c_contiguous
        and current.flags.aligned
        and current.dtype.isnative
    ):
        merge(torch.from_numpy(current), data, path)  # read straight into its memory
    else:
        np.copyto(current, build(node, path))
    return current


def _restore_dataclass(current: Any, value: Node, path: str, merge: Merge) -> Any:
    if not dataclasses.is_dataclass(current) or isinstance(current, type):
        _expect(False, current, f"dataclass {_printable(value['type'])}", path)
    live = [f.name for f in dataclasses.fields(current)]
    saved = [k for k, _ in value["fields"]]
    if sorted(live) != sorted(saved):
        missing = sorted(set(live) - set(saved))
        extra = sorted(set(saved) - set(live))
        raise StateMismatch(
            f"{_where(path)}: the dataclass {_type_name(current)} has fields the snapshot "
            f"lacks ({', '.join(missing) or 'none'}) or the snapshot has fields it lacks "
            f"({', '.join(map(_printable, extra)) or 'none'})"
        )
    new = {k: merge(getattr(current, k), v, _join(path, k)) for k, v in value["fields"]}
    params = getattr(type(current), "__dataclass_params__", None)
    target = copy.copy(current) if params is not None and params.frozen else current
    for k, v in new.items():
        if target is current:
            setattr(target, k, v)
        else:  # frozen: a new instance takes the values; the live one is left as it was
            object.__setattr__(target, k, v)
    return target


# -- manifest checks and inspection ------------------------------------------------------


def children(kind: str, value: Any) -> list[tuple[str | None, Node]]:
    """The nodes held inside a node: (key, node), key None where the path stays the same."""
    if kind in ("ndarray", "generator"):
        data = value["data"]
        return [(None, data)] if "tensor" in data else []
    if kind == "bytes":
        return [(None, value)] if "tensor" in value else []
    if kind == "random":
        return [(None, value["gauss_next"])]
    if kind == "dataclass":
        return [(k, v) for k, v in value["fields"]]
    return []


def _b64_length(s: str) -> int | None:
    """The number of bytes a (schema-valid) base64 string decodes to; None if malformed."""
    if len(s) % 4:
        return None
    return len(s) // 4 * 3 - (len(s) - len(s.rstrip("=")))


def check(kind: str, value: Any, tensors: Sequence[Any], where: str, max_bytes: int) -> None:
    """Checks of one node (schema-valid) that the schema cannot express: sizes, lengths, the
    dtype and shape of the tensor that holds an array's bytes. ``tensors`` are the
    manifest's tensor entries (``.dtype``, ``.shape``)."""

    def bad(msg: str) -> InvalidManifest:
        return InvalidManifest(f"{where}: {kind} node: {msg}")

    def data(d: Node, dtype: str, shape: list[int] | None) -> None:
        """Inline bytes or a tensor of ``dtype`` and ``shape`` (any length when None)."""
        if "b64" in d:
            n = _b64_length(d["b64"])
            want = None if shape is None else math.prod(shape) * _ITEMSIZE[dtype]
            if n is None or (want is not None and n != want):
                raise bad(f"{len(d['b64'])} base64 characters for {dtype}{shape or ''}")
            return
        i = d["tensor"]
        if i >= len(tensors):
            raise bad(f"references tensor {i} of {len(tensors)}")
        e = tensors[i]
        ok = e.dtype == dtype and (len(e.shape) == 1 if shape is None else list(e.shape) == shape)
        if not ok:
            raise bad(f"tensor {i} is {e.dtype}{list(e.shape)}, not {dtype}{shape or '[n]'}")

    if kind == "ndarray":
        shape = value["shape"]
        if any(d > _INT64[1] for d in shape) or (
            math.prod(shape) * _ITEMSIZE[value["dtype"]] > max_bytes
        ):
            raise bad(f"shape {shape} is too large")
        data(value["data"], value["dtype"], shape)
    elif kind == "npscalar":
        data(value, value["dtype"], [])
    elif kind == "bytes":
        data(value, "uint8", None)
    elif kind == "generator":
        data(value["data"], "uint8", None)
        if not _valid_device(value["device"]):
            raise bad(f"invalid device {_printable(value['device'])!r}")
    elif kind == "random":
        if value["key"][-1] > _MT_WORDS:
            raise bad(f"position {value['key'][-1]} is beyond {_MT_WORDS}")
        gauss, *_ = value["gauss_next"]
        if gauss not in ("float", "none"):
            raise bad(f"gauss_next is a {gauss} node, not a float or none")
    elif kind == "size":
        if any(not _INT64[0] <= d <= _INT64[1] for d in value):
            raise bad(f"{value} does not fit in int64")
    elif kind == "dataclass":
        names = [k for k, _ in value["fields"]]
        if len(set(names)) != len(names):
            raise bad("duplicate field names")


def describe(kind: str, value: Any) -> str:
    """A one-line summary of a node of one of this module's kinds (control characters of
    the manifest's strings escaped). Dataclass fields are its children."""
    if kind == "ndarray":
        shape = "x".join(map(str, value["shape"])) or "scalar"
        where = "inline" if "b64" in value["data"] else f"tensor {value['data']['tensor']}"
        return f"numpy {value['dtype']} [{shape}] ({where})"
    if kind == "npscalar":
        try:
            x = struct.unpack(_STRUCT[value["dtype"]], base64.b64decode(value["b64"]))
        except (binascii.Error, struct.error, ValueError):
            return f"numpy.{value['dtype']} <invalid>"
        return f"numpy.{value['dtype']}({x[0] if len(x) == 1 else complex(*x)!r})"
    if kind == "bytes":
        if "b64" in value:
            return f"bytes ({_b64_length(value['b64'])} B, inline)"
        return f"bytes (tensor {value['tensor']})"
    if kind == "generator":
        return f"torch.Generator on {_printable(value['device'])}"
    if kind == "random":
        return f"random.Random (Mersenne Twister state, position {value['key'][-1]})"
    if kind == "size":
        return f"torch.Size({value})"
    if kind == "enum":
        return _printable(f"{value['qualname']}.{value['name']} (enum of {value['module']})")
    if kind == "path":
        return f"{value['type']}({value['str']!r})"
    if kind == "dataclass":
        return f"dataclass {_printable(value['type'])}"
    return f"<unknown node kind {_printable(kind)}>"

"""The conversion driver: one source, one sink, tensor by tensor (docs/cli.md, "convert").

``convert`` detects the source's format (or takes ``from_``), opens the source and the
sink, and streams: the next tensor is read on a thread while the previous one is
written, so at most two tensors are in flight besides the sink's own buffer. A tensor
larger than the window (``WINDOW``, 256 MiB) is read and written in ranges of at most
that many bytes where both formats can (``read_range``, ``write_range``), so that it is
never whole in memory. Names are filtered (``only``: globs on dotted names), stripped
of a prefix, renamed (``REGEX``, ``REPL`` pairs, applied in order) and floating tensors
cast (``dtype``) on the way. The sink is committed at the end and aborted on any error,
``KeyboardInterrupt`` included: an interrupted conversion leaves no target.

Besides the contract of ``base.py``, optional methods are used when a format has them:
``Source.aliases()`` (name -> the name of the tensor it is the same as: tied weights)
and ``Sink.begin(infos, aliases, metadata)`` (the tensors it will be given, in order,
the aliases among them and the provenance ``commit`` will be given, before the first
``write``); ``Sink.order(infos, aliases)`` (the tensors in the order the sink wants
them, asked after ``write_values`` and before ``begin``); ``Source.read_range(info,
start, stop)`` and ``Sink.write_range(info, start, piece)`` (elements ``[start, stop)``
of a tensor in C order, as a 1-D tensor; a tensor's ranges are written in order, one
after another, and cover it exactly). A source without ``aliases`` has none; a sink
without ``begin`` is given aliased tensors as tensors of their own. ``write_values``
comes first of all, so a sink that writes a header before its tensors knows everything
that goes into it. A sink whose ``commit`` moves the bytes again (a snapcore URL target
uploads its temporary store) says how many in ``upload_bytes`` after ``begin``; the
driver counts them in the progress's total and sets ``upload_progress`` to a function
its commit calls with each ``n`` bytes uploaded.
"""

from __future__ import annotations

import fnmatch
import math
import os
import queue
import re
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .base import FORMATS, Sink, Source, TensorInfo

__all__ = ["DTYPES", "ConvertStats", "convert", "detect", "parse_size"]

GB = 1000**3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class ConvertStats:
    """What a conversion did."""

    source_format: str
    target_format: str
    tensors: int = 0  # tensors written (aliases not counted)
    aliases: int = 0  # names written as aliases of another tensor
    bytes: int = 0  # tensor bytes written
    values: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # what the source could not express


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``1GiB``, ``4096`` (bytes) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB, 1GiB)")
    n, unit = float(m.group(1)), (m.group(2) or "").upper().rstrip("B") or ""
    scale = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}
    scale |= {"KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}
    if unit not in scale:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB, 1GiB)")
    size = int(n * scale[unit])
    if size <= 0:
        raise ValueError(f"a size must be positive: {text!r}")
    return size


def _is_url(text: str) -> bool:
    return "://" in text and not text.startswith("file://")


def detect(src: str) -> str:
    """The name of the format ``src`` is in; ``ValueError`` when none or several claim it."""
    if _is_url(src):
        return "snapcore"  # the only format read from object storage
    path = Path(src.removeprefix("file://"))
    if not path.exists():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    found = [name for name, fmt in FORMATS.items() if fmt.detect(path)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(
            f"cannot tell the format of {src}: give --from ({', '.join(sorted(FORMATS))})"
        )
    raise ValueError(f"{src} looks like {' and '.join(sorted(found))}: give --from")


def check_target(dst: str) -> None:
    """Refuse a target that exists, unless it is an empty directory."""
    if _is_url(dst):
        return
    path = Path(dst.removeprefix("file://"))
    if path.is_dir() and not path.is_symlink():
        if any(path.iterdir()):
            raise FileExistsError(f"{dst} exists and is not empty: convert writes a new target")
    elif path.exists() or path.is_symlink():
        raise FileExistsError(f"{dst} exists: convert writes a new target")


class _Names:
    """--only, --strip-prefix and --rename, applied to a source name."""

    def __init__(
        self, only: Sequence[str], strip_prefix: str | None, rename: Sequence[tuple[str, str]]
    ) -> None:
        self.only = list(only)
        self.strip_prefix = strip_prefix
        try:
            self.rename = [(re.compile(a), b) for a, b in rename]
        except re.error as e:
            raise ValueError(f"--rename: bad regular expression: {e}") from None

    def __call__(self, name: str) -> str | None:
        if self.only and not any(fnmatch.fnmatchcase(name, g) for g in self.only):
            return None
        if self.strip_prefix:
            name = name.removeprefix(self.strip_prefix)
        for pattern, repl in self.rename:
            name = pattern.sub(repl, name)
        return name


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str,
    from_: str | None = None,
    step: int | None = None,
    only: Sequence[str] = (),
    strip_prefix: str | None = None,
    rename: Sequence[tuple[str, str]] = (),
    dtype: torch.dtype | None = None,
    shard_size: int = 5 * GB,
    progress: Any = None,
    window: int | None = None,
    **options: Any,
) -> ConvertStats:
    """Convert the checkpoint ``src`` into a new checkpoint ``dst`` in format ``to``.

    ``step``: the step read from a snapcore source and the step written to a snapcore
    target (default: the newest, and 0). ``only``: globs on dotted names (a tensor or
    value is kept if any matches; none given keeps all). ``strip_prefix`` then
    ``rename`` (``(REGEX, REPL)`` pairs, ``re.sub`` in order) map the names kept.
    ``dtype``: cast floating tensors to it (others are left as they are).
    ``shard_size``: the most bytes of one safetensors file. ``progress(done, total)``
    is called with tensor bytes after each tensor (or range of one). ``window``: the
    most bytes of one tensor read at a time where both formats read and write ranges
    (default ``WINDOW``, 256 MiB); a larger tensor is converted in ranges of it.
    ``options`` go to the formats
    (``storage_options``, ``store``: a ``snapcore.Store`` to read, ``tmp_dir``: where
    a snapcore URL target is written before its upload...).

    Raises ``FileExistsError`` for a target that exists (an empty directory is fine; a
    URL target must hold no object),
    ``ValueError`` for an unknown format or names that collide; the target is left
    untouched by any failure.
    """
    t0 = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    if to not in FORMATS:
        raise ValueError(f"unknown target format {to!r} (formats: {', '.join(sorted(FORMATS))})")
    if from_ is not None and from_ not in FORMATS:
        raise ValueError(f"unknown source format {from_!r} (formats: {', '.join(sorted(FORMATS))})")
    if window is not None and window <= 0:
        raise ValueError(f"window must be a positive number of bytes, not {window}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"--dtype must be a floating type, not {dtype}")
    names = _Names(only, strip_prefix, rename)
    check_target(dst)
    source_format = from_ or detect(src)
    opts = dict(options, step=step, shard_size=shard_size)
    source = FORMATS[source_format].source(_as_path(src), opts)
    stats = ConvertStats(source_format, to)
    try:
        plan, aliases, values = _plan(source, names, dtype, stats)
        metadata = dict(source.metadata())
        metadata["source_format"] = source_format
        metadata = {k: str(v) for k, v in metadata.items()}
        sink = FORMATS[to].sink(_as_path(dst), opts)
        try:
            # values and provenance before the first tensor: a streaming sink puts them
            # in a header it writes before the tensors (safetensors' last file)
            sink.write_values(values)
            stats.values = len(values)
            order = getattr(sink, "order", None)
            if order is not None:  # the sink writes in an order of its own (DCP's plan)
                pos = {o.name: k for k, o in enumerate(order([o for _, o in plan], dict(aliases)))}
                if sorted(pos) != sorted(o.name for _, o in plan):
                    raise AssertionError(f"{to} sink: order() did not give every tensor once")
                plan = sorted(plan, key=lambda p: pos[p[1].name])
            begin = getattr(sink, "begin", None)
            if begin is not None:
                begin([out for _, out in plan], dict(aliases), metadata)
                stats.aliases = len(aliases)
            else:  # a sink that knows no aliases gets them as tensors of their own
                plan = _with_aliases(plan, aliases)
            upload = int(getattr(sink, "upload_bytes", 0))
            _stream(source, sink, plan, stats, progress, window or WINDOW, upload)
            if upload and progress is not None:
                sink.upload_progress = _upload_progress(progress, stats.bytes, upload)  # type: ignore[attr-defined]
            sink.commit(metadata)
        except BaseException:
            sink.abort()
            raise
    finally:
        source.close()
    stats.seconds = time.perf_counter() - t0
    return stats


def _upload_progress(progress: Any, written: int, upload: int) -> Any:
    """``progress(done, total)`` continued through a sink's upload: ``written`` tensor
    bytes are done, ``upload`` more (an estimate: the total grows if more are sent)."""
    sent = 0

    def uploaded(n: int) -> None:
        nonlocal sent
        sent += n
        progress(written + sent, written + max(upload, sent))

    return uploaded


def _as_path(text: str) -> Any:
    return text if _is_url(text) else Path(text.removeprefix("file://"))


Plan = list[tuple[TensorInfo, TensorInfo]]  # (as read, as written)


def _plan(
    source: Source, names: _Names, dtype: torch.dtype | None, stats: ConvertStats
) -> tuple[Plan, list[tuple[str, str]], dict[str, Any]]:
    """The tensors to copy (as read, as written), the aliases among the names written
    (alias -> the name written, safetensors' rule: the first name in sorted order is
    kept), and the values, all under their new names."""
    src_aliases: dict[str, str] = dict(getattr(source, "aliases", dict)())
    seen: dict[str, str] = {}

    def new_name(old: str) -> str | None:
        new = names(old)
        if new is None:
            return None
        if not new:
            raise ValueError(f"{old!r} has no name left once renamed")
        if new in seen:
            raise ValueError(f"{seen[new]!r} and {old!r} are both renamed to {new!r}")
        seen[new] = old
        return new

    plan: Plan = []
    groups: dict[str, list[str]] = {}  # source tensor name -> new names of it and its aliases
    infos: dict[str, TensorInfo] = {}
    for info in source.tensors():
        infos[info.name] = info
        new = new_name(info.name)
        if new is not None:
            groups.setdefault(info.name, []).append(new)
    for alias, target in src_aliases.items():
        new = new_name(alias)
        if new is not None and target in infos:
            groups.setdefault(target, []).append(new)
    aliases: list[tuple[str, str]] = []
    for name, info in infos.items():
        group = groups.get(name)
        if not group:
            continue
        keep = sorted(group)[0]
        out_dtype = dtype if dtype is not None and info.dtype.is_floating_point else info.dtype
        plan.append((info, TensorInfo(keep, out_dtype, info.shape)))
        aliases += [(n, keep) for n in sorted(group) if n != keep]
    values: dict[str, Any] = {}
    for name, value in source.values().items():
        new = new_name(name)
        if new is not None:
            values[new] = value
    stats.skipped = list(getattr(source, "skipped", []))
    return plan, aliases, values


def _with_aliases(plan: Plan, aliases: Iterable[tuple[str, str]]) -> Plan:
    by_target: dict[str, list[str]] = {}
    for alias, target in aliases:
        by_target.setdefault(target, []).append(alias)
    out: Plan = []
    for src_info, out_info in plan:
        out.append((src_info, out_info))
        out += [(src_info, replace(out_info, name=a)) for a in by_target.get(out_info.name, [])]
    return out


WINDOW = 256 << 20  # the most bytes of one tensor read at a time, when both formats can


@dataclass(frozen=True)
class _Task:
    """One read and write of ``_stream``: the tensor ``src`` (as read) written as
    ``out``, whole (``start`` None) or its elements ``[start, stop)`` in C order."""

    src: TensorInfo
    out: TensorInfo
    start: int | None = None
    stop: int | None = None


def _tasks(source: Source, sink: Sink, plan: Plan, window: int) -> list[_Task]:
    """The plan cut into reads of at most ``window`` bytes: a tensor larger than that is
    read and written in ranges when the source has ``read_range`` and the sink
    ``write_range``; any other tensor is read whole."""
    ranged = hasattr(source, "read_range") and hasattr(sink, "write_range")
    out: list[_Task] = []
    for src, dst in plan:
        size = max(src.dtype.itemsize, dst.dtype.itemsize)
        numel = math.prod(src.shape)
        if not ranged or numel * size <= window:
            out.append(_Task(src, dst))
            continue
        step = max(1, window // size)
        out += [_Task(src, dst, a, min(a + step, numel)) for a in range(0, numel, step)]
    return out


def _task_bytes(task: _Task) -> int:
    """The bytes a task reads from its source."""
    info = task.src
    numel = math.prod(info.shape) if task.start is None else task.stop - task.start  # type: ignore[operator]
    return numel * info.dtype.itemsize


def _stream(
    source: Source,
    sink: Sink,
    plan: Plan,
    stats: ConvertStats,
    progress: Any,
    window: int = WINDOW,
    upload: int = 0,
) -> None:
    """Read the next tensor (or range of one) on a thread while the previous one is
    written: two reads in flight, each a tensor or at most ``window`` bytes of one.

    Where the source reads into given memory (``read_into``) and the sink is done with a
    tensor's memory when ``write`` returns (``keeps_tensors`` False), the reads go into
    two buffers allocated once and reused: memory touched for the first time fills
    several times slower than memory already faulted in (docs/benchmarks.md). Each
    buffer has the source's ``read_slack`` bytes to spare (the safetensors source reads
    the block-aligned bytes around a range, with O_DIRECT). ``upload``: bytes the sink's
    commit will upload, counted in the progress's total."""
    total = sum(out.nbytes for _, out in plan) + upload
    done = 0
    stop = threading.Event()
    tasks = _tasks(source, sink, plan, window)
    reuse = hasattr(source, "read_into") and getattr(sink, "keeps_tensors", True) is False
    free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
    if reuse and tasks:
        # read_slack: what the source needs beyond the bytes (aligned reads, safetensors)
        size = max(_task_bytes(t) for t in tasks) + getattr(source, "read_slack", 0)
        for _ in range(2):  # the one being written and the one being read
            free.put(torch.empty(size, dtype=torch.uint8))

    def read(task: _Task) -> tuple[torch.Tensor, torch.Tensor | None]:
        if stop.is_set():
            raise RuntimeError("conversion stopped")
        info, out = task.src, task.out
        buf = free.get() if reuse else None
        if buf is not None:
            t = source.read_into(info, task.start, task.stop, buf)  # type: ignore[attr-defined]
            shape = info.shape if task.start is None else (task.stop - task.start,)  # type: ignore[operator]
        elif task.start is None:
            t = source.read(info)
            shape = info.shape
        else:
            assert task.stop is not None
            t = source.read_range(info, task.start, task.stop)  # type: ignore[attr-defined]
            shape = (task.stop - task.start,)
        if t.dtype != info.dtype or tuple(t.shape) != shape:
            raise ValueError(
                f"{info.name}: the source gave {t.dtype} {tuple(t.shape)}, not {info.dtype} {shape}"
            )
        if out.dtype != t.dtype:
            t = t.to(out.dtype)  # new memory: the buffer is free again
            if buf is not None:
                free.put(buf)
                buf = None
        return t.contiguous(), buf

    with ThreadPoolExecutor(1, thread_name_prefix="snapcore-convert-read") as pool:
        ahead: Future[torch.Tensor] | None = None
        try:
            if tasks:
                ahead = pool.submit(read, tasks[0])
            for k, task in enumerate(tasks):
                assert ahead is not None
                tensor, buf = ahead.result()
                ahead = pool.submit(read, tasks[k + 1]) if k + 1 < len(tasks) else None
                out = task.out
                if task.start is None:
                    sink.write(out, tensor)
                    nbytes = out.nbytes
                else:
                    sink.write_range(out, task.start, tensor)  # type: ignore[attr-defined]
                    nbytes = tensor.numel() * tensor.element_size()
                del tensor
                if buf is not None:  # the sink is done with it (keeps_tensors False)
                    free.put(buf)
                if task.stop is None or task.stop == math.prod(out.shape):
                    stats.tensors += 1
                stats.bytes += nbytes
                done += nbytes
                if progress is not None:
                    progress(done, total)
        except BaseException:
            stop.set()
            if ahead is not None:
                ahead.cancel()
            raise

"""Chunk codecs: how a chunk's raw bytes are stored, and how they are decoded again.

``none`` stores the bytes as they are. ``zstd`` compresses them with zstandard.
``shuffle-zstd`` first groups byte k of every element together (snapcore._native's
byte_shuffle), so that the sign and exponent bytes of float data, which vary little, form
long runs that zstd compresses; the mantissa bytes stay as noisy as before.

Threads: encode() and decode() may run on several threads at once. zstandard's compressor
and decompressor objects are not thread-safe, so each thread has its own (one compressor
per level), and its own scratch buffer for the shuffled bytes. The heavy parts release the
GIL: byte_shuffle and byte_unshuffle (the binding drops it), ZstdCompressor.compress and
ZstdDecompressionReader.readinto (python-zstandard 0.25's C backend runs
ZSTD_compressStream2 and ZSTD_decompressStream between Py_BEGIN_ALLOW_THREADS and
Py_END_ALLOW_THREADS, c-ext/compressor.c and c-ext/decompressionreader.c; its cffi backend
releases the GIL in every C call), and copy_host. tests/unit/test_codec.py checks it.

Memory per thread that has run a shuffle-zstd call: one scratch buffer as large as the
largest chunk it handled (64 MiB for snapcore's chunks), kept for the next call and freed
by release_scratch() or when the thread ends; plus zstd's contexts (a few MiB per level
at levels 1-3).
"""

from __future__ import annotations

import ctypes
import threading

import zstandard

from snapcore import _native
from snapcore.errors import CorruptSnapshot
from snapcore.manifest import CODECS  # the format names the codecs; this module runs them

ELEMENT_SIZES = (1, 2, 4, 8, 16)  # what byte_shuffle groups by: a dtype's itemsize
DEFAULT_LEVEL = 1  # as good a ratio as 3 on weights and Adam state, 1.4-1.6x faster

_SCRATCH_GRANULE = 1 << 20  # scratch sizes are rounded up to this, so that they settle


class _PyBuffer(ctypes.Structure):
    """CPython's Py_buffer (Include/pybuffer.h), to read the address of any buffer."""

    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    )


_PyObject_GetBuffer = ctypes.pythonapi.PyObject_GetBuffer
_PyObject_GetBuffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_PyObject_GetBuffer.restype = ctypes.c_int
_PyBuffer_Release = ctypes.pythonapi.PyBuffer_Release
_PyBuffer_Release.argtypes = (ctypes.POINTER(_PyBuffer),)
_PyBuffer_Release.restype = None
_PyBUF_SIMPLE = 0  # contiguous bytes, read-only allowed


def _address(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte, read-only buffers included (ctypes'
    from_buffer takes writable ones only). Valid while `view` lives: a memoryview holds
    its exporter's buffer for as long as it exists."""
    info = _PyBuffer()
    if _PyObject_GetBuffer(view, ctypes.byref(info), _PyBUF_SIMPLE) != 0:
        raise ValueError("a buffer snapcore can read")  # pragma: no cover - set by CPython
    try:
        return info.buf or 0
    finally:
        _PyBuffer_Release(ctypes.byref(info))


def _bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("codec buffers must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _writable_at(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class _ThreadState(threading.local):
    """What one thread keeps between calls: zstd contexts and the shuffle scratch."""

    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self._decompressor: zstandard.ZstdDecompressor | None = None
        self.scratch: _native.Arena | None = None

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        c = self.compressors.get(level)
        if c is None:
            # compress() pledges the input size, so every frame records its content size,
            # which decode() checks before writing anything. No zstd checksum: the chunk's
            # XXH3 in the manifest already covers the decoded bytes.
            c = zstandard.ZstdCompressor(level=level, write_content_size=True)
            self.compressors[level] = c
        return c

    def decompressor(self) -> zstandard.ZstdDecompressor:
        if self._decompressor is None:
            self._decompressor = zstandard.ZstdDecompressor()
        return self._decompressor

    def scratch_address(self, nbytes: int) -> int:
        if self.scratch is None or self.scratch.size < nbytes:
            if self.scratch is not None:
                self.scratch.close()
                self.scratch = None
            size = -(-nbytes // _SCRATCH_GRANULE) * _SCRATCH_GRANULE
            # Not prefaulted: the first shuffle faults it in, without the GIL.
            self.scratch = _native.Arena(size, pin=False, prefault=False)
        return self.scratch.address


_state = _ThreadState()


def release_scratch() -> None:
    """Frees the calling thread's scratch buffer (the next shuffle-zstd call makes a new
    one); zstd contexts stay."""
    if _state.scratch is not None:
        _state.scratch.close()
        _state.scratch = None


def _check_codec(codec: str, element_size: int) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; snapcore knows {', '.join(CODECS)}")
    if element_size not in ELEMENT_SIZES:
        raise ValueError(f"element_size must be one of {ELEMENT_SIZES}, not {element_size}")


def encode(
    data: memoryview, *, codec: str, element_size: int = 1, level: int = DEFAULT_LEVEL
) -> bytes | memoryview:
    """The stored form of `data` (C-contiguous bytes) under `codec`.

    ``none`` returns `data` itself, not a copy. ``shuffle-zstd`` shuffles by
    `element_size` (the dtype's itemsize) into this thread's scratch buffer, then
    compresses at zstd `level`. Releases the GIL while it works; thread-safe.
    """
    _check_codec(codec, element_size)
    if codec == "none":
        return data
    view = _bytes_view(data)
    compressor = _state.compressor(level)
    if codec == "zstd" or element_size == 1 or view.nbytes < element_size:
        return compressor.compress(view)  # a shuffle would be a plain copy here
    nbytes = view.nbytes
    scratch = _state.scratch_address(nbytes)
    _native.byte_shuffle(scratch, _address(view), nbytes, element_size, threads=1)
    # One thread each: snapcore runs one encode per chunk on a pool of threads already.
    return compressor.compress(_writable_at(scratch, nbytes))


def _corrupt(codec: str, stored: int, got: int | str, raw_length: int) -> CorruptSnapshot:
    return CorruptSnapshot(
        f"a {codec} chunk of {stored} stored bytes decodes to {got} bytes, expected {raw_length}"
    )


def _check_frame(view: memoryview, codec: str, raw_length: int) -> None:
    """The zstd frame header of `view` must declare exactly raw_length bytes of content:
    checked before any buffer is reserved for them."""
    stored = view.nbytes
    try:
        content_size = zstandard.frame_content_size(view)
    except zstandard.ZstdError as e:
        raise CorruptSnapshot(
            f"a {codec} chunk of {stored} stored bytes does not decode: no zstd frame ({e})"
        ) from e
    if content_size == zstandard.CONTENTSIZE_UNKNOWN:
        raise _corrupt(codec, stored, "an unrecorded number of", raw_length)
    if content_size != raw_length:
        raise _corrupt(codec, stored, content_size, raw_length)


def check_header(data: bytes | memoryview, *, codec: str, raw_length: int) -> None:
    """Raises CorruptSnapshot unless the stored chunk `data` declares `raw_length` decoded
    bytes: a zstd frame header with exactly that content size (``none``: that many bytes).
    What a reader checks before it reserves memory for the decoded chunk; decode() checks
    it again."""
    _check_codec(codec, 1)
    view = _bytes_view(data)
    if codec == "none":
        if view.nbytes != raw_length:
            raise _corrupt(codec, view.nbytes, view.nbytes, raw_length)
    else:
        _check_frame(view, codec, raw_length)


def _zstd_into(view: memoryview, codec: str, address: int, raw_length: int) -> None:
    """Decompresses the single zstd frame `view` into the raw_length bytes at `address`,
    never writing outside them."""
    stored = view.nbytes
    _check_frame(view, codec, raw_length)
    got = 0
    more = False
    try:
        # readinto writes into the caller's memory (the view bounds it to raw_length);
        # with the whole frame at hand and room for its content, zstd decodes it in one
        # pass, straight into `address`.
        with _state.decompressor().stream_reader(view) as reader:
            if raw_length:
                out = _writable_at(address, raw_length)
                while got < raw_length:
                    n = reader.readinto(out[got:])
                    if n == 0:
                        break
                    got += n
            more = got == raw_length and reader.readinto(bytearray(1)) != 0  # a frame follows
    except zstandard.ZstdError as e:
        raise CorruptSnapshot(
            f"a {codec} chunk of {stored} stored bytes does not decode "
            f"(after {got} of {raw_length} bytes): {e}"
        ) from e
    if more:
        raise _corrupt(codec, stored, f"more than {raw_length}", raw_length)
    if got != raw_length:
        raise _corrupt(codec, stored, got, raw_length)


def decode(
    data: bytes | memoryview, *, codec: str, element_size: int, raw_length: int, out: int
) -> None:
    """Decodes the stored chunk `data` into the `raw_length` bytes at address `out`, which
    the caller owns (a tensor's data_ptr, an arena address).

    A stored form that cannot be right (not a zstd frame, no recorded content size, a
    length other than `raw_length`, truncated, a block zstd rejects, a second frame) raises
    CorruptSnapshot, and nothing is ever written outside [out, out + raw_length), though
    part of that range may have been written by then. Frames carry no zstd checksum, so
    damage inside a block can decode to wrong bytes of the right length: the caller checks
    the chunk's XXH3. Releases the GIL while it works; thread-safe.
    """
    _check_codec(codec, element_size)
    if raw_length < 0:
        raise ValueError(f"raw_length must be >= 0, not {raw_length}")
    if raw_length and not out:
        raise ValueError("decode: null output address")
    view = _bytes_view(data)
    if codec == "none":
        if view.nbytes != raw_length:
            raise _corrupt(codec, view.nbytes, view.nbytes, raw_length)
        _native.copy_host([(out, _address(view), raw_length)], threads=1)
    elif codec == "zstd" or element_size == 1 or raw_length < element_size:
        _zstd_into(view, codec, out, raw_length)
    else:
        _check_frame(view, codec, raw_length)  # before the scratch is sized by raw_length
        scratch = _state.scratch_address(raw_length)
        _zstd_into(view, codec, scratch, raw_length)
        _native.byte_unshuffle(out, scratch, raw_length, element_size, threads=1)


__all__ = ["CODECS", "ELEMENT_SIZES", "check_header", "decode", "encode", "release_scratch"]

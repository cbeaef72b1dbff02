"""Tests of the chunk codecs (snapcore/codec.py) and the native byte shuffle under them."""

from __future__ import annotations

import ctypes
import random
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import zstandard
from gil import releases_gil, runs_python_during

from snapcore import _native, codec, manifest
from snapcore.errors import CorruptSnapshot

MiB = 1 << 20
GUARD = 4096  # bytes after every output buffer that no call may touch
GUARD_BYTE = 0xA5


def read(address: int, n: int) -> bytes:
    return ctypes.string_at(address, n)


def fill(address: int, data: bytes) -> None:
    ctypes.memmove(address, data, len(data))


class Buffer:
    """`n` bytes of host memory followed by GUARD guard bytes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.arena = _native.Arena(n + GUARD, pin=False)
        self.address = self.arena.address
        fill(self.address + n, bytes([GUARD_BYTE]) * GUARD)

    def bytes(self) -> bytes:
        return read(self.address, self.n)

    def guard_intact(self) -> bool:
        return read(self.address + self.n, GUARD) == bytes([GUARD_BYTE]) * GUARD

    def close(self) -> None:
        self.arena.close()


def reference_shuffle(data: bytes, element_size: int) -> bytes:
    n = len(data) // element_size
    body = bytes(data[i * element_size + k] for k in range(element_size) for i in range(n))
    return body + data[n * element_size :]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


# --- byte_shuffle / byte_unshuffle ----------------------------------------------------


def test_shuffle_layout_on_a_small_example():
    # Five 4-byte elements and two trailing bytes: byte k of every element, then the tail.
    src = bytes([0x10, 0x11, 0x12, 0x13, 0x20, 0x21, 0x22, 0x23, 0x30, 0x31, 0x32, 0x33])
    src += bytes([0x40, 0x41, 0x42, 0x43, 0x50, 0x51, 0x52, 0x53, 0xEE, 0xFF])
    expected = bytes([0x10, 0x20, 0x30, 0x40, 0x50, 0x11, 0x21, 0x31, 0x41, 0x51])
    expected += bytes([0x12, 0x22, 0x32, 0x42, 0x52, 0x13, 0x23, 0x33, 0x43, 0x53, 0xEE, 0xFF])
    a, b = Buffer(len(src)), Buffer(len(src))
    fill(a.address, src)
    _native.byte_shuffle(b.address, a.address, len(src), 4)
    assert b.bytes() == expected == reference_shuffle(src, 4)
    _native.byte_unshuffle(a.address, b.address, len(src), 4)
    assert a.bytes() == src
    assert a.guard_intact() and b.guard_intact()
    a.close()
    b.close()


def odd_sizes(element_size: int) -> list[int]:
    e = element_size
    sizes = [0, 1, e - 1, e, e + 1, 15 * e, 16 * e, 16 * e + 1, 17 * e - 1, 31 * e + 3]
    sizes += [512 * e, 512 * e + e - 1, 1000 * e + 1, 4096 * e + 7]
    return sorted({n for n in sizes if n >= 0})


@pytest.mark.parametrize("element_size", [1, 2, 4, 8, 16])
def test_shuffle_matches_the_reference_and_round_trips(element_size):
    rng = random.Random(element_size)
    for n in odd_sizes(element_size):
        data = rng.randbytes(n)
        src, mid, back = Buffer(n), Buffer(n), Buffer(n)
        fill(src.address, data)
        _native.byte_shuffle(mid.address, src.address, n, element_size, threads=1)
        if n <= 2048:
            assert mid.bytes() == reference_shuffle(data, element_size), n
        _native.byte_unshuffle(back.address, mid.address, n, element_size, threads=1)
        assert back.bytes() == data, n
        assert mid.guard_intact() and back.guard_intact(), n
        for b in (src, mid, back):
            b.close()


@pytest.mark.parametrize("threads", [0, 2, 3])
@pytest.mark.parametrize("element_size", [2, 4, 8, 16])
def test_shuffle_split_over_threads(element_size, threads):
    """A large input is cut into per-thread ranges: the result is the same as torch's
    transpose of the (elements, bytes) matrix."""
    n = 3 * MiB + 5 * element_size + 3  # several workers' worth, odd element count, a tail
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    count = n // element_size
    expected = torch.cat(
        [
            data[: count * element_size].view(count, element_size).t().reshape(-1),
            data[count * element_size :],
        ]
    )
    out, back = torch.empty(n + GUARD, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    out[n:] = GUARD_BYTE
    _native.byte_shuffle(out.data_ptr(), data.data_ptr(), n, element_size, threads)
    assert torch.equal(out[:n], expected)
    assert bool((out[n:] == GUARD_BYTE).all())
    _native.byte_unshuffle(back.data_ptr(), out.data_ptr(), n, element_size, threads)
    assert torch.equal(back, data)


def test_shuffle_argument_errors():
    a, b = Buffer(4096), Buffer(4096)
    for fn in (_native.byte_shuffle, _native.byte_unshuffle):
        with pytest.raises(ValueError, match="element_size must be 1, 2, 4, 8 or 16, not 3"):
            fn(b.address, a.address, 96, 3)
        with pytest.raises(ValueError, match="overlap"):
            fn(a.address + 8, a.address, 64, 4)
        with pytest.raises(ValueError, match="null"):
            fn(0, a.address, 64, 4)
        fn(0, 0, 0, 4)  # nothing to do, nothing checked but the element size
    assert b.guard_intact()
    a.close()
    b.close()


def test_shuffle_releases_the_gil():
    arenas: list[_native.Arena] = []

    def make(n: int) -> Callable[[], None]:
        a, b = _native.Arena(n, pin=False), _native.Arena(n, pin=False)
        arenas.extend((a, b))  # allocated and faulted outside the call that is checked
        return lambda: _native.byte_shuffle(b.address, a.address, n, 16, threads=1)

    try:
        assert releases_gil(make, 32 * MiB)
    finally:
        for a in arenas:
            a.close()


def test_a_call_holding_the_gil_is_caught():
    """The check above can fail: a call that keeps the GIL (sorting in C) is reported."""
    big = list(range(1 << 20))[::-1]
    assert not runs_python_during(lambda: sorted(big))


# --- encode / decode ------------------------------------------------------------------


def test_codecs_match_the_manifest():
    assert codec.CODECS == manifest.CODECS


def sample(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-128, 128, (numel,), dtype=dtype, generator=g)
    return (torch.randn(numel, generator=g) * 0.02).to(dtype)


def decode_to_bytes(stored, *, codec_name: str, element_size: int, raw_length: int) -> bytes:
    out = Buffer(raw_length)
    try:
        codec.decode(
            stored,
            codec=codec_name,
            element_size=element_size,
            raw_length=raw_length,
            out=out.address,
        )
        assert out.guard_intact()
        return out.bytes()
    finally:
        out.close()


@pytest.mark.parametrize("codec_name", codec.CODECS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64]
)
@pytest.mark.parametrize("numel", [0, 1, 17, 100_003, MiB + 5])
def test_round_trip_is_bit_exact(codec_name, dtype, numel):
    t = sample(dtype, numel, seed=numel)
    raw = tensor_bytes(t)
    stored = codec.encode(raw, codec=codec_name, element_size=t.element_size(), level=3)
    if codec_name == "none":
        assert stored is raw  # no copy
    out = torch.empty_like(t)
    codec.decode(
        stored,
        codec=codec_name,
        element_size=t.element_size(),
        raw_length=raw.nbytes,
        out=out.data_ptr(),
    )
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("codec_name", codec.CODECS)
@pytest.mark.parametrize("element_size", [2, 4, 8, 16])
def test_round_trip_of_lengths_not_a_multiple_of_the_element(codec_name, element_size):
    data = random.Random(element_size).randbytes(1000 * element_size + element_size - 1)
    for n in (len(data), element_size - 1, 1, 0):
        # Read-only input (bytes), and the stored form back as bytes too.
        stored = bytes(
            codec.encode(memoryview(data[:n]), codec=codec_name, element_size=element_size)
        )
        got = decode_to_bytes(
            stored, codec_name=codec_name, element_size=element_size, raw_length=n
        )
        assert got == data[:n]


def test_shuffle_zstd_equals_zstd_of_the_shuffled_bytes():
    t = sample(torch.float32, 10_001)
    raw = tensor_bytes(t)
    shuffled = reference_shuffle(bytes(raw[:4096]), 4)
    stored = codec.encode(raw[:4096], codec="shuffle-zstd", element_size=4, level=3)
    assert zstandard.ZstdDecompressor().decompress(stored) == shuffled


@pytest.mark.parametrize("level", [1, 3, 9, -5])
def test_levels(level):
    raw = tensor_bytes(sample(torch.float32, 50_000))
    for name in ("zstd", "shuffle-zstd"):
        stored = codec.encode(raw, codec=name, element_size=4, level=level)
        assert decode_to_bytes(stored, codec_name=name, element_size=4, raw_length=raw.nbytes) == (
            raw.tobytes()
        )


def test_unknown_codec_and_element_size():
    raw = memoryview(b"abcd")
    with pytest.raises(ValueError, match="unknown codec 'lz4'"):
        codec.encode(raw, codec="lz4")
    with pytest.raises(ValueError, match="element_size"):
        codec.encode(raw, codec="shuffle-zstd", element_size=3)
    with pytest.raises(ValueError, match="unknown codec"):
        codec.decode(raw, codec="gzip", element_size=1, raw_length=4, out=1)
    with pytest.raises(ValueError, match="raw_length"):
        codec.decode(raw, codec="none", element_size=1, raw_length=-1, out=1)
    with pytest.raises(ValueError, match="null"):
        codec.decode(raw, codec="none", element_size=1, raw_length=4, out=0)


def adam_exp_avg_sq_like(numel: int) -> torch.Tensor:
    """Small positive values with a long tail: squared gradients of a few scales, averaged
    with Adam's beta2 over some steps."""
    g = torch.Generator().manual_seed(7)
    scale = torch.empty(numel).log_normal_(0.0, 1.5, generator=g) * 1e-3
    v = torch.zeros(numel)
    for _ in range(5):
        grad = torch.randn(numel, generator=g) * scale
        v.mul_(0.999).addcmul_(grad, grad, value=0.001)
    return v


@pytest.mark.parametrize("kind", ["weights", "exp_avg_sq"])
def test_shuffle_compresses_float32_better_than_zstd(kind):
    numel = 2 * MiB
    t = sample(torch.float32, numel) if kind == "weights" else adam_exp_avg_sq_like(numel)
    raw = tensor_bytes(t)
    ratios = {}
    for name in ("zstd", "shuffle-zstd"):
        stored = codec.encode(raw, codec=name, element_size=4, level=3)
        ratios[name] = raw.nbytes / len(stored)
    # Measured: 1.08 vs 1.17 (weights), 1.07 vs 1.16 (exp_avg_sq).
    assert ratios["shuffle-zstd"] > 1.05 * ratios["zstd"], ratios


# --- hostile input ----------------------------------------------------------------------


def frame_content_size_field(frame: bytes) -> tuple[int, int]:
    """(offset, size) of the Frame_Content_Size field of a zstd frame header (RFC 8878)."""
    descriptor = frame[4]
    single_segment = (descriptor >> 5) & 1
    offset = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 3]
    size = (1 if single_segment else 0, 2, 4, 8)[descriptor >> 6]
    return offset, size


def with_content_size(frame: bytes, claimed: int) -> bytes:
    offset, size = frame_content_size_field(frame)
    assert size == 4, "the test data has a 4-byte content size field"
    return frame[:offset] + struct.pack("<I", claimed) + frame[offset + size :]


HOSTILE = ["truncated", "claims_more", "claims_less", "lies_about_size", "no_content_size"]
HOSTILE += ["two_frames", "garbage", "empty", "reserved_block_type", "none_wrong_length"]


def hostile(kind: str, raw: bytes, codec_name: str, element_size: int) -> bytes:
    good = bytes(codec.encode(memoryview(raw), codec=codec_name, element_size=element_size))
    bigger = bytes(
        codec.encode(memoryview(raw + raw[:999]), codec=codec_name, element_size=element_size)
    )
    if kind == "truncated":
        return good[: len(good) // 2]
    if kind == "claims_more":  # a whole, valid frame of more bytes than the chunk has
        return bigger
    if kind == "claims_less":
        return bytes(codec.encode(memoryview(raw[:-1]), codec=codec_name, element_size=1))
    if kind == "lies_about_size":  # a frame of more bytes, its header edited to fit
        return with_content_size(bigger, len(raw))
    if kind == "no_content_size":
        c = zstandard.ZstdCompressor().compressobj()  # streaming: the size is unknown
        return c.compress(raw) + c.flush()
    if kind == "two_frames":
        return good + good
    if kind == "garbage":
        return random.Random(3).randbytes(len(good))
    if kind == "empty":
        return b""
    if kind == "reserved_block_type":  # the first block's header says type 3 (reserved)
        damaged = bytearray(good)
        damaged[zstandard.frame_header_size(good)] |= 0b110
        return bytes(damaged)
    if kind == "none_wrong_length":
        return raw[:-1]
    raise AssertionError(kind)


@pytest.mark.parametrize("codec_name", ["zstd", "shuffle-zstd"])
@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_input_is_corrupt_snapshot_and_stays_inside_the_output(kind, codec_name):
    raw = tensor_bytes(sample(torch.float32, 40_000)).tobytes()  # 160 kB: 4-byte size field
    stored = hostile(kind, raw, codec_name, 4)
    name = "none" if kind == "none_wrong_length" else codec_name
    out = Buffer(len(raw))
    before = out.bytes()
    try:
        with pytest.raises(CorruptSnapshot, match=r"decode") as info:
            codec.decode(stored, codec=name, element_size=4, raw_length=len(raw), out=out.address)
        assert out.guard_intact()
        if kind in ("claims_more", "claims_less", "no_content_size", "none_wrong_length"):
            assert out.bytes() == before  # refused before anything was written
    finally:
        out.close()
    message = str(info.value)
    if kind == "claims_more":
        assert f"decodes to {len(raw) + 999} bytes, expected {len(raw)}" in message
    if kind == "claims_less":
        assert f"decodes to {len(raw) - 1} bytes, expected {len(raw)}" in message
    if kind == "two_frames":
        assert f"decodes to more than {len(raw)} bytes" in message


@pytest.mark.parametrize("codec_name", ["zstd", "shuffle-zstd"])
def test_damaged_data_never_writes_outside_the_output(codec_name):
    """zstd frames carry no checksum here (the chunk's XXH3 covers the decoded bytes):
    damage inside a block may decode to wrong bytes without an error, but never to
    bytes outside the output."""
    raw = tensor_bytes(sample(torch.float32, 40_000)).tobytes()
    good = bytes(codec.encode(memoryview(raw), codec=codec_name, element_size=4))
    rng = random.Random(5)
    outcomes = set()
    for _ in range(30):
        damaged = bytearray(good)
        for _ in range(rng.randrange(1, 8)):
            i = rng.randrange(zstandard.frame_header_size(good), len(good))
            damaged[i] ^= 1 << rng.randrange(8)
        out = Buffer(len(raw))
        try:
            codec.decode(
                bytes(damaged),
                codec=codec_name,
                element_size=4,
                raw_length=len(raw),
                out=out.address,
            )
            # Decoded: wrong bytes (the chunk's hash tells) or, rarely, the right ones.
            outcomes.add("decoded")
        except CorruptSnapshot:
            outcomes.add("refused")
        assert out.guard_intact()
        out.close()
    assert outcomes


def test_decode_never_writes_past_a_short_output():
    """A frame of 1 MiB decoded as a chunk of 1000 bytes: refused, and the 1000 bytes'
    neighbours untouched, with every codec."""
    raw = tensor_bytes(sample(torch.float32, MiB // 4)).tobytes()
    for name in ("none", "zstd", "shuffle-zstd"):
        stored = codec.encode(memoryview(raw), codec=name, element_size=4)
        out = Buffer(1000)
        with pytest.raises(CorruptSnapshot, match=f"decodes to {len(raw)} bytes, expected 1000"):
            codec.decode(stored, codec=name, element_size=4, raw_length=1000, out=out.address)
        assert out.guard_intact()
        out.close()


# --- threads and the GIL ----------------------------------------------------------------


def test_encode_decode_from_four_threads():
    jobs = []
    for i in range(24):
        dtype = (torch.float32, torch.bfloat16, torch.float16, torch.int8)[i % 4]
        t = sample(dtype, 200_000 + 37 * i, seed=i)
        jobs.append((t, codec.CODECS[i % 3], (1, 3)[i % 2]))
    expected = [
        bytes(codec.encode(tensor_bytes(t), codec=c, element_size=t.element_size(), level=lv))
        for t, c, lv in jobs
    ]
    start = threading.Barrier(4)

    def run(worker: int) -> None:
        start.wait()
        for _ in range(3):
            for i in range(worker, len(jobs), 4):
                t, name, level = jobs[i]
                es = t.element_size()
                stored = codec.encode(tensor_bytes(t), codec=name, element_size=es, level=level)
                assert bytes(stored) == expected[i]  # zstd is deterministic
                out = torch.empty_like(t)
                codec.decode(
                    stored,
                    codec=name,
                    element_size=es,
                    raw_length=t.numel() * es,
                    out=out.data_ptr(),
                )
                assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))
            codec.release_scratch()

    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(run, w) for w in range(4)]:
            f.result()


@pytest.mark.parametrize("direction", ["encode", "decode"])
def test_shuffle_zstd_releases_the_gil(direction):
    def make(n: int) -> Callable[[], None]:
        raw = tensor_bytes(sample(torch.float32, n // 4))
        stored = codec.encode(raw, codec="shuffle-zstd", element_size=4, level=3)
        out = torch.empty(raw.nbytes, dtype=torch.uint8)
        if direction == "encode":
            return lambda: codec.encode(raw, codec="shuffle-zstd", element_size=4, level=3)
        return lambda: codec.decode(
            stored, codec="shuffle-zstd", element_size=4, raw_length=raw.nbytes, out=out.data_ptr()
        )

    assert releases_gil(make, 16 * MiB)


def test_release_scratch():
    raw = tensor_bytes(sample(torch.float32, 1000))
    stored = codec.encode(raw, codec="shuffle-zstd", element_size=4)
    codec.release_scratch()
    codec.release_scratch()
    again = codec.encode(raw, codec="shuffle-zstd", element_size=4)
    assert bytes(again) == bytes(stored)

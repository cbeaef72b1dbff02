"""Where each tensor's bytes go: blobs in the data file (= the host arena's byte image).

Tensors that share a storage are saved once: identical views are already one tensor
(tree.flatten), different views of one storage share a blob that spans their bytes. A
tensor alone on its storage is saved as its logical, contiguous bytes, so a strided view
of a big storage costs only its own elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..manifest import Piece, TensorEntry, dtype_name

ALIGN = 64  # blob alignment in the arena/file: cache lines, and >= every dtype's itemsize
CHUNK_BYTES = 64 << 20  # chunks: the unit of hashing, damage reporting and parallel reads


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


@dataclass
class BlobPlan:
    """One blob: ``nbytes`` at ``offset`` in the data file, copied from ``source``.

    ``raw`` blobs are a byte range of device memory starting at ``src_ptr`` (memcpy-able);
    the other kind is a strided tensor whose logical contents must be gathered (torch copy).
    """

    offset: int
    nbytes: int
    source: torch.Tensor
    raw: bool
    src_ptr: int
    tensors: list[int]
    element_size: int = 1  # the item size of its tensors (1 when they differ): for byte-shuffle

    @property
    def device(self) -> torch.device:
        return self.source.device


@dataclass
class Layout:
    blobs: list[BlobPlan]
    entries: list[TensorEntry]
    total: int  # bytes of the data file image (last blob's end)

    @property
    def data_bytes(self) -> int:
        return sum(b.nbytes for b in self.blobs)

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> list[list[tuple[int, int]]]:
        """(file offset, length) of each chunk, per blob."""
        out = []
        for b in self.blobs:
            out.append(
                [
                    (b.offset + s, min(chunk_bytes, b.nbytes - s))
                    for s in range(0, b.nbytes, chunk_bytes)
                ]
            )
        return out


def plan(tensors: list[torch.Tensor]) -> Layout:
    groups: dict[tuple[torch.device, int], list[int]] = {}
    for i, t in enumerate(tensors):
        ptr = t.untyped_storage().data_ptr()
        # Empty tensors may share a null storage pointer; never group them.
        key = (t.device, ptr if (ptr and t.numel()) else -1 - i)
        groups.setdefault(key, []).append(i)

    entries: list[TensorEntry | None] = [None] * len(tensors)
    blobs: list[BlobPlan] = []
    offset = 0
    for members in groups.values():
        b_i = len(blobs)
        if len(members) == 1:
            t = tensors[members[0]]
            shape = tuple(t.shape)
            nbytes = t.numel() * t.element_size()
            raw = t.is_contiguous()
            blobs.append(
                BlobPlan(
                    offset, nbytes, t, raw, t.data_ptr() if raw else 0, members, t.element_size()
                )
            )
            entries[members[0]] = TensorEntry(
                dtype_name(t.dtype),
                shape,
                [Piece((0,) * len(shape), shape, b_i, 0, contiguous_strides(shape))],
            )
        else:
            # Several views of one storage: save the byte span that covers all of them.
            base = tensors[members[0]].untyped_storage().data_ptr()
            lo = min(tensors[i].storage_offset() * tensors[i].element_size() for i in members)
            lo -= lo % 16  # keeps every view's byte_offset a multiple of its itemsize
            hi = max(_end_byte(tensors[i]) for i in members)
            nbytes = hi - lo
            span = tensors[members[0]]
            sizes = {tensors[i].element_size() for i in members}
            element_size = sizes.pop() if len(sizes) == 1 else 1
            blobs.append(BlobPlan(offset, nbytes, span, True, base + lo, members, element_size))
            for i in members:
                t = tensors[i]
                shape = tuple(t.shape)
                entries[i] = TensorEntry(
                    dtype_name(t.dtype),
                    shape,
                    [
                        Piece(
                            (0,) * len(shape),
                            shape,
                            b_i,
                            t.storage_offset() * t.element_size() - lo,
                            tuple(t.stride()),
                        )
                    ],
                )
        offset = align_up(offset + blobs[-1].nbytes, ALIGN)
    total = blobs[-1].offset + blobs[-1].nbytes if blobs else 0
    assert all(e is not None for e in entries)
    return Layout(blobs, [e for e in entries if e is not None], total)


def _end_byte(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return t.storage_offset() * t.element_size()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return (t.storage_offset() + last + 1) * t.element_size()

"""snapcore.write.stream.StreamWriter: a snapshot written tensor by tensor (convert's
snapcore target) is an ordinary committed snapshot, chunked and hashed as snapcore.save
chunks and hashes the same tensors, and a failure leaves no committed step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import snapcore
from snapcore.cli.main import main as cli
from snapcore.directory import LocalDirectory
from snapcore.write.stream import StreamWriter


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(700, 1000, generator=g),  # 2.8 MB: three 1 MiB chunks
        "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "ints": torch.arange(1 << 18, dtype=torch.int64),  # 2 MiB: exactly two chunks
    }


def _tree(names: list[str]) -> dict[str, object]:
    return {"dict": [[n, {"tensor": i}] for i, n in enumerate(names)]}


def _write(root: Path, state: dict[str, torch.Tensor], piece: int) -> None:
    """Each tensor in pieces of ``piece`` bytes (not a multiple of the chunk size)."""
    w = StreamWriter(root, 7)
    for t in state.values():
        i = w.add_tensor(t.dtype, tuple(t.shape))
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)
        for at in range(0, raw.numel(), piece):
            w.write(i, at, raw[at : at + piece].contiguous())
    w.commit(_tree(list(state)))


@pytest.mark.parametrize("piece", [700_001, 1 << 40])
def test_same_chunks_and_hashes_as_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int
) -> None:
    monkeypatch.setenv("SNAPCORE_CHUNK_MB", "1")
    state = _state()
    _write(tmp_path / "stream", state, piece)
    snapcore.save(state, tmp_path / "save", step=7)
    snapcore.close()
    got = LocalDirectory(tmp_path / "stream").read_manifest(7)
    want = LocalDirectory(tmp_path / "save").read_manifest(7)
    assert got.tree == want.tree
    for a, b in zip(got.tensors, want.tensors, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        ca = [(c.xxh3, c.raw_length, c.codec) for c in got.blobs[a.pieces[0].blob].chunks]
        cb = [(c.xxh3, c.raw_length, c.codec) for c in want.blobs[b.pieces[0].blob].chunks]
        assert ca == cb
    assert len(got.blobs[got.tensors[0].pieces[0].blob].chunks) == 3
    out = snapcore.load(tmp_path / "stream")
    assert list(out) == list(state)
    for k, t in state.items():
        assert out[k].dtype == t.dtype and torch.equal(out[k], t), k
    assert cli(["verify", str(tmp_path / "stream")]) == 0


def test_pieces_out_of_order_are_refused(tmp_path: Path) -> None:
    w = StreamWriter(tmp_path, 0)
    i = w.add_tensor(torch.float32, (10,))
    w.write(i, 0, torch.zeros(4))
    with pytest.raises(ValueError, match="in order"):
        w.write(i, 0, torch.zeros(4))  # again
    with pytest.raises(ValueError, match="in order"):
        w.write(i, 20, torch.zeros(6))  # a gap
    with pytest.raises(ValueError, match="in order"):
        w.write(i, 16, torch.zeros(7))  # past the end
    w.abort()


def test_incomplete_tensor_fails_commit_and_leaves_nothing(tmp_path: Path) -> None:
    snapcore.save({"old": torch.ones(3)}, tmp_path, step=1)
    snapcore.close()
    w = StreamWriter(tmp_path, 2)
    i = w.add_tensor(torch.float32, (1000,))
    w.write(i, 0, torch.ones(100))
    with pytest.raises(ValueError, match="not whole"):
        w.commit(_tree(["t"]))
    assert LocalDirectory(tmp_path).committed_steps() == [1]
    assert not (tmp_path / "step-000000000002").exists()  # data file and lock removed
    assert torch.equal(snapcore.load(tmp_path)["old"], torch.ones(3))


def test_abort_keeps_the_committed_step_it_would_replace(tmp_path: Path) -> None:
    snapcore.save({"t": torch.ones(3)}, tmp_path, step=4)
    snapcore.close()
    step = tmp_path / "step-000000000004"
    before = sorted(p.name for p in step.iterdir())
    w = StreamWriter(tmp_path, 4)
    w.add(torch.zeros(1000))
    assert len(list(step.glob("data-*"))) == 2  # the old one and this writer's
    w.abort()
    assert sorted(p.name for p in step.iterdir()) == before
    assert LocalDirectory(tmp_path).committed_steps() == [4]
    assert torch.equal(snapcore.load(tmp_path)["t"], torch.ones(3))


def test_another_process_cannot_save_while_it_streams(tmp_path: Path) -> None:
    w = StreamWriter(tmp_path, 0)
    w.add(torch.ones(2))
    code = (
        "import sys, torch, snapcore\n"
        "try:\n"
        f"    snapcore.save({{'y': torch.ones(1)}}, {str(tmp_path)!r}, step=1)\n"
        "except snapcore.StoreInUse:\n"
        "    sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
    assert done.returncode == 3, done.stderr.decode()[-2000:]
    w.commit(_tree(["x"]))
    assert LocalDirectory(tmp_path).committed_steps() == [0]
    assert torch.equal(snapcore.load(tmp_path)["x"], torch.ones(2))


def test_tensors_interleaved_keep_their_own_bytes(tmp_path: Path) -> None:
    """A tensor placed while another is partly written goes after the whole of that one
    (its blob is reserved when placed), not over its later pieces."""
    a = torch.arange(4096, dtype=torch.int32)
    b = torch.full((1000,), 7, dtype=torch.int32)
    w = StreamWriter(tmp_path, 0)
    i = w.add_tensor(a.dtype, tuple(a.shape))
    w.write(i, 0, a[:100].contiguous())
    j = w.add(b)
    w.write(i, 400, a[100:].contiguous())
    w.commit({"dict": [["a", {"tensor": i}], ["b", {"tensor": j}]]})
    out = snapcore.load(tmp_path)
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)
    assert cli(["verify", str(tmp_path)]) == 0


def test_a_failed_write_makes_the_writer_refuse_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A piece that failed may be hashed and not written: the writer then refuses further
    pieces and the commit, instead of committing digests that do not match the bytes."""
    w = StreamWriter(tmp_path, 0)
    i = w.add_tensor(torch.float32, (8,))
    real = w._writer

    class Failing:
        def write_at(self, *args: object) -> None:
            raise OSError(28, "No space left on device")

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    w._writer = Failing()
    with pytest.raises(OSError, match="No space"):
        w.write(i, 0, torch.ones(8))
    w._writer = real
    with pytest.raises(RuntimeError, match=r"tensor 0, bytes \[0, 32\).*No space"):
        w.write(i, 0, torch.ones(8))  # a retry would hash the piece twice
    with pytest.raises(RuntimeError, match="a write failed"):
        w.commit(_tree(["t"]))
    assert LocalDirectory(tmp_path).committed_steps() == []

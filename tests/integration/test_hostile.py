"""Every store of the hostile corpus (tests/integration/hostile/corpus.py) gives a snapcore
error, or a one-line message and a non-zero exit from the CLI: no Python error, no traceback, no
hang, nothing read from outside the store."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile.corpus import CASES, PART_MISSING, STEP, Case

import snapcore
from snapcore.cli import main
from snapcore.read import verify_snapshot
from snapcore.tiers import LocalTier

HANG_S = 120  # far beyond what these tiny stores take: only a hang gets there

BY_NAME = {c.name: c for c in CASES}


def _unblock_fifos(root: Path) -> None:
    """Open the write end of every FIFO under ``root`` and close it: a reader blocked in
    open() (or read()) on one then returns, so that a hung test can end."""
    if not root.is_dir():
        return
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if stat.S_ISFIFO(os.lstat(path).st_mode):
                with contextlib.suppress(OSError):
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def _bounded(root: Path, fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread; a hang fails the test (after the FIFOs are unblocked)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)
    if t.is_alive():
        _unblock_fifos(root)
        t.join(HANG_S)
        pytest.fail(f"hung for {HANG_S} s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def _like_state() -> dict[str, Any]:
    return {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float64), "n": 0, "lr": 0.0}


def _verify(root: Path) -> list[snapcore.CorruptSnapshot]:
    tier = LocalTier(root)
    return verify_snapshot(tier, tier.store.resolve_step(None))


@pytest.fixture
def hostile(request, tmp_path) -> tuple[Case, Path]:
    case = BY_NAME[request.param]
    root = tmp_path / "store"
    case.build(root)
    return case, root


def _expect(case: Case, root: Path, fn: Callable[[], Any]) -> Any:
    if case.expect is None:
        return _bounded(root, fn)
    with pytest.raises(case.expect) as e:
        out = _bounded(root, fn)
        if isinstance(out, list) and out:  # verify_snapshot returns the damaged chunks
            raise out[0]
    assert case.match in str(e.value)
    return None


@pytest.mark.parametrize("hostile", sorted(BY_NAME), indirect=True)
def test_api_restore_load_verify(hostile):
    case, root = hostile
    state = _like_state()
    info = _expect(case, root, lambda: snapcore.restore(state, root))
    if case.expect is None:
        assert info.step == case.ok_step
        assert torch.equal(state["w"], torch.arange(12, dtype=torch.float32).view(3, 4))
    out = _expect(case, root, lambda: snapcore.load(root))
    if case.expect is None:
        assert out["n"] == 3
    damaged = _expect(case, root, lambda: _verify(root))
    if case.expect is None:
        assert damaged == []


@pytest.mark.parametrize("hostile", sorted(BY_NAME), indirect=True)
def test_cli_ls_inspect_verify(hostile, capsys):
    case, root = hostile
    for verb in ("ls", "inspect", "verify"):
        rc = _bounded(root, lambda verb=verb: main([verb, str(root)]))
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        if case.expect is None:
            assert rc == 0, err
            if verb == "verify":
                assert f"step {STEP}: intact" in out
            continue
        if verb == "verify" or (verb == "inspect" and case.expect is not snapcore.CorruptSnapshot):
            # a manifest-level error ends the command with one line; verify also reports
            # damaged data (one line per damaged chunk, then a summary)
            assert rc == 1
            assert err.strip(), f"{verb}: no message"
            if case.expect is not snapcore.CorruptSnapshot:
                assert len(err.strip().splitlines()) == 1, err
            assert case.match in err


@pytest.mark.parametrize("name", ["created-400-digits", "fifo-data-file", "store-is-a-file"])
def test_cli_subprocess_prints_one_line(name, tmp_path):
    root = tmp_path / "store"
    BY_NAME[name].build(root)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "snapcore", "verify", str(root)],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            check=False,
        )
    finally:
        _unblock_fifos(root)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_missing_part_is_named_when_one_of_its_pieces_is_needed(tmp_path):
    """A local directory may hold some ranks' parts only (a node's): its manifest reads,
    verify checks the chunks it holds, and a read needing a missing part's piece raises
    CorruptSnapshot naming that part's file."""
    root = tmp_path / "store"
    PART_MISSING.build(root)
    m = LocalTier(root).read_manifest(STEP)
    assert m.missing_ranks == [1] and m.missing_parts[0].endswith(
        PART_MISSING.match + "0123456789ab.json"
    )
    for fn in (lambda: snapcore.restore(_like_state(), root), lambda: snapcore.load(root)):
        with pytest.raises(snapcore.CorruptSnapshot, match=PART_MISSING.match) as e:
            _bounded(root, fn)
        assert "in none of the tiers read here" in str(e.value)
    assert _verify(root) == []


# -- the mechanisms behind the corpus, one at a time ------------------------------------------
def test_shuffle_decode_checks_the_frame_before_reserving_raw_length():
    """A frame of 4 KiB whose chunk claims 2^40 bytes is refused from its header; the
    scratch buffer the byte-unshuffle needs is never sized by the claim."""
    from snapcore import codec

    data = bytes(codec.encode(memoryview(bytes(4096)), codec="shuffle-zstd", element_size=4))
    codec.release_scratch()
    out = torch.empty(16, dtype=torch.uint8)
    with pytest.raises(snapcore.CorruptSnapshot, match="decodes to 4096 bytes"):
        codec.decode(
            data, codec="shuffle-zstd", element_size=4, raw_length=1 << 40, out=out.data_ptr()
        )
    assert codec._state.scratch is None


def test_verify_reserves_no_buffer_for_a_size_the_frame_does_not_declare(tmp_path, monkeypatch):
    """`snapcore verify` sized its buffers by the largest raw_length claimed, before reading
    anything; now a chunk's buffer comes after its frame header has declared that size."""
    root = tmp_path / "store"
    BY_NAME["frame-size-mismatch"].build(root)
    claimed = max(c.raw_length for b in LocalTier(root).read_manifest(STEP).blobs for c in b.chunks)
    sizes: list[int] = []
    empty = torch.empty

    def recording_empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        sizes.append(int(size[0]) if size and isinstance(size[0], int) else -1)
        return empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    damaged = _verify(root)
    assert damaged and "decodes to" in str(damaged[0])
    assert sizes and max(sizes) < claimed


def test_zero_length_read_does_not_open_the_file(tmp_path):
    root = tmp_path / "store"
    (root / "d").mkdir(parents=True)
    os.mkfifo(root / "d" / "f.bin")
    tier = LocalTier(root)
    _bounded(root, lambda: tier.read_into("d/f.bin", 0, 0, 0))


def test_native_read_refuses_a_fifo_without_blocking(tmp_path):
    from snapcore import _native

    os.mkfifo(tmp_path / "f")
    buf = torch.empty(8, dtype=torch.uint8)
    with pytest.raises(snapcore.SnapcoreError, match="not a regular file"):
        _bounded(tmp_path, lambda: _native.read_into(str(tmp_path / "f"), 0, 8, buf.data_ptr()))

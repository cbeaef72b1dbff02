"""snapcore convert holds at most two reads in flight, whatever the checkpoint's size
(docs/cli.md, "convert"): a tensor larger than the window is converted in ranges, a
smaller one whole, and the snapcore, safetensors, DCP and torch targets keep none of them.

Measured in a child process as its peak RSS (``VmHWM``, reset with ``clear_refs`` just
before the conversion) above its RSS at that point. The child runs with glibc's mmap
threshold fixed at 1 MiB (``MALLOC_MMAP_THRESHOLD_``), so every buffer of 1 MiB or more
is a mapping of its own, returned to the kernel when freed: RSS then counts the buffers
alive, not what the allocator keeps for reuse (with its default, dynamic threshold the
heap keeps freed tensors' memory and the figure wanders by tens of MB). Nothing here is
timed. The state is 256 MiB: 24 tensors of 8 MiB and one of 64 MiB; a sink that gathered
the checkpoint (the snapcore, DCP and torch sinks did, before they streamed) shows 256 MiB
or more (the snapcore sink showed 512 MiB: the tensors and the engine's staging copy; the
torch sink 320 MiB, with either window).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from snapcore.convert.base import TensorInfo
from snapcore.convert.safetensors_fmt import SafetensorsSink

MIB = 1 << 20

CHILD = r"""
import json, sys
from snapcore.convert import convert

def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

src, out, window = sys.argv[1], sys.argv[2], int(sys.argv[3]) or None
convert(src, out + "-warm", to="snapcore", only=["layers.0.*"])  # imports, threads
peaks = {}
for name, (a, b, to) in {
    "safetensors->snapcore": (src, out + "-snapcore", "snapcore"),
    "safetensors->safetensors": (src, out + "-safetensors", "safetensors"),
    "snapcore->safetensors": (out + "-snapcore", out + "-back", "safetensors"),
    "safetensors->dcp": (src, out + "-dcp", "dcp"),
    "safetensors->torch": (src, out + ".pt", "torch"),
    "snapcore->torch": (out + "-snapcore", out + "-back.pt", "torch"),
}.items():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = rss("VmRSS:")
    convert(a, b, to=to, window=window)
    peaks[name] = rss("VmHWM:") - base
print(json.dumps(peaks))
"""


def _source(path: Path) -> list[TensorInfo]:
    """A 256 MiB safetensors directory, written one tensor at a time."""
    infos = [TensorInfo(f"layers.{i}.w", torch.float32, (2 * MIB,)) for i in range(24)]
    infos.append(TensorInfo("big", torch.float32, (16 * MIB,)))
    sink = SafetensorsSink(path, {"shard_size": 100 * MIB})
    sink.write_values({"lr": 0.5})
    sink.begin(infos, {}, {})
    for i, info in enumerate(infos):
        sink.write(info, torch.full(info.shape, float(i)))
    sink.commit({})
    return infos


def _peaks(tmp_path: Path, window: int) -> dict[str, int]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MIB))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "src"), str(tmp_path / "out"), str(window)],
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def _check_output(tmp_path: Path, infos: list[TensorInfo]) -> None:
    import zipfile

    import snapcore

    for pt in ("out.pt", "out-back.pt"):
        with zipfile.ZipFile(tmp_path / pt) as zf:
            assert zf.testzip() is None, pt  # every record's CRC-32 is its bytes'
        back = torch.load(tmp_path / pt, weights_only=True, mmap=True)
        assert back["lr"] == 0.5
        for i, info in enumerate(infos):
            parts = info.name.split(".")
            t = back[parts[0]] if len(parts) == 1 else back[parts[0]][parts[1]][parts[2]]
            assert t.shape == info.shape and bool((t == float(i)).all()), (pt, info.name)

    state = snapcore.load(tmp_path / "out-snapcore")
    assert state["lr"] == 0.5
    for i, info in enumerate(infos):
        parts = info.name.split(".")
        t = state[parts[0]] if len(parts) == 1 else state[parts[0]][parts[1]][parts[2]]
        assert t.shape == info.shape and bool((t == float(i)).all()), info.name


def test_ranges_bound_memory_by_the_window(tmp_path: Path) -> None:
    infos = _source(tmp_path / "src")
    window = 8 * MIB
    peaks = _peaks(tmp_path, window)
    # two reads of at most 8 MiB in flight; the 64 MiB tensor goes in ranges
    assert peaks["safetensors->snapcore"] <= 4 * window, peaks
    assert peaks["safetensors->safetensors"] <= 4 * window, peaks
    assert peaks["safetensors->torch"] <= 4 * window, peaks
    # a snapcore source reads whole chunks (the 64 MiB tensor is one, larger than the
    # window: read whole), and DCP's writer takes whole tensors: the 64 MiB one and the
    # read ahead
    assert peaks["snapcore->safetensors"] <= 64 * MIB + 4 * window, peaks
    assert peaks["safetensors->dcp"] <= 64 * MIB + 4 * window, peaks
    assert peaks["snapcore->torch"] <= 64 * MIB + 4 * window, peaks
    _check_output(tmp_path, infos)


def test_whole_tensors_bound_memory_by_the_largest(tmp_path: Path) -> None:
    """A window larger than every tensor: each is read whole, and still none is kept."""
    infos = _source(tmp_path / "src")
    peaks = _peaks(tmp_path, 1 << 40)
    for name, peak in peaks.items():
        assert peak <= 64 * MIB + 32 * MIB, (name, peaks)  # the largest, one read ahead
    _check_output(tmp_path, infos)

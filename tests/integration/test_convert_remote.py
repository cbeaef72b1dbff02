"""snapcore convert to a snapcore store given as a URL (docs/cli.md, "convert"), on moto's
S3 server: the step is streamed into a temporary local store, then uploaded by snapcore's
own upload (write/upload.py, ``StepUpload``) with the manifest PUT last. The result is
read back bit for bit, is the snapshot a save's upload gives, a failed upload leaves no
committed step, and the error names the target."""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import snapcore
from snapcore.cli.main import main as cli
from snapcore.convert import convert
from snapcore.errors import RemoteError, SnapshotNotFound
from snapcore.objstore import ObjectStoreClient
from snapcore.tiers import RemoteStoreTier
from tests.conftest import _botocore_client, s3_storage_options


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(10, 4, generator=g)
    model = {
        "embed": emb,
        "head": emb,  # tied: one tensor in the snapshot
        "f32": torch.randn(4, 6, generator=g),
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).to(torch.float16),
        "i64": torch.arange(-5, 5, dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "big": torch.randn(3 << 18, generator=g),  # 3 MiB: chunks of 1 MiB (the test's size)
    }
    if hasattr(torch, "float8_e4m3fn"):
        model["fp8"] = torch.randn(8, generator=g).to(torch.float8_e4m3fn)
    return {"lr": 0.001, "name": "adam", "model": model}


def _bits(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    return t.dtype, tuple(t.shape), bytes(t.contiguous().view(-1).view(torch.uint8).numpy())


def _check(back: dict[str, Any], state: dict[str, Any]) -> None:
    assert back["lr"] == state["lr"] and back["name"] == state["name"]
    assert sorted(back["model"]) == sorted(state["model"])
    for k, t in state["model"].items():
        assert _bits(back["model"][k]) == _bits(t), k
    # tied in the source, tied in the target
    assert back["model"]["head"].data_ptr() == back["model"]["embed"].data_ptr()


def _leaves(node: dict[str, Any], path: str = "") -> dict[str, Any]:
    """A manifest tree's leaves by path (dicts' key order left out)."""
    ((kind, value),) = node.items()
    if kind != "dict":
        return {path: node}
    out: dict[str, Any] = {}
    for k, v in value:
        out |= _leaves(v, f"{path}.{k}")
    return out


def _remote_names(url: str, options: dict[str, Any]) -> list[str]:
    with ObjectStoreClient(url, options) as c:
        return c.list("")


@pytest.fixture
def chunk_1mib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNAPCORE_CHUNK_MB", "1")


def test_url_target_reads_back_bit_exact_and_converts_back(
    tmp_path: Path, s3_bucket: Any, chunk_1mib: None
) -> None:
    state = _state()
    snapcore.save(state, tmp_path / "src", step=5)
    snapcore.close()
    url, opts = f"{s3_bucket.url}/conv", s3_bucket.storage_options
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    calls: list[tuple[int, int]] = []
    stats = convert(
        tmp_path / "src",
        url,
        to="snapcore",
        storage_options=opts,
        tmp_dir=tmp,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert stats.aliases == 1 and stats.values == 2
    assert list(tmp.iterdir()) == []  # the temporary store is gone
    # the progress counts the upload too: past the tensors' bytes, up to its total
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and all(d <= t for d, t in calls)
    assert any(d > stats.bytes for d in dones)
    assert dones[-1] == calls[-1][1] >= 2 * stats.bytes
    # one data object and the manifest; the pending mark was removed after the commit
    names = _remote_names(url, opts)
    assert len(names) == 2, names
    assert re.fullmatch(r"step-0+/data-[0-9a-f]+-r0\.bin", names[0]), names
    assert re.fullmatch(r"step-0+/manifest\.json", names[1]), names
    with snapcore.Store(remote=url, storage_options=opts) as store:
        assert snapcore.committed(store) == {"remote": [0]}
        _check(snapcore.load(store), state)
    # and from the URL back to a local store, every chunk's hash checked on the way
    convert(url, tmp_path / "back", to="snapcore", storage_options=opts)
    _check(snapcore.load(tmp_path / "back"), state)
    snapcore.close()


def test_url_target_is_what_a_saves_upload_gives(
    tmp_path: Path, s3_bucket: Any, chunk_1mib: None
) -> None:
    """The same state saved with a remote tier, and converted to a URL: the two remote
    manifests record the same tensors, leaves and chunks (hashes, sizes, codec); only
    where the bytes lie in the data object, the time, the writer and the order of a
    dict's keys (convert puts a tied name after the others) may differ."""
    state = _state()
    opts = s3_bucket.storage_options
    saved_url, conv_url = f"{s3_bucket.url}/saved", f"{s3_bucket.url}/converted"
    with snapcore.Store(local=tmp_path / "a", remote=saved_url, storage_options=opts) as store:
        snapcore.save(state, store, step=0)
    convert(tmp_path / "a", conv_url, to="snapcore", storage_options=opts)

    def record(url: str) -> tuple[Any, ...]:
        tier = RemoteStoreTier(url, opts)
        try:
            m = tier.read_manifest(0)
        finally:
            tier.close()
        chunks = [[(c.xxh3, c.raw_length, c.length, c.codec) for c in b.chunks] for b in m.blobs]
        names = {f.name.split("/")[0] for f in m.files}
        return m.step, m.tensors, _leaves(m.tree), chunks, [b.nbytes for b in m.blobs], names

    saved, converted = record(saved_url), record(conv_url)
    assert any(len(c) > 1 for c in saved[3])  # the 3 MiB tensor is cut into chunks
    assert converted == saved


def test_url_target_that_holds_objects_is_refused(tmp_path: Path, s3_bucket: Any) -> None:
    snapcore.save({"x": torch.ones(3)}, tmp_path / "src", step=0)
    snapcore.close()
    url, opts = f"{s3_bucket.url}/used", s3_bucket.storage_options
    with ObjectStoreClient(url, opts) as c:
        c.put_bytes("notes.txt", b"someone's")
    with pytest.raises(FileExistsError, match=f"{re.escape(url)} is not empty"):
        convert(tmp_path / "src", url, to="snapcore", storage_options=opts)
    assert _remote_names(url, opts) == ["notes.txt"]


def test_temporary_directory_without_room_is_refused_before_any_write(
    tmp_path: Path, s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary store needs room for the whole step: checked before the first
    tensor is written, and the error names the directory and the target."""
    import shutil

    from snapcore.convert import snapcore_fmt

    snapcore.save({"x": torch.ones(1 << 16)}, tmp_path / "src", step=0)
    snapcore.close()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    real = shutil.disk_usage

    def small(path: Any) -> Any:  # a disk with 64 KiB free (the step needs 256 KiB)
        u = real(path)
        return type(u)(u.total, u.total - (64 << 10), 64 << 10)

    monkeypatch.setattr(snapcore_fmt.shutil, "disk_usage", small)
    url, opts = f"{s3_bucket.url}/full", s3_bucket.storage_options
    with pytest.raises(OSError, match=r"needs .* bytes, 65536 are free") as e:
        convert(tmp_path / "src", url, to="snapcore", storage_options=opts, tmp_dir=tmp)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp)
    assert url in str(e.value)
    assert list(tmp.iterdir()) == [] and _remote_names(url, opts) == []


def test_server_lost_during_the_upload_leaves_no_committed_step(
    tmp_path: Path, s3_restartable: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server dies once the data object's upload has begun: the convert fails with
    an error naming the target URL, the temporary store is removed, and once the server
    is back the remote holds no manifest: no committed step, nothing a reader would take."""
    bucket = "outage-convert"
    _botocore_client(s3_restartable.endpoint).create_bucket(Bucket=bucket)
    opts = s3_storage_options(s3_restartable.endpoint)
    url = f"s3://{bucket}/conv"
    snapcore.save(_state(), tmp_path / "src", step=0)
    snapcore.close()
    started = []
    real = ObjectStoreClient.upload_file

    def dying(self: ObjectStoreClient, path: Any, name: str, *rest: Any) -> Any:
        started.append(name)
        s3_restartable.stop()  # the pending mark is written; the data object is not
        return real(self, path, name, *rest)

    monkeypatch.setattr(ObjectStoreClient, "upload_file", dying)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    try:
        with pytest.raises(RemoteError) as e:
            convert(tmp_path / "src", url, to="snapcore", storage_options=opts, tmp_dir=tmp)
    finally:
        s3_restartable.start()
    assert started and url in str(e.value) and e.value.url == url
    assert list(tmp.iterdir()) == []
    names = _remote_names(url, opts)
    assert not any(n.endswith("manifest.json") for n in names), names
    with snapcore.Store(remote=url, storage_options=opts) as store:
        assert snapcore.committed(store) == {"remote": []}
        with pytest.raises(SnapshotNotFound):
            snapcore.load(store)


def test_failed_manifest_put_leaves_no_committed_step(
    tmp_path: Path, s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure at the last request, the manifest's PUT: the data object is there but
    nothing references it (garbage), the pending mark is removed, no step is committed."""
    snapcore.save(_state(), tmp_path / "src", step=0)
    snapcore.close()
    url, opts = f"{s3_bucket.url}/conv", s3_bucket.storage_options

    def refused(self: RemoteStoreTier, m: Any) -> None:
        raise RemoteError("injected: the PUT was refused", url=self.rt.url, name="x", op="put")

    monkeypatch.setattr(RemoteStoreTier, "commit", refused)
    with pytest.raises(RemoteError, match="injected") as e:
        convert(tmp_path / "src", url, to="snapcore", storage_options=opts)
    assert url in str(e.value)
    names = _remote_names(url, opts)
    assert len(names) == 1 and re.fullmatch(r"step-0+/data-[0-9a-f]+-r0\.bin", names[0]), names
    monkeypatch.undo()
    tier = RemoteStoreTier(url, opts)
    try:
        assert tier.committed_steps() == []
        assert tier.collect() == names  # the data object is garbage, no pending mark spares it
    finally:
        tier.close()


def test_cli_converts_safetensors_to_a_url(
    tmp_path: Path, s3_bucket: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI with a non-snapcore source: --storage-options reaches the URL target,
    --tmp-dir holds the temporary store; a dead endpoint fails with exit 1 naming it."""
    import json

    from snapcore.convert.base import TensorInfo
    from snapcore.convert.safetensors_fmt import SafetensorsSink

    info = TensorInfo("w", torch.float32, (1000,))
    sink = SafetensorsSink(tmp_path / "m.safetensors", {})
    sink.write_values({})
    sink.begin([info], {}, {})
    sink.write(info, torch.arange(1000, dtype=torch.float32))
    sink.commit({})
    url = f"{s3_bucket.url}/cli"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    opts = json.dumps(s3_bucket.storage_options)
    args = [str(tmp_path / "m.safetensors"), url, "--to", "snapcore", "--quiet"]
    code = cli(["convert", *args, "--storage-options", opts, "--tmp-dir", str(tmp)])
    assert code == 0, capsys.readouterr().err
    assert list(tmp.iterdir()) == []
    with snapcore.Store(remote=url, storage_options=s3_bucket.storage_options) as store:
        assert bool((snapcore.load(store)["w"] == torch.arange(1000.0)).all())
    capsys.readouterr()
    # a bad --tmp-dir: exit 1 before anything is read or written
    code = cli(["convert", *args, "--storage-options", opts, "--tmp-dir", str(tmp / "no")])
    assert code == 1 and str(tmp / "no") in capsys.readouterr().err


MIB = 1 << 20

MEMORY_CHILD = r"""
import json, sys
from snapcore.convert import convert

def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

src, url, opts, tmp, window = sys.argv[1:6]
kw = dict(to="snapcore", storage_options=json.loads(opts), tmp_dir=tmp, window=int(window))
convert(src, url + "/warm", only=["layers.0.*"], **kw)  # imports, threads, connections
peaks = {}
for name, dst in (("local", tmp + "/local"), ("url", url + "/full")):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = rss("VmRSS:")
    convert(src, dst, **kw)
    peaks[name] = rss("VmHWM:") - base
print(json.dumps(peaks))
"""


def test_url_target_memory_is_bounded_by_the_window_not_the_checkpoint(
    tmp_path: Path, s3_bucket: Any
) -> None:
    """256 MiB of safetensors (24 tensors of 8 MiB, one of 64 MiB) converted with an 8 MiB
    window to a local snapcore target and to a URL one, in a child process whose peak RSS
    growth is measured (as tests/integration/test_convert_memory.py does; moto, in this
    process, holds the uploaded bytes). The URL target adds the upload's part buffers
    (16 MiB parts, at most 5 held) to the local target's two windows; gathering the
    checkpoint, as the URL target did before it streamed, showed twice its 256 MiB."""
    import json
    import os
    import subprocess
    import sys

    from snapcore.convert.base import TensorInfo
    from snapcore.convert.safetensors_fmt import SafetensorsSink

    infos = [TensorInfo(f"layers.{i}.w", torch.float32, (2 * MIB,)) for i in range(24)]
    infos.append(TensorInfo("big", torch.float32, (16 * MIB,)))
    sink = SafetensorsSink(tmp_path / "src", {"shard_size": 100 * MIB})
    sink.write_values({"lr": 0.5})
    sink.begin(infos, {}, {})
    for i, info in enumerate(infos):
        sink.write(info, torch.full(info.shape, float(i)))
    sink.commit({})
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    url = f"{s3_bucket.url}/mem"
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MIB))
    args = [str(tmp_path / "src"), url, json.dumps(s3_bucket.storage_options), str(tmp)]
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, *args, str(8 * MIB)],
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    peaks = json.loads(done.stdout.decode().strip().splitlines()[-1])
    print(peaks)
    assert peaks["local"] <= 32 * MIB, peaks  # two windows of 8 MiB in flight
    # and the upload's part buffers: far under the checkpoint, let alone twice it
    assert peaks["url"] <= 32 * MIB + 5 * 16 * MIB + 16 * MIB, peaks
    assert sorted(p.name for p in tmp.iterdir()) == ["local"]  # the URL's temporary store went
    with snapcore.Store(remote=url + "/full", storage_options=s3_bucket.storage_options) as store:
        state = snapcore.load(store)
    assert state["lr"] == 0.5
    for i, info in enumerate(infos):
        parts = info.name.split(".")
        t = state[parts[0]] if len(parts) == 1 else state[parts[0]][parts[1]][parts[2]]
        assert t.shape == info.shape and bool((t == float(i)).all()), info.name


def test_upload_file_larger_than_the_part_limit_takes_larger_parts(
    tmp_path: Path, s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 takes at most 10,000 parts (here made 2): a file that needs more parts of the
    client's size than that goes up in larger ones (its size is known beforehand), where a
    streamed object of unknown size is refused."""
    from snapcore.objstore import client, multipart

    monkeypatch.setattr(multipart, "S3_MAX_PARTS", 2)
    monkeypatch.setattr(client, "S3_MAX_PARTS", 2)
    data = torch.randint(0, 256, (12 * MIB + 5,), dtype=torch.uint8).numpy().tobytes()
    (tmp_path / "f").write_bytes(data)
    opts = s3_bucket.storage_options
    with ObjectStoreClient(s3_bucket.url, opts, part_bytes=5 * MIB) as c:
        w = c.open_writer("streamed")
        with pytest.raises(RemoteError, match="needs more than 2 parts"):
            for k in range(0, len(data), MIB):
                w.write(data[k : k + MIB])
            w.close()
        size, _ = c.upload_file(tmp_path / "f", "whole")
        assert size == len(data) and c.read_bytes("whole") == data

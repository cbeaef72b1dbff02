"""snapcore.objstore against real parts: moto's S3 server on 127.0.0.1 through s3fs,
memory:// and file://. Faults come from stopping the server and from a loopback proxy
that cuts connections; nothing of s3fs is mocked.

moto keeps objects in memory and moves 50-130 MB/s: objects stay at a few tens of MB.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import select
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from snapcore.errors import StorageError
from snapcore.objstore import ObjectStoreClient, RemoteError, is_transient
from snapcore.objstore.connection import Connection

MiB = 1 << 20
LOOPBACK = "127.0.0.1"
PART = 5 * MiB  # S3's smallest part


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def xxh(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def wait_for_upload_start(s3_client: Any, bucket: str) -> None:
    """Wait (bounded) until a multipart upload exists, so that a fault hits it mid-way."""
    deadline = time.monotonic() + 10
    while not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads"):
        assert time.monotonic() < deadline, "the multipart upload never started"
        time.sleep(0.01)


def retry_warnings(caplog: pytest.LogCaptureFixture, op: str | None = None) -> list[str]:
    out = []
    for r in caplog.records:
        if (
            r.name.startswith("snapcore.objstore.")
            and r.levelno == logging.WARNING
            and "retry" in r.msg
            and (op is None or r.args[0] == op)  # type: ignore[index]
        ):
            out.append(r.getMessage())
    return out


@pytest.fixture
def s3_tier(s3_bucket: Any) -> Iterator[ObjectStoreClient]:
    tier = ObjectStoreClient(
        f"{s3_bucket.url}/run", s3_bucket.storage_options, part_bytes=PART, backoff_s=0.05
    )
    yield tier
    tier.close()


@pytest.fixture(params=["s3", "memory", "file"])
def any_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStoreClient]:
    """The same tests on each kind of store; part_bytes as small as each allows."""
    if request.param == "s3":
        bucket: Any = request.getfixturevalue("s3_bucket")
        tier = ObjectStoreClient(f"{bucket.url}/run", bucket.storage_options, part_bytes=PART)
    elif request.param == "memory":
        tier = ObjectStoreClient(f"memory://snapcore-{os.urandom(6).hex()}", part_bytes=256 << 10)
    else:
        tier = ObjectStoreClient(f"file://{tmp_path}/remote", part_bytes=256 << 10)
    yield tier
    tier.delete(tier.list())
    tier.close()


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("parts", [0.5, 1, 2, 3.4])
def test_writer_round_trip(any_tier: ObjectStoreClient, parts: float) -> None:
    """Objects of less than, exactly, and several parts, written in odd pieces from a buffer
    the caller reuses at once (the writer must have copied it)."""
    data = payload(int(parts * any_tier.part_bytes), seed=1)
    w = any_tier.open_writer("step-000000000001/data-r0.bin")
    scratch = bytearray(1_000_003)
    for i in range(0, len(data), len(scratch)):
        piece = data[i : i + len(scratch)]
        scratch[: len(piece)] = piece
        w.write(memoryview(scratch)[: len(piece)])
        scratch[:] = b"\xff" * len(scratch)  # reused: what the writer kept must be its own
    assert w.close() == (len(data), xxh(data))
    assert w.close() == (len(data), xxh(data))  # idempotent
    assert any_tier.read_bytes("step-000000000001/data-r0.bin") == data
    assert any_tier.size("step-000000000001/data-r0.bin") == len(data)
    assert any_tier.list() == ["step-000000000001/data-r0.bin"]  # no temporary left visible


def test_s3_single_put_and_multipart(s3_tier: ObjectStoreClient, s3_client: Any) -> None:
    """Up to one part: a single PUT (plain ETag); beyond: a multipart upload of N parts."""
    for name, n, parts in [("one.bin", PART, None), ("three.bin", 2 * PART + 1, 3)]:
        data = payload(n, seed=n)
        with s3_tier.open_writer(name) as w:
            w.write(data)
        etag = s3_client.head_object(Bucket=s3_tier.url[5:].split("/")[0], Key=f"run/{name}")[
            "ETag"
        ].strip('"')
        assert etag.endswith(f"-{parts}") if parts else "-" not in etag
        assert s3_tier.read_bytes(name) == data
    assert s3_tier.list() == ["one.bin", "three.bin"]


def test_empty_object_and_put_bytes(any_tier: ObjectStoreClient) -> None:
    w = any_tier.open_writer("empty.bin")
    assert w.close() == (0, xxh(b""))
    assert any_tier.size("empty.bin") == 0
    assert any_tier.read_bytes("empty.bin") == b""
    manifest = b'{"version": 1}' * 100_000  # 1.4 MB: one request still
    any_tier.put_bytes("step-000000000001/manifest.json", manifest)
    assert any_tier.read_bytes("step-000000000001/manifest.json") == manifest
    any_tier.put_bytes("step-000000000001/manifest.json", b"{}")  # replaced whole
    assert any_tier.read_bytes("step-000000000001/manifest.json") == b"{}"


def test_upload_file(any_tier: ObjectStoreClient, tmp_path: Path) -> None:
    for n in (0, 1000, 2 * any_tier.part_bytes, 2 * any_tier.part_bytes + 7):
        data = payload(n, seed=n)
        src = tmp_path / f"src-{n}.bin"
        src.write_bytes(data)
        assert any_tier.upload_file(str(src), f"up/{n}.bin") == (n, xxh(data))
        assert any_tier.read_bytes(f"up/{n}.bin") == data


def test_read_ranges(any_tier: ObjectStoreClient) -> None:
    a, b = payload(3 * MiB, seed=2), payload(100_000, seed=3)
    any_tier.put_bytes("a.bin", a)
    any_tier.put_bytes("d/b.bin", b)
    requests = [("a.bin", 0, 10), ("d/b.bin", 99_990, 10), ("a.bin", MiB, 2 * MiB)]
    requests += [("d/b.bin", i * 997, 1000) for i in range(40)] + [("a.bin", 5, 0)]
    got = any_tier.read_ranges(requests)
    assert got == [(a if n == "a.bin" else b)[o : o + k] for n, o, k in requests]
    assert any_tier.read_range("a.bin", 7, 3) == a[7:10]
    with pytest.raises(RemoteError):  # past the end: never a silently short answer
        any_tier.read_range("d/b.bin", 99_990, 20)
    with pytest.raises(RemoteError) as e:
        any_tier.read_ranges([("a.bin", 0, 10), ("missing.bin", 0, 10)])
    assert e.value.errno == errno.ENOENT and e.value.name == "missing.bin"


def test_list_size_delete(any_tier: ObjectStoreClient) -> None:
    names = ["step-000000000001/manifest.json", "step-000000000001/data-r0.bin"]
    names += ["step-000000000002/data-r0.bin", "journal.json", "chunks/ab/abcdef"]
    for i, n in enumerate(names):
        any_tier.put_bytes(n, payload(i + 1, seed=i))
    assert any_tier.list() == sorted(names)
    assert any_tier.list("step-000000000001") == sorted(names[:2])
    assert any_tier.list("step-000000000001/") == sorted(names[:2])
    assert any_tier.list("nothing-here") == []
    assert any_tier.size("journal.json") == 4
    assert any_tier.size("no-such.bin") is None
    assert any_tier.size("step-000000000001") is None  # a "directory" is no object
    any_tier.delete([*names[:3], "never-written.bin"])  # missing ones are fine
    assert any_tier.list() == sorted(names[3:])
    with pytest.raises(RemoteError) as e:
        any_tier.read_bytes(names[0])
    assert e.value.errno == errno.ENOENT and isinstance(e.value, StorageError)


@pytest.mark.parametrize(
    "name",
    ["../x", "/abs", "a/../b", "a/./b", ".hidden", "a//b", "", "a/", "a/b/c/d/e", "a\\b", "é"],
)
def test_escaping_names_are_refused(name: str) -> None:
    with ObjectStoreClient("memory://snapcore-names") as tier:
        calls = [
            lambda: tier.open_writer(name),
            lambda: tier.put_bytes(name, b"x"),
            lambda: tier.read_bytes(name),
            lambda: tier.read_range(name, 0, 1),
            lambda: tier.read_ranges([("ok", 0, 1), (name, 0, 1)]),
            lambda: tier.size(name),
            lambda: tier.delete(["ok", name]),
            lambda: tier.upload_file(__file__, name),
        ]
        if name and not name.endswith("/"):  # a prefix may end in "/"
            calls.append(lambda: tier.list(name))
        for call in calls:
            with pytest.raises(ValueError, match="not a relative name"):
                call()
        assert tier.list() == []


def test_abort_leaves_nothing(any_tier: ObjectStoreClient, s3_client: Any) -> None:
    w = any_tier.open_writer("aborted.bin")
    w.write(payload(2 * any_tier.part_bytes + 5))
    w.abort()
    w.abort()
    with pytest.raises(ValueError, match="aborted"):
        w.write(b"more")
    assert any_tier.size("aborted.bin") is None
    assert any_tier.list() == []
    if any_tier.url.startswith("s3://"):
        bucket = any_tier.url[5:].split("/")[0]
        assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    if any_tier.url.startswith("file://"):  # not even a hidden temporary file
        assert list(Path(any_tier.url[7:]).rglob("*")) == []


def test_complete_retry_finds_the_upload_gone(s3_bucket: Any) -> None:
    """A complete_multipart_upload whose answer was lost is sent again. AWS and moto answer
    the repeat with success; a store that answers NoSuchUpload instead is handled by
    checking the object's ETag (the MD5 of the parts' MD5s). An unknown upload id makes
    the complete fail for good (moto answers it with a 500 where S3 says NoSuchUpload)."""
    with ObjectStoreClient(
        s3_bucket.url, s3_bucket.storage_options, part_bytes=PART, retries=0
    ) as tier:
        w = tier.open_writer("done.bin")
        w.write(payload(PART + 1))
        w.close()
        upload = w.upload
        upload.upload_id = "no-such-upload"
        tier.loop.run(upload.complete())  # failed, and the object is this upload's: success
        upload.etags[1] = '"' + "0" * 32 + '"'  # parts of some other object
        with pytest.raises(RemoteError) as e:
            tier.loop.run(upload.complete())
        assert e.value.op == "complete_multipart_upload"


def test_close_checks_the_size(s3_tier: ObjectStoreClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that holds a different size than was written fails close(), and the object
    is taken away. (The store's answer is faked: moto never loses bytes.)"""

    async def wrong_size(self: Connection, name: str) -> int:
        return 12345

    monkeypatch.setattr(Connection, "size", wrong_size)
    w = s3_tier.open_writer("short.bin")
    w.write(payload(1000))
    with pytest.raises(RemoteError, match="12345 bytes, 1000 were written") as e:
        w.close()
    assert e.value.op == "verify"
    monkeypatch.undo()
    assert s3_tier.size("short.bin") is None
    with pytest.raises(RemoteError, match="failed earlier"):
        w.close()


def test_memory_bounded_by_inflight_parts(tmp_path: Path) -> None:
    """A writer holds at most max_inflight + 1 part buffers, whatever the object's size."""
    part, inflight = MiB, 2
    data = payload(24 * MiB)
    with ObjectStoreClient(f"file://{tmp_path}", part_bytes=part, max_inflight=inflight) as tier:
        tracemalloc.start()
        try:
            w = tier.open_writer("big.bin")
            for i in range(0, len(data), 3 * MiB):
                w.write(memoryview(data)[i : i + 3 * MiB])
            w.close()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < (inflight + 1) * part + MiB, peak
        assert (tmp_path / "big.bin").read_bytes() == data


def test_threads_share_a_tier(any_tier: ObjectStoreClient) -> None:
    """Blocking methods are thread-safe: writers and readers on several threads at once."""
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            data = payload(any_tier.part_bytes + 1000 * k, seed=k)
            with any_tier.open_writer(f"t/{k}.bin") as w:
                w.write(data)
            assert any_tier.read_range(f"t/{k}.bin", 10, 100) == data[10:110]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert any_tier.list("t") == [f"t/{k}.bin" for k in range(4)]


def test_close_is_idempotent_and_final(s3_bucket: Any, s3_client: Any) -> None:
    tier = ObjectStoreClient(s3_bucket.url, s3_bucket.storage_options, part_bytes=PART)
    w = tier.open_writer("open.bin")
    w.write(payload(PART + 1))  # a multipart upload is under way
    tier.close()
    tier.close()
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads", []) == []
    for call in (lambda: tier.read_bytes("open.bin"), lambda: tier.put_bytes("x", b"")):
        with pytest.raises(RemoteError, match="closed"):
            call()
    assert tier.closed and not tier.loop.thread.is_alive()


# -- faults: the server goes away -------------------------------------------------------------


def test_outage_during_upload_is_retried(
    s3_bucket: Any, s3_restartable: Any, s3_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The server stops in the middle of a multipart upload and comes back 0.5 s later:
    the requests are retried and the object is complete and correct."""
    caplog.set_level(logging.WARNING, logger="snapcore.objstore")
    options = s3_bucket.options_for(s3_restartable.endpoint)
    data = payload(4 * PART + 123, seed=7)
    tier = ObjectStoreClient(s3_bucket.url, options, part_bytes=PART, retries=8, backoff_s=0.05)
    restart = threading.Timer(0.5, s3_restartable.start)
    try:
        w = tier.open_writer("outage.bin")
        w.write(data[: 2 * PART + 1])  # part 1 on its way, part 2 buffered
        wait_for_upload_start(s3_client, s3_bucket.name)
        s3_restartable.stop()
        restart.start()
        w.write(data[2 * PART + 1 :])
        assert w.close() == (len(data), xxh(data))
        restart.join()
        assert tier.read_bytes("outage.bin") == data
    finally:
        restart.cancel()
        restart.join()
        tier.close()
    assert retry_warnings(caplog), "the outage should have cost at least one retry"


def test_outage_longer_than_retries(
    s3_bucket: Any,
    s3_restartable: Any,
    s3_client: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server stays away through every retry: RemoteError naming the URL, the object,
    the request; the multipart upload is aborted (the server comes back while the abort is
    being retried) and nothing is visible under the name."""
    caplog.set_level(logging.WARNING, logger="snapcore.objstore")
    options = s3_bucket.options_for(s3_restartable.endpoint)
    tier = ObjectStoreClient(
        f"{s3_bucket.url}/run", options, part_bytes=PART, retries=2, backoff_s=0.05
    )

    class RestartOnAbortRetry(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.args and record.args[0] == "abort_multipart_upload":  # type: ignore[index]
                s3_restartable.start()

    handler = RestartOnAbortRetry()
    logging.getLogger("snapcore.objstore").addHandler(handler)
    try:
        w = tier.open_writer("lost.bin")
        w.write(payload(2 * PART + 1))
        wait_for_upload_start(s3_client, s3_bucket.name)
        s3_restartable.stop()
        with pytest.raises(RemoteError) as e:  # after retries + 1 attempts (asserted below)
            w.write(payload(2 * PART))
            w.close()
    finally:
        logging.getLogger("snapcore.objstore").removeHandler(handler)
        s3_restartable.start()  # a no-op unless the abort was never retried
        tier.close()
    err = e.value
    assert f"{s3_bucket.url}/run/lost.bin" in str(err)
    assert err.url == f"{s3_bucket.url}/run" and err.name == "lost.bin"
    assert err.op == "upload_part"
    assert "after 3 attempts" in str(err)
    assert isinstance(err.__cause__, Exception)
    assert retry_warnings(caplog, "abort_multipart_upload")
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads", []) == []
    assert s3_client.list_objects_v2(Bucket=s3_bucket.name).get("KeyCount") == 0


def test_put_with_server_down_tries_retries_plus_one_times(
    s3_bucket: Any, s3_restartable: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="snapcore.objstore")
    options = s3_bucket.options_for(s3_restartable.endpoint)
    with ObjectStoreClient(s3_bucket.url, options, retries=3, backoff_s=0.01) as tier:
        s3_restartable.stop()
        with pytest.raises(RemoteError, match="after 4 attempts") as e:
            tier.put_bytes("manifest.json", b"{}")
        assert e.value.op == "put_object" and e.value.errno == errno.EIO
        assert len(retry_warnings(caplog, "put_object")) == 3
        s3_restartable.start()
        assert tier.size("manifest.json") is None


# -- faults: connections cut --------------------------------------------------------------------


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 that forwards to ``target_port`` and cuts (with a reset)
    the first ``cut`` connections that carry ``after`` bytes in ``direction`` ("up": to
    the server, "down": to the client); later ones pass. ``carried[i]`` counts the bytes
    connection i carried in that direction.

    Counted by bytes rather than by connection number, because how many connections the
    client opens, and for what, is its own business.

    A cut is a reset, not a half-close: a proxy that only shut its sockets down, while its
    receive buffer was full (the proxy starved of CPU, the client fast), left the client's
    connection in CLOSE-WAIT with a zero window: aiohttp drops its read timeout on EOF and
    waits for the unsent body to drain, for ever (test_a_cut_is_a_reset)."""

    def __init__(self, target_port: int, *, cut: int, after: int, direction: str = "up") -> None:
        self.target_port, self.cut, self.after = target_port, cut, after
        self.direction = direction
        self.carried: list[int] = []
        self.cuts = 0
        self._ended: dict[int, int] = {}  # pumps of a pair ended, by id(pair)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server((LOOPBACK, 0))
        self._listener.settimeout(0.1)  # so that the accept loop sees close() soon
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept)

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def _spawn(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            upstream = socket.create_connection((LOOPBACK, self.target_port))
            with self._lock:
                index = len(self.carried)
                self.carried.append(0)
                self._sockets += [client, upstream]
            pair = (client, upstream)
            self._spawn(self._pump, client, upstream, index if self.direction == "up" else -1, pair)
            self._spawn(
                self._pump, upstream, client, index if self.direction == "down" else -1, pair
            )

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        index: int,
        pair: tuple[socket.socket, socket.socket],
    ) -> None:
        """Copy src to dst until EOF or an error; count (and cut) in the watched direction.
        Blocking calls, ended by a cut or close() shutting the sockets down. The second
        pump of a pair to end closes both sockets: after a cut or an error, with a reset."""
        try:
            if self._copy(src, dst, index):
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
            else:
                self._reset(pair)
        finally:
            with self._lock:
                ended = self._ended[id(pair)] = self._ended.get(id(pair), 0) + 1
            if ended == 2:
                for s in pair:
                    s.close()

    def _copy(self, src: socket.socket, dst: socket.socket, index: int) -> bool:
        """True at src's EOF, False after a cut or an error."""
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                return False
            if not data:
                return True
            cut_at = None
            if index >= 0:
                with self._lock:
                    if self.cuts < self.cut and self.carried[index] + len(data) >= self.after:
                        cut_at = self.after - self.carried[index]
                        self.cuts += 1
                    self.carried[index] += len(data) if cut_at is None else cut_at
            try:
                if cut_at is not None:
                    dst.sendall(data[:cut_at])
                    return False
                dst.sendall(data)
            except OSError:
                return False

    @staticmethod
    def _reset(pair: tuple[socket.socket, socket.socket]) -> None:
        """Shut both sockets down (which wakes the other pump), set to reset on close."""
        linger = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # on, 0 s: close with a reset
        for s in pair:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(5)
            assert not t.is_alive(), "a proxy thread did not end"
        for s in self._sockets:
            s.close()


def test_a_cut_is_a_reset() -> None:
    """The proxy's cut resets the client's connection; it does not merely half-close it.

    A half-closed proxy that never read again stalled test_upload_through_cut_connections
    under load: when the client had filled the proxy's receive buffer before the cut (the
    proxy starved of CPU), its connection sat in CLOSE-WAIT with a zero window, and aiohttp,
    which drops its read timeout on EOF and waits for the unsent body to drain, waited for
    ever. A reset (POLLHUP, here with nothing left to send) ends the connection at once."""
    sink = socket.create_server((LOOPBACK, 0))

    def drain() -> None:
        conn, _ = sink.accept()
        with conn, contextlib.suppress(OSError):
            while conn.recv(1 << 16):
                pass

    sink_thread = threading.Thread(target=drain, daemon=True)
    sink_thread.start()
    proxy = CuttingProxy(sink.getsockname()[1], cut=1, after=64 << 10)
    client = socket.create_connection((LOOPBACK, proxy.port))
    try:
        client.sendall(b"x" * (128 << 10))  # crosses the cut
        poller = select.poll()
        poller.register(client, select.POLLIN)
        deadline = time.monotonic() + 30  # a bound, so that a regression fails, not hangs
        while not any(ev & (select.POLLHUP | select.POLLERR) for _, ev in poller.poll(100)):
            assert time.monotonic() < deadline, "the cut left the connection half-open"
            time.sleep(0.01)  # an EOF alone (POLLIN) is what the half-close gave
        assert proxy.cuts == 1
    finally:
        client.close()
        proxy.close()
        sink.close()
        sink_thread.join(5)


@pytest.fixture
def s3_port(s3_server: str) -> int:
    return int(s3_server.rsplit(":", 1)[1])


def test_upload_through_cut_connections(
    s3_bucket: Any, s3_port: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three connections are cut 64 KiB into what they carry to the server.

    aiohttp resends an idempotent request once, on a new connection, by itself; parts go
    one at a time here, so that the resent part is cut again and snapcore's retry has to
    finish the job. The object arrives whole."""
    caplog.set_level(logging.WARNING, logger="snapcore.objstore")
    proxy = CuttingProxy(s3_port, cut=3, after=64 << 10)
    data = payload(3 * PART + 99, seed=11)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    options = s3_bucket.options_for(proxy.endpoint)
    try:
        with ObjectStoreClient(
            s3_bucket.url, options, part_bytes=PART, max_inflight=1, backoff_s=0.05
        ) as tier:
            assert tier.upload_file(str(src), "cut.bin") == (len(data), xxh(data))
            assert tier.read_bytes("cut.bin") == data
    finally:
        proxy.close()
    assert proxy.cuts == 3, proxy.carried
    assert len(retry_warnings(caplog, "upload_part")) >= 1


def test_download_through_cut_connections(
    s3_tier: ObjectStoreClient, s3_bucket: Any, s3_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Responses cut half-way are read again."""
    caplog.set_level(logging.WARNING, logger="snapcore.objstore")
    data = payload(3 * MiB, seed=12)
    s3_tier.put_bytes("get.bin", data)
    proxy = CuttingProxy(s3_port, cut=3, after=MiB, direction="down")
    try:
        with ObjectStoreClient(
            f"{s3_bucket.url}/run", s3_bucket.options_for(proxy.endpoint), backoff_s=0.05
        ) as tier:
            assert tier.read_bytes("get.bin") == data
            assert tier.read_ranges([("get.bin", 0, 2 * MiB)] * 3) == [data[: 2 * MiB]] * 3
    finally:
        proxy.close()
    assert proxy.cuts == 3, proxy.carried
    assert len(retry_warnings(caplog, "get")) == 3  # a cut body is no aiohttp retry


# -- permanent errors ---------------------------------------------------------------------------


def test_permanent_errors_fail_fast(
    s3_server: str, s3_bucket: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A missing bucket or object is not retried: one attempt each (no retry logged), and
    no backoff waited (with backoff_s=5, a retry would wait at least 2.5 s)."""
    caplog.set_level(logging.WARNING, logger="snapcore.objstore")
    options = s3_bucket.options_for(s3_server)
    with ObjectStoreClient(
        "s3://no-such-bucket/run", options, part_bytes=PART, backoff_s=5.0
    ) as tier:
        with pytest.raises(RemoteError) as e:
            tier.put_bytes("manifest.json", b"{}")
        assert e.value.errno == errno.ENOENT and e.value.op == "put_object"
        assert "no-such-bucket" in str(e.value) and "attempts" not in str(e.value)
        w = tier.open_writer("data.bin")
        with pytest.raises(RemoteError) as e:
            w.write(payload(2 * PART + 1))
            w.close()
        assert e.value.op == "create_multipart_upload" and e.value.errno == errno.ENOENT
        with pytest.raises(RemoteError) as e:
            tier.read_bytes("data.bin")
        assert e.value.errno == errno.ENOENT
        assert tier.list() == []
    assert retry_warnings(caplog) == []  # one attempt each: no backoff was waited


def test_transient_classification() -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError

    def client_error(status: int, code: str) -> ClientError:
        return ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
        )

    def translated(cause: BaseException) -> OSError:  # what s3fs raises
        err = OSError(errno.EIO, "translated")
        err.__cause__ = cause
        return err

    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(translated(client_error(503, "SlowDown")))
    assert is_transient(translated(client_error(500, "InternalError")))
    assert is_transient(client_error(400, "RequestTimeout"))
    assert not is_transient(FileNotFoundError("no such key"))
    assert not is_transient(PermissionError("denied"))
    assert not is_transient(translated(client_error(400, "InvalidArgument")))
    assert not is_transient(ValueError("bad"))

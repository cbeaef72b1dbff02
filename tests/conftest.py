"""Shared fixtures: moto's S3 server on 127.0.0.1, and fresh buckets on it.

moto keeps its state in this process, not in the server: every server started here
serves the same buckets, and one stopped and started again finds its objects still there
(what the outage tests rely on).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

LOOPBACK = "127.0.0.1"  # the only address these servers may ever listen on


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class S3Server:
    """moto's S3 server (a ThreadedMotoServer) on a free loopback port, with a stop() that
    behaves like a crash: the listening socket is closed (new connections are refused) and
    open keep-alive connections are cut. moto's own stop() leaves both open, so a stopped
    server would go on answering on old connections and queue new ones."""

    def __init__(self) -> None:
        self.port = 0
        self._moto: Any = None
        self._live: set[socket.socket] = set()
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> None:
        """Start (again, on the same port); a no-op while it runs."""
        if self._moto is not None:
            return
        for _ in range(20):
            moto = _moto_server_class()(
                ip_address=LOOPBACK, port=self.port or _free_port(), verbose=False
            )
            moto.live = self._live
            moto.start()
            if moto.error is None:
                break
            # werkzeug reports a port in use by sys.exit(1), with the OSError as context
            bind_error = moto.error.__context__ if isinstance(moto.error, SystemExit) else None
            in_use = isinstance(bind_error, OSError) and bind_error.errno == errno.EADDRINUSE
            if self.port or not in_use:  # only a fresh port, taken meanwhile, is tried again
                raise RuntimeError(f"moto could not start on {LOOPBACK}:{moto._port}") from (
                    bind_error or moto.error
                )
        else:
            raise RuntimeError("no free loopback port for moto")
        self.port, self._moto = moto.get_host_and_port()[1], moto

    def stop(self) -> None:
        moto, self._moto = self._moto, None
        if moto is None:
            return
        moto.stop()
        moto._server.server_close()
        for conn in list(self._live):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._live.clear()


@functools.cache
def _moto_server_class() -> type:
    """ThreadedMotoServer whose start() reports a failed bind (moto's waits forever) and
    whose connections are tracked; built on first use so that tests without S3 never
    import moto."""
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    class Handler(MotoRequestHandler):
        def setup(self) -> None:
            super().setup()
            self.server.live.add(self.connection)  # type: ignore[attr-defined]

        def finish(self) -> None:
            self.server.live.discard(self.connection)  # type: ignore[attr-defined]
            with contextlib.suppress(OSError):
                super().finish()

        def log_request(self, *args: Any, **kwargs: Any) -> None:
            pass  # a line per request is noise in the test output

    class Server(ThreadedMotoServer):
        live: set[socket.socket]
        error: BaseException | None = None

        def _server_entry(self) -> None:
            try:
                app = DomainDispatcherApplication(create_backend_app)
                server = make_server(
                    self._ip_address, self._port, app, True, request_handler=Handler
                )
            except BaseException as e:
                self.error = e
                self._server_ready_event.set()
                return
            server.live = self.live  # type: ignore[attr-defined]
            # Requests cut by stop() end in errors on the server side: expected, not news.
            server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
            self._server = server
            self._server_ready_event.set()
            server.serve_forever()

    return Server


@dataclass
class S3Bucket:
    name: str
    endpoint: str
    storage_options: dict[str, Any]

    @property
    def url(self) -> str:
        return f"s3://{self.name}"

    @staticmethod
    def options_for(endpoint: str) -> dict[str, Any]:
        """The same options for another endpoint (a proxy, a server of the test's own)."""
        return s3_storage_options(endpoint)


def s3_storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for a moto server (fake credentials, never real ones)."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def _botocore_client(endpoint: str) -> Any:
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


@pytest.fixture(scope="session")
def _aws_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fake credentials and no metadata service or config files: nothing real is read."""
    missing = str(tmp_path_factory.mktemp("aws") / "none")
    with pytest.MonkeyPatch.context() as mp:
        for var, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": missing,
            "AWS_SHARED_CREDENTIALS_FILE": missing,
        }.items():
            mp.setenv(var, value)
        mp.delenv("AWS_PROFILE", raising=False)
        mp.delenv("AWS_ENDPOINT_URL", raising=False)
        yield


@pytest.fixture(scope="session")
def s3_server(_aws_env: None) -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 for the whole session; yields its endpoint URL."""
    pytest.importorskip("moto.server", reason="moto[server] is a test dependency")
    server = S3Server()
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_restartable(_aws_env: None) -> Iterator[S3Server]:
    """A server of a test's own that the test may stop and start (the same moto state)."""
    pytest.importorskip("moto.server", reason="moto[server] is a test dependency")
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_client(s3_server: str) -> Any:
    """A plain botocore client of the session's server, to set up and inspect buckets."""
    return _botocore_client(s3_server)


@pytest.fixture
def s3_bucket(s3_server: str, s3_client: Any) -> Iterator[S3Bucket]:
    """A fresh, empty bucket; emptied and removed afterwards (moto holds it in memory)."""
    name = f"snapcore-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    try:
        yield S3Bucket(name, s3_server, s3_storage_options(s3_server))
    finally:
        uploads = s3_client.list_multipart_uploads(Bucket=name).get("Uploads", [])
        for u in uploads:
            s3_client.abort_multipart_upload(Bucket=name, Key=u["Key"], UploadId=u["UploadId"])
        for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=name):
            for obj in page.get("Contents", []):
                s3_client.delete_object(Bucket=name, Key=obj["Key"])
        s3_client.delete_bucket(Bucket=name)


@pytest.fixture
def gloo_group() -> Iterator[None]:
    """A torch.distributed process group of one rank (gloo on a free 127.0.0.1 port),
    destroyed after the test, with snapcore's engines closed first."""
    import torch.distributed as dist

    import snapcore

    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}"
    )
    try:
        yield
    finally:
        snapcore.close()
        dist.destroy_process_group()


@pytest.fixture
def host_name() -> Iterator[str]:
    """A fresh host-memory area name, released (and checked gone) after the test."""
    from pathlib import Path

    from snapcore.tiers import HostTier
    from snapcore.write.engine import close_all

    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    yield name
    close_all()
    HostTier(name).release()
    assert not Path(f"/dev/shm/snapcore-{name}").exists()


@pytest.fixture(scope="session", autouse=True)
def _no_host_area_leaks() -> Iterator[None]:
    """Host-memory areas are process-outliving by design: a test that makes one must
    release it. Checked once, at the end of the session. The tests name their areas
    ``test-<pid of pytest>-...``, so that a test session running beside this one on the
    same machine (another clone's CI) is not counted."""
    import glob

    mine = f"/dev/shm/snapcore-test-{os.getpid()}-*"
    before = set(glob.glob(mine))
    yield
    from snapcore.write.engine import close_all

    close_all()
    leaked = set(glob.glob(mine)) - before
    assert not leaked, f"tests left host-memory areas behind: {sorted(leaked)}"

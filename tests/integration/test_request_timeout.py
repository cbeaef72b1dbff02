"""A server that accepts a request and then neither reads nor answers costs each attempt
SNAPCORE_REQUEST_TIMEOUT_S and ends in a RemoteError naming the object: never a hang
(aiohttp and botocore put no timeout on sending a request body)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from snapcore import settings
from snapcore.errors import RemoteError
from snapcore.objstore import ObjectStoreClient
from tests.conftest import s3_storage_options


@pytest.fixture
def silent_server() -> Iterator[str]:
    """An endpoint on 127.0.0.1 that accepts connections and never reads or answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)  # kept open, never read: the client's window fills up

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


@pytest.mark.usefixtures("_aws_env")
def test_a_server_that_never_answers_is_an_error_not_a_hang(silent_server: str) -> None:
    client = ObjectStoreClient(
        "s3://bucket/run", s3_storage_options(silent_server), retries=1, backoff_s=0.01
    )
    try:
        with settings.override(SNAPCORE_REQUEST_TIMEOUT_S=0.5):
            started = time.monotonic()
            with pytest.raises(RemoteError) as e:
                # a body larger than the socket buffers: the send itself stalls
                client.put_bytes("step-000000000001/data.bin", b"x" * (8 << 20))
            elapsed = time.monotonic() - started
        assert "step-000000000001/data.bin" in str(e.value)
        assert isinstance(e.value.__cause__, TimeoutError) or "TimeoutError" in repr(e.value)
        assert elapsed < 60  # two attempts of 0.5 s and a backoff, generously bounded
    finally:
        client.close()

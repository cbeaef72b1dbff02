"""The event loop every request of a remote tier runs on: one loop in one daemon thread,
and the gate in front of it that blocking callers go through (refused once the tier is
closing, cancelled requests answered with RemoteError).

Daemon, so that a tier nobody closed cannot keep the interpreter from exiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from ..errors import RemoteError

T = TypeVar("T")


class Loop:
    """One event loop in one daemon thread, for the tier at ``url`` (named in errors).

    Two stages of shutting down: ``start_closing()`` refuses new requests from callers
    (those marked ``internal``, the tier's own clean-up, still run); ``shutdown()``
    refuses every request, cancels those in flight and stops the thread.
    """

    def __init__(self, name: str, url: str) -> None:
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._state_lock = threading.Lock()
        self._closing = False
        self._stopping = False
        self.thread.start()

    @property
    def closing(self) -> bool:
        """Whether start_closing() was called."""
        return self._closing

    def start_closing(self) -> bool:
        """Refuse new requests but internal ones; False if it was closing already."""
        with self._state_lock:
            if self._closing:
                return False
            self._closing = True
            return True

    def submit(
        self, coro: Coroutine[Any, Any, T], *, internal: bool = False
    ) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; its future."""
        with self._state_lock:
            if self._stopping or (self._closing and not internal):
                coro.close()
                raise RemoteError("the remote tier is closed", url=self.url, op="submit")
            return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], *, internal: bool = False) -> T:
        """Run ``coro`` on the loop and wait for it (never from the loop's own thread)."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("ObjectStoreClient's blocking methods cannot run on its own loop")
        fut = self.submit(coro, internal=internal)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise RemoteError("the remote tier was closed", url=self.url) from None
        except BaseException:
            fut.cancel()  # an interrupt (Ctrl-C) leaves no request behind
            raise

    def shutdown(self, cleanup: Callable[[], Awaitable[None]]) -> None:
        """Refuse every request, cancel those in flight, await ``cleanup()`` on the loop,
        then stop the thread."""
        with self._state_lock:
            self._stopping = True
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(cleanup), self.loop)
        try:
            fut.result()
        finally:
            self.stop()

    async def _shutdown(self, cleanup: Callable[[], Awaitable[None]]) -> None:
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await cleanup()
        loop = asyncio.get_running_loop()
        await loop.shutdown_asyncgens()
        await loop.shutdown_default_executor()

    def stop(self) -> None:
        """Stop the loop and join its thread (at once: requests in flight are dropped)."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def bounded(coros: Iterable[Coroutine[Any, Any, T]], limit: int) -> list[T]:
    """Run ``coros`` with at most ``limit`` at once; results in order. On the first failure
    the others are cancelled and it is raised."""
    sem = asyncio.Semaphore(limit)

    async def one(c: Coroutine[Any, Any, T]) -> T:
        async with sem:
            return await c

    tasks = [asyncio.ensure_future(one(c)) for c in coros]
    if not tasks:
        return []
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]

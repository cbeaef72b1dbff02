"""SIGTERM: a request for a final snapshot, within a grace period, then the signal goes on.

A ``SigtermGuard`` installs a handler (main thread only, and not over an ignored
SIGTERM) that only records the request: the owner (the Checkpointer) takes it at its
next chance (``take()``), snapshots, gives the handler back (``release()``) and sends
the signal again (``resend()``), so that the process ends as it would have without us.
If the owner does not take it within ``grace_s`` (a hung training step), a timer hands
the signal on without a snapshot: to the previous Python handler when there was one,
else to the default action, put back at the C level since the main thread may be stuck
in native code where no Python handler runs. Torch-free, like the rest of scheduling
below the Checkpointer.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
import types
from collections.abc import Callable
from typing import Any

log = logging.getLogger("snapcore.checkpointer")  # the Checkpointer's: one logger to follow


class SigtermGuard:
    """The SIGTERM handler of one owner.

    ``on_request``: called in the main thread, from the handler, when a SIGTERM first
    arrives (it may only set fields). ``on_expired``: called in the timer thread when the
    grace period ran out before ``take()``, just before the signal is handed on.
    ``on_pass_on``: called from the handler before it passes a signal on once the grace
    period ran out (the owner stops for good; it may call ``release()``).
    """

    def __init__(
        self,
        grace_s: float,
        *,
        on_request: Callable[[], None],
        on_expired: Callable[[], None],
        on_pass_on: Callable[[], None],
    ) -> None:
        self.grace_s = grace_s
        self._on_request = on_request
        self._on_expired = on_expired
        self._on_pass_on = on_pass_on
        self._term_at: float | None = None  # time.monotonic() of the request
        self.seen = False  # a SIGTERM was received
        self._delegate = False  # grace expired: our handler passes signals on
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()  # the owner's final snapshot or the timer, not both
        self._prev_handler: Any = None
        self._installed = False

    @property
    def pending(self) -> bool:
        """A SIGTERM was received and neither ``take()`` nor the timer took it yet."""
        return self._term_at is not None

    def install(self) -> None:
        """Put our handler in place, unless outside the main thread (Python runs signal
        handlers there only) or SIGTERM is ignored in this process."""
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "Checkpointer made outside the main thread: no SIGTERM handler installed "
                "(Python runs signal handlers in the main thread only); a preemption will "
                "not take a final snapshot"
            )
            return
        if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
            log.info("SIGTERM is ignored in this process: no handler installed")
            return
        self._prev_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def take(self) -> float | None:
        """Take the pending request (stopping the grace timer): the ``time.monotonic()``
        it arrived at, or None when there is none (or the timer took it)."""
        with self._lock:
            term_at, self._term_at = self._term_at, None
            if term_at is not None and self._timer is not None:
                self._timer.cancel()
        return term_at

    def release(self) -> None:
        """Stop the timer and give the previous handler back (outside the main thread
        ours stays, passing signals on)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._installed:
            self._installed = False
            prev = signal.SIG_DFL if self._prev_handler is None else self._prev_handler
            try:
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, prev)
            except ValueError:  # not the main thread: leave ours, which passes signals on
                self._delegate = True
                log.warning("close() outside the main thread: SIGTERM handler left in place")

    @staticmethod
    def resend() -> None:
        """SIGTERM to this process again: handled now as it would have been without us."""
        os.kill(os.getpid(), signal.SIGTERM)

    def _on_sigterm(self, signum: int, frame: types.FrameType | None) -> None:
        """Record the request. Runs in the main thread between two bytecodes, so it only
        sets fields."""
        if self._delegate:  # grace expired: the signal is the previous handler's
            self._pass_on(signum, frame)
            return
        if self.seen:
            log.warning("SIGTERM again: the first one is being handled")
            return
        self.seen = True
        self._term_at = time.monotonic()
        self._on_request()
        log.warning(
            "SIGTERM: a final snapshot at the next step() (within %.0fs of grace)", self.grace_s
        )
        self._timer = threading.Timer(self.grace_s, self._grace_expired)
        self._timer.daemon = True
        self._timer.start()

    def _grace_expired(self) -> None:
        """Timer thread: no ``take()`` within the grace period (a hung step).

        Nothing is snapshotted: the state may be half-way through an optimizer update.
        The signal goes on to the previous handler, so the process ends as it would have
        without us, only ``grace_s`` later.
        """
        with self._lock:
            if self._term_at is None:  # taken in time
                return
            self._term_at = None
            self._delegate = True
        log.error(
            "SIGTERM: no step() within %.0fs: handing the signal on without a snapshot",
            self.grace_s,
        )
        self._on_expired()
        if not callable(self._prev_handler):
            # SIG_DFL (or a handler set outside Python): the main thread may be stuck in
            # native code, where no Python handler runs. Put the default action back at
            # the C level (signal.signal works in the main thread only) and let it act.
            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.restype = ctypes.c_void_p
            libc.signal(signal.SIGTERM, ctypes.c_void_p(0))  # SIG_DFL
        # a Python handler runs when the main thread next runs Python: ours passes it on
        os.kill(os.getpid(), signal.SIGTERM)

    def _pass_on(self, signum: int, frame: types.FrameType | None) -> None:
        self._on_pass_on()
        prev = self._prev_handler
        if callable(prev):
            prev(signum, frame)
        else:
            os.kill(os.getpid(), signum)  # the default action, put back by release()


__all__ = ["SigtermGuard"]

"""Whether a native call releases the GIL: a check on the mechanism, not on the clock."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


def runs_python_during(call: Callable[[], None]) -> bool:
    """Run ``call`` on a second thread; True if this thread ran Python before it returned.

    The switch interval is made far longer than any call, so the interpreter never takes
    the GIL from the thread holding it: this thread, waiting in ``Thread.start()``, gets
    the GIL back before ``call`` returns only if ``call`` released it. Held, the answer is
    False whatever the machine's speed. Released, it is True unless the OS did not run
    this thread at all before the call ended (a caller retries with more work).
    """
    done = False
    error: list[BaseException] = []

    def run() -> None:
        nonlocal done
        try:
            call()
        except BaseException as e:
            error.append(e)
        done = True

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        thread = threading.Thread(target=run)
        thread.start()  # returns once this thread holds the GIL again
        during = not done
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    if error:
        raise error[0]
    return during


def releases_gil(make_call: Callable[[int], Callable[[], None]], size: int, tries: int = 5) -> bool:
    """``runs_python_during(make_call(size))``, doubling ``size`` after each miss: a call
    too short for the OS to schedule this thread again is retried with more work."""
    return any(runs_python_during(make_call(size << k)) for k in range(tries))

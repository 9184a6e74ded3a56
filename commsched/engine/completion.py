"""Callbacks on communication that has completed, counted so that exit can wait for them.

[Note: callbacks at exit] Completion callbacks are Python code run by a
communication thread. One still waiting for the interpreter lock while the
process exits would be torn down mid-call, which aborts the process. Every
callback commsched attaches goes through one `CallbackTracker`, and the
reducer drains it when it is released and at exit. After a communication
failure it abandons it instead: operations a lost peer never joins would keep
the exit waiting (see [Note: exit after a failure] in commsched/errors.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from commsched.comm.transport import Handle


class CallbackTracker:
    """Attaches completion callbacks to handles and counts those not yet run."""

    def __init__(self) -> None:
        self._done = threading.Condition()
        self._pending = 0
        self._running = 0
        self._abandoned = False

    def when_complete(self, handle: Handle, callback: Callable[[], None]) -> None:
        """Run ``callback`` (on any thread) once ``handle`` has completed."""
        with self._done:
            self._pending += 1

        def counted() -> None:
            with self._done:
                run = not self._abandoned
                self._running += int(run)
            try:
                if run:
                    callback()
            finally:
                with self._done:
                    self._pending -= 1
                    self._running -= int(run)
                    self._done.notify_all()

        handle.on_complete(counted)

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every callback attached so far has run (at most ``timeout_s``).

        Once abandoned, only for those running now.
        """
        with self._done:
            self._done.wait_for(lambda: not (self._running if self._abandoned else self._pending),
                                timeout=timeout_s)

    def abandon(self) -> None:
        """After a failure: callbacks still to come do nothing, and `drain` no longer waits for them."""
        with self._done:
            self._abandoned = True
            self._done.notify_all()

"""Callbacks on communication that has completed, counted so that exit can wait for them.

[Note: callbacks at exit] Completion callbacks are Python code run by a
communication thread. One still waiting for the interpreter lock while the
process exits would be torn down mid-call, which aborts the process. Every
callback commsched attaches goes through one `CallbackTracker`, and the
reducer drains it when it is released and at exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from commsched.transport.base import Handle


class CallbackTracker:
    """Attaches completion callbacks to handles and counts those not yet run."""

    def __init__(self) -> None:
        self._done = threading.Condition()
        self._pending = 0

    def when_complete(self, handle: Handle, callback: Callable[[], None]) -> None:
        """Run ``callback`` (on any thread) once ``handle`` has completed."""
        with self._done:
            self._pending += 1

        def counted() -> None:
            try:
                callback()
            finally:
                with self._done:
                    self._pending -= 1
                    if not self._pending:
                        self._done.notify_all()

        handle.on_complete(counted)

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every callback attached so far has run (at most ``timeout_s``)."""
        with self._done:
            self._done.wait_for(lambda: not self._pending, timeout=timeout_s)

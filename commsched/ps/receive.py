"""Waiting on point-to-point receives from several threads.

[Note: one waiter per receive] A gloo point-to-point ``Work`` reports neither
completion (``is_completed()`` stays False until someone waits) nor a future,
and only one thread may wait on it. So one thread per server waits on that
server's receives, in issue order (the order the server answers them), and
turns each into a `Completion` that any thread can test, wait on with a
timeout, or attach a callback to.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch.distributed as dist

from commsched.errors import wait_work


class Completion:
    """A receive's outcome, set once by its waiter thread (see [Note: one waiter per receive])."""

    __slots__ = ("done", "error", "_callbacks", "_lock")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def finish(self, error: BaseException | None) -> None:
        with self._lock:
            self.error = error
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def add_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(callback)
                return
        callback()


class ReceiveWaiter:
    """The one thread that waits on one server's receives, in the order they were posted."""

    def __init__(self, server_rank: int, timeout_s: float):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._timeout_s = timeout_s
        self._thread = threading.Thread(
            target=self._run, name=f"commsched-ps-wait-{server_rank}", daemon=True
        )
        self._thread.start()

    def watch(self, work: dist.Work) -> Completion:
        completion = Completion()
        self._queue.put((work, completion))
        return completion

    def _run(self) -> None:
        failed: BaseException | None = None
        while True:
            work, completion = self._queue.get()
            if work is None:
                return
            if failed is None:
                try:
                    wait_work(work, self._timeout_s)
                except BaseException as error:  # noqa: BLE001 - handed to whoever waits
                    failed = error
            completion.finish(failed)

    def stop(self, timeout_s: float) -> None:
        """End the thread and wait for it.

        It must be gone before the interpreter finalises: dropping a receive's
        ``Work`` takes the GIL, and a thread that cannot get it then is
        unwound through a C++ destructor, which aborts the process.
        """
        self._queue.put((None, None))
        self._thread.join(timeout=timeout_s)

"""A recording device seam: where the engine orders a device's work, checked on the CPU.

`RecordingSeam` takes the decisions of a device with streams (``orders_streams``: waits order
the stream, verdicts are not waited for, a launch comes after its bucket's mark) and writes
each call into a log, while the host still waits for each operation it is asked to order (the
CPU has no stream to order): so training stays exact, and a test reads from the log where a
GPU's stream would have been ordered and where its host would have waited.

    log = []
    with using_seam(lambda device: RecordingSeam(device, log)):
        model, optimizer = commsched.prepare(model, optimizer)
    ...  # train; log holds ("mark", id), ("order_after", id, thread), ("order", what), ("host_read",), ...

No GPU and no fake of torch.distributed: the collectives are gloo's, in real processes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from commsched.device import Orderable, StreamSeam, using_seam

__all__ = ["Mark", "RecordingSeam", "using_seam"]


class Mark:
    """A mark the recording seam hands out: a point the device has always passed (the CPU's)."""

    __slots__ = ("number",)

    def __init__(self, number: int):
        self.number = number

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Mark({self.number})"


class RecordingSeam(StreamSeam):
    """A stream seam over the CPU that logs every call the engine makes of it (see the module)."""

    def __init__(self, device: torch.device, log: list[tuple[Any, ...]]):
        super().__init__(device)
        self.log = log
        self._marks = 0

    def settle(self, operation: Orderable, timeout_s: float, what: str) -> None:
        self.log.append(("order", what))
        operation.wait(timeout_s)  # what a stream would wait for, the CPU's host waits for

    def mark(self) -> Mark:
        self._marks += 1
        self.log.append(("mark", self._marks))
        return Mark(self._marks)

    def order_after(self, mark: Any) -> None:
        self.log.append(("order_after", mark.number, threading.get_ident()))

    def host_read(self) -> None:
        super().host_read()
        self.log.append(("host_read",))

    def wait_all(self, timeout_s: float) -> None:
        self.log.append(("wait_all",))
        super().wait_all(timeout_s)

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds_between(self, start: Any, end: Any) -> float:
        return end - start

"""The device seam: how commsched's waits order a device's work instead of blocking the host.

[Note: stream-ordered waits] On the CPU every wait is the host's: a reduction is
done when gloo's thread says so, and the update after it runs on the host. On a
GPU the host only launches work: a wait that blocks it (a timed ``Work.wait``, an
``.item()``) keeps it from launching the next forward pass's kernels while the
device still has queued work, and the device idles in every gap the host leaves.
So on a GPU, as torch DDP, FSDP2 and Megatron-core do, a wait orders the *stream*
after the collective: the consumer (a gate's update, the end of backward without
overlap, ``step()``, the buffer broadcast's copies, a sharded all-gather's use)
is queued behind it, and the host goes on.

Four operations make the seam, device-generic through ``torch.get_device_module``:

- ``mark()``: a point in the current stream's queue (an event recorded there);
- ``order_after(mark)``: the current stream waits for that point, the host does not;
- ``done(mark)``: whether the device has passed it (a query, never a wait);
- ``hold(mark, *objects)``: keep ``objects`` alive until the device has passed
  ``mark`` (what another stream still reads, without ``record_stream``).

On the CPU each is a no-op: torch.cpu's streams and events exist and do nothing,
and some of torch's CPU paths raise (``torch.Event("cpu").record()``,
``record_stream``, gloo's ``block_current_stream()``), so the `HostSeam` touches
none of them.

An operation waited for this way is waited for without a timeout: a dead or
stalled peer would leave the device waiting forever while the host runs ahead.
So the seam watches each one until it completes, and `StreamSeam.check`, called
at points the engine passes anyway (each bucket issued, each gate, each
backward pass's start), raises `CommunicationTimeout` naming the first one
still incomplete ``timeout_s`` after it was ordered. A wait the backend cannot
order (gloo with CUDA tensors before its host side is done: its data crosses the
host) stays a timed host wait, and is counted (`host_waits`), as are the reads of
a device value on the host that remain (`host_read`): ``commsched.status``
reports them per iteration.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from commsched.errors import communication_timeout, wait_or_raise


class Orderable(Protocol):
    """An operation in flight that a wait may order the current stream after."""

    def wait(self, timeout_s: float) -> None:
        """Block the host until done; raise `CommunicationTimeout` after ``timeout_s``."""

    def order(self) -> bool:
        """Make the current stream wait for the operation without blocking the host, and queue
        what must follow it there (a copy back, a sum); False where the backend cannot, and nothing
        was done (the caller then waits on the host)."""

    def is_completed(self) -> bool:
        """True once the operation has finished (a query, never a wait)."""


class WorkOrder:
    """A ``torch.distributed`` work as an `Orderable`: for the collectives the engine waits for
    outside the gradient handles (the buffer broadcast, sharded state's all-gathers)."""

    __slots__ = ("_work", "_what", "_on_nccl")

    def __init__(self, work: dist.Work, what: str, on_nccl: bool):
        self._work, self._what, self._on_nccl = work, what, on_nccl

    def wait(self, timeout_s: float) -> None:
        wait_or_raise(self._work, timeout_s, self._what)

    def order(self) -> bool:
        return order_after_work(self._work, self._on_nccl, self._what)

    def is_completed(self) -> bool:
        return self._work.is_completed()


def runs_nccl(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` runs NCCL for tensors on ``device`` (a group of several backends names each)."""
    return device.type == "cuda" and "nccl" in str(dist.get_backend(group))


def order_after_work(work: dist.Work, on_nccl: bool, what: str) -> bool:
    """[Note: ordering after a work] NCCL: the untimed ``wait()`` makes the current stream wait
    for the collective's end event, and returns at once. gloo with CUDA tensors: once its host side
    is done, the untimed ``wait()`` returns at once and orders the current stream after the copy
    back to the device; before that, nothing can order a stream after it without racing that copy
    (``block_current_stream()`` releases the stream when the host side ends, not the copy), so
    False: the caller waits on the host. A work that failed already (NCCL's watchdog aborted its
    communicator, a peer closed the connection) raises `CommunicationTimeout` naming ``what``."""
    if on_nccl or work.is_completed():
        try:
            work.wait()
        except RuntimeError as error:
            raise communication_timeout(what, 0.0, error) from error
        return True
    return False


@dataclass
class _Watched:
    """An operation a stream was ordered after, until it completes."""

    operation: Orderable
    deadline: float
    timeout_s: float
    what: str


class HostSeam:
    """The CPU's seam: the host is the device, every wait is the host's, and there is nothing to order."""

    orders_streams = False
    """Whether waits order a stream rather than block the host."""

    host_waits = 0
    """Waits and reads of the host on the device so far (always 0 here: the host is the device)."""

    def settle(self, operation: Orderable, timeout_s: float, what: str) -> None:
        """From now on, work that follows sees ``operation``'s result: here the host waits for it."""
        operation.wait(timeout_s)

    def mark(self) -> Any:
        return None

    def order_after(self, mark: Any) -> None:
        return None

    def done(self, mark: Any) -> bool:
        return True

    def hold(self, mark: Any, *objects: object) -> None:
        return None

    def check(self) -> None:
        """Raise `CommunicationTimeout` for an ordered operation past its deadline (none here)."""

    def host_read(self) -> None:
        """The host reads a device value now (a host wait on a GPU; nothing here)."""

    def wait_all(self, timeout_s: float) -> None:
        """Every operation ordered so far has completed (the host waits: results are wanted there)."""

    def forget(self) -> None:
        """Let go of every operation watched and every object held (at release and exit)."""

    def stamp(self) -> float:
        """A point in time as the device sees it (`seconds_between` turns two into seconds)."""
        return time.perf_counter()

    def seconds_between(self, start: Any, end: Any) -> float:
        return end - start


class StreamSeam(HostSeam):
    """A device with streams (CUDA): waits order the current stream, the host goes on."""

    orders_streams = True

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.monotonic):
        self.device = device
        self._module = torch.get_device_module(device)
        self._clock = clock
        self._watched: deque[_Watched] = deque()
        self._held: deque[tuple[Any, tuple[object, ...]]] = deque()
        self.host_waits = 0

    def settle(self, operation: Orderable, timeout_s: float, what: str) -> None:
        if operation.order():
            self._watched.append(_Watched(operation, self._clock() + timeout_s, timeout_s, what))
            return
        self.host_waits += 1
        operation.wait(timeout_s)

    def mark(self) -> Any:
        event = self._module.Event()
        event.record()
        return event

    def order_after(self, mark: Any) -> None:
        if mark is not None:
            self._module.current_stream().wait_event(mark)

    def done(self, mark: Any) -> bool:
        return mark is None or mark.query()

    def hold(self, mark: Any, *objects: object) -> None:
        self._release_done()
        self._held.append((mark, objects))

    def _release_done(self) -> None:
        held = self._held
        while held and self.done(held[0][0]):
            held.popleft()

    def check(self) -> None:
        """Operations complete in the order their streams run them: only the oldest is asked."""
        watched = self._watched
        while watched and watched[0].operation.is_completed():
            watched.popleft()
        if watched and self._clock() > watched[0].deadline:
            late = watched.popleft()
            raise communication_timeout(late.what, late.timeout_s, None)
        self._release_done()

    def host_read(self) -> None:
        self.host_waits += 1

    def wait_all(self, timeout_s: float) -> None:
        """The host waits for everything ordered so far, each within its own deadline."""
        while self._watched:
            late = self._watched.popleft()
            if not late.operation.is_completed():
                late.operation.wait(max(0.0, late.deadline - self._clock()))
        self._release_done()

    def forget(self) -> None:
        self._watched.clear()
        self._held.clear()

    def stamp(self) -> Any:
        event = self._module.Event(enable_timing=True)
        event.record()
        return event

    def seconds_between(self, start: Any, end: Any) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def seam_for(device: torch.device) -> HostSeam:
    """The seam for tensors on ``device``: a `StreamSeam` where the device has streams (CUDA and
    the like), the `HostSeam` on the CPU (and where a test installs its own: `using_seam`)."""
    if _installed is not None:
        return _installed(device)
    if device.type == "cpu":
        return HostSeam()
    return StreamSeam(device)


_installed: Callable[[torch.device], HostSeam] | None = None
"""What `seam_for` returns instead, while `using_seam` is in effect."""


class using_seam:
    """``with using_seam(make):`` models prepared inside get ``make(device)`` as their seam: a
    recording one in tests (`commsched.testing.seams`), to check where the engine orders and waits."""

    def __init__(self, make: Callable[[torch.device], HostSeam]):
        self._make = make

    def __enter__(self) -> None:
        global _installed
        self._previous, _installed = _installed, self._make

    def __exit__(self, *exc: object) -> None:
        global _installed
        _installed = self._previous

"""The all-gathers of one process group, started in the order asked for, one at a time on gloo.

[Note: one all-gather at a time] Sharded state all-gathers each bucket's updated
parameters once it is updated, in the order the forward pass needs them
(`commsched.update.sharded`). gloo runs two collectives of a group at once, each
then at about half the link's rate: a bucket needed late in the forward pass,
updated early because its reduction was done long before, slowed the gather the
next gate waited for. On 8 emulated hosts at 0.5 Gbit/s the bucket the forward
pass needs second took 100-115 ms to gather beside the last one, where its bytes
need 74 ms. So, for tensors in host memory (gloo), each all-gather starts only
once the one before it has finished: from that one's completion, on a
communication thread, as the second steps of `commsched.comm.two_step` are.
On NCCL the stream runs a group's collectives one after the other anyway, so
every all-gather of CUDA tensors starts when it is asked for.

Ranks must start a group's collectives in one order. One queue serves every
model on the group (they share it: `commsched.comm.side_groups.parameter_group_for`),
it starts them in the order they were asked for, whichever finished when, and
any other collective on the group first starts everything queued (`start_all`).
A queued all-gather never waits for the training thread: a rank whose training
thread blocks elsewhere (in the user's own collective, say) still starts it once
the one before it finishes, as its peers, waiting for it, need.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commsched.device import HostSeam, WorkOrder
from commsched.errors import communication_timeout


@dataclass(eq=False)
class QueuedGather:
    """An all-gather asked for: ``work`` once started (``failure``: starting it raised)."""

    begin: Callable[[], dist.Work]
    what: str
    """What it gathers, for a timeout's message."""
    one_at_a_time: bool
    on_nccl: bool = False
    """Its tensors are on a GPU and its group runs NCCL there (`commsched.device.runs_nccl`)."""
    work: dist.Work | None = None
    failure: BaseException | None = None
    finished: bool = False
    """Set by its completion's callback (which `GatherQueue` goes by, not ``Work.is_completed``)."""


class GatherQueue:
    """One process group's all-gathers; see [Note: one all-gather at a time]."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: deque[QueuedGather] = deque()
        self._started: list[QueuedGather] = []
        """Started and not yet awaited, oldest first."""
        self._started_one = threading.Condition(self._lock)

    def submit(self, begin: Callable[[], dist.Work], what: str, one_at_a_time: bool,
               on_nccl: bool = False) -> QueuedGather:
        """Ask for an all-gather (``begin`` starts it); it starts now if it may."""
        gather = QueuedGather(begin, what, one_at_a_time, on_nccl)
        with self._lock:
            self._queued.append(gather)
        self.start_next()
        return gather

    def start_next(self) -> None:
        """Start, in order, what may start now: everything, or one at a time where asked to."""
        with self._lock:
            started = []
            while self._queued and not (self._queued[0].one_at_a_time and self._running()):
                started.append(self._start(self._queued.popleft()))
        self._follow(started)

    def start_all(self) -> None:
        """Start everything queued, in order: before any other collective on the group."""
        with self._lock:
            started = [self._start(self._queued.popleft()) for _ in range(len(self._queued))]
        self._follow(started)

    def wait(self, gather: QueuedGather, timeout_s: float, seam: HostSeam) -> None:
        """``gather`` has finished (on a GPU: the current stream waits for it, see [Note:
        stream-ordered waits] in commsched/device.py); raise `CommunicationTimeout` naming it if
        it did not in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._started_one:
            started = self._started_one.wait_for(lambda: gather.work is not None or gather.failure is not None,
                                              timeout=timeout_s)
        if gather.failure is not None:
            raise communication_timeout(gather.what, timeout_s, gather.failure)
        if not started:
            raise communication_timeout(f"{gather.what}, which waited for the all-gathers before it",
                                        timeout_s, None)
        work = gather.work
        seam.settle(WorkOrder(work, gather.what, gather.on_nccl), max(0.0, deadline - time.monotonic()), gather.what)
        with self._lock:
            self._started.remove(gather)

    def _running(self) -> bool:
        return any(gather.one_at_a_time and not gather.finished for gather in self._started)

    def _start(self, gather: QueuedGather) -> QueuedGather:
        """Under the lock, so that every rank starts them in the order asked for."""
        try:
            gather.work = gather.begin()
            self._started.append(gather)
        except BaseException as error:  # noqa: BLE001 - raised by wait() on the training thread
            gather.failure = error
        self._started_one.notify_all()
        return gather

    def _follow(self, started: list[QueuedGather]) -> None:
        """Once each of ``started`` finishes, start what may start next. Attached outside the lock:
        a finished one runs its callback at once, on this thread."""
        for gather in started:
            if gather.work is not None and gather.one_at_a_time:
                gather.work.get_future().add_done_callback(lambda _, gather=gather: self._one_finished(gather))

    def _one_finished(self, gather: QueuedGather) -> None:
        """On a communication thread (or this one, where it had finished already)."""
        with self._lock:
            gather.finished = True
        self.start_next()


_QUEUES: weakref.WeakKeyDictionary[dist.ProcessGroup, GatherQueue] = weakref.WeakKeyDictionary()
_QUEUES_LOCK = threading.Lock()


def gather_queue_for(group: dist.ProcessGroup) -> GatherQueue:
    """``group``'s queue, shared by every model that gathers on it."""
    with _QUEUES_LOCK:
        if group not in _QUEUES:
            _QUEUES[group] = GatherQueue()
        return _QUEUES[group]


def gathers_one_at_a_time(device: torch.device) -> bool:
    """Whether all-gathers of tensors on ``device`` are held back to run one at a time: in host
    memory (gloo, which runs two at once); not CUDA tensors (NCCL's stream orders them, and a
    communication thread would start them on another stream than the update's)."""
    return device.type == "cpu"

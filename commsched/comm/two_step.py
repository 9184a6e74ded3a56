"""An all-reduce in two all-to-alls, for many hosts on gloo.

[Note: an all-reduce in two steps] gloo's all-reduce is a ring: 2(N-1) steps
in a row, each paying the link's latency and the host's work. Among 8 or 16
hosts that fixed cost is most of what a partition of a megabyte or less takes:
at 16 emulated hosts, 65 ms for 0.25 MiB, against 33 ms in two steps
(docs/records/2026-11-27-reduce-scatter-on-gloo.md). The same sum goes in two
steps instead:

1. each rank sends piece ``r`` of the partition to rank ``r`` (one
   ``all_to_all_single``, every link at once) and sums what it receives, in
   rank order: it now holds piece ``r`` of the sum;
2. each rank sends its summed piece to every rank (a second
   ``all_to_all_single``), into the partition itself.

Each rank sends the bytes a ring sends, in two steps rather than 2(N-1). Every
rank ends with the same bits: each piece is summed once, by its owner.

Which partitions: by default (``AllReduce(all_to_all_mb="auto")``) only those
of the bucket the next forward pass needs first. It is issued at the end of
backward, behind the other buckets' reductions, and the next forward pass waits
for it, so its time is what shows; behind other traffic the ring's messages
queue on the same connections as the bulk's, while the second steps go on a
group of their own. Where many partitions are in flight the ring's bandwidth
counts more: on 8 emulated hosts at 0.5 Gbit/s, every 1 MiB partition in two
steps was no faster than the ring, while the first bucket alone in two steps
made iterations 9% faster (docs/records/2026-11-28-two-step-all-reduce.md).
It goes in two steps where, timed both ways at the end of warm-up
behind an all-reduce of the largest other bucket, they took at most 0.9 of the
ring's time (`commsched.planning.calibration.time_both_ways`): rank 0's
verdict, on every rank.

The second step can start only once the first is done, so it is issued from the
first's completion, on a communication thread. Collectives are matched by issue
order, and completions come in a different order on different ranks: the second
steps go on a group of their own (`commsched.comm.side_groups.exchange_group_for`),
always in the order the first steps were issued (`SecondSteps`), which is the
plan's, the same on every rank.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from commsched.errors import communication_timeout, wait_or_raise


class TwoStepRule:
    """Which partitions the all-reduce transport sends in two steps; where the first bucket's are
    to be timed first (``AllReduce(all_to_all_mb="auto")``), also its `commsched.comm.transport.TwoStepTiming`."""

    def __init__(self, second_steps: SecondSteps, all_to_all_mb: float | str):
        self.second_steps = second_steps
        self.first_bucket_only = all_to_all_mb == "auto"
        """Only the bucket the next forward pass needs first goes in two steps ("auto")."""
        self.max_bytes = 0 if self.first_bucket_only else int(float(all_to_all_mb) * 2**20)
        """Partitions of at most this many bytes go in two steps, now (0: none)."""
        self.why = "" if self.first_bucket_only else f"partitions up to {float(all_to_all_mb):.3g} MiB in two all-to-alls"

    def use(self, max_bytes: int, why: str) -> None:
        self.max_bytes = max_bytes
        way = "in two all-to-alls" if max_bytes else "by gloo's ring"
        self.why = f"the first bucket {way}: {why}"

    def applies(self, nbytes: int, bucket: int, first_bucket: int) -> bool:
        """Whether a partition of ``nbytes`` of ``bucket`` goes in two steps (``first_bucket``: the
        one the forward pass needs first)."""
        return nbytes <= self.max_bytes and (bucket == first_bucket or not self.first_bucket_only)


def two_steps_possible(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether gradients on ``device`` may be all-reduced in two steps on ``group``: gloo's ring,
    among 3 or more ranks (among 2, a ring takes two steps anyway), with tensors in host memory."""
    return (str(dist.get_backend(group)) == "gloo" and dist.get_world_size(group) >= 3
            and torch.device(device).type == "cpu")


def piece_sizes(numel: int, world_size: int) -> list[int]:
    """The sizes of the ``world_size`` pieces of ``numel`` elements, the first ones one larger."""
    base, extra = divmod(numel, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


class SecondSteps:
    """Issues the second steps of two-step all-reduces on their own group, in first-step order.

    One per group (`of_group`): models prepared on one user group share its exchange group, and
    their first steps are issued in program order, each backward pass's by its end (see [Note:
    everything goes by the end of backward] in `commsched.engine.dispatch`), so one queue keeps
    every rank's second steps in the same order.
    """

    def __init__(self, group: dist.ProcessGroup):
        self._group = weakref.ref(group)  # the queue goes with its group (`of_group`)
        self._lock = threading.Lock()
        self._waiting: deque[TwoStepAllReduce] = deque()

    @classmethod
    def of_group(cls, group: dist.ProcessGroup) -> SecondSteps:
        """The queue of ``group`` (an exchange group), made at the first call."""
        with _QUEUES_LOCK:
            if group not in _QUEUES:
                _QUEUES[group] = cls(group)
            return _QUEUES[group]

    @property
    def locked(self) -> bool:
        """Some thread holds the queue's lock now (second steps go under it, their callbacks after it)."""
        return self._lock.locked()

    def enqueue(self, reduction: TwoStepAllReduce) -> None:
        """``reduction``'s first step was just issued: its second goes after every earlier one's."""
        with self._lock:
            self._waiting.append(reduction)

    def first_step_done(self) -> None:
        """Issue the second step of every reduction at the head whose first step is done.

        The second steps are issued under the lock, so that they go in order; their
        completion callbacks are attached after it: a step already complete runs them at
        once, on this thread, and they take the dispatcher's lock, which the training
        thread may hold while it waits for this one to `enqueue` (once a deadlock).
        """
        issued = []
        with self._lock:
            while self._waiting and self._waiting[0].summed:
                reduction = self._waiting.popleft()
                reduction.issue_second_step(self._group())
                issued.append(reduction)
        for reduction in issued:
            reduction.second_step_issued()


_QUEUES: weakref.WeakKeyDictionary[dist.ProcessGroup, SecondSteps] = weakref.WeakKeyDictionary()
_QUEUES_LOCK = threading.Lock()
atexit.register(_QUEUES.clear)


class SecondStepOperation:
    """An operation whose second collective can start only once its first is done, issued through
    `SecondSteps` (the two-step all-reduce below; PowerSGD's all-reduce of ``Q`` in
    `commsched.comm.powersgd`). A subclass issues its first step, then calls `_first_issued`; on
    the first step's completion it does its part and calls `_first_step_done`; `_second_work`
    issues the second. ``wait`` (theirs) ends with `_wait_second_step`."""

    def __init__(self, second_steps: SecondSteps, what: str):
        self._what = what
        self._second_steps = second_steps
        self._second: dist.Work | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._issued = threading.Event()
        """Set once the second step is issued, or once the first failed (then ``_failure`` says how)."""
        self._failure: BaseException | None = None
        self.summed = False
        """True once the second step is ready to go (`SecondSteps` reads it)."""

    def _first_issued(self, first: dist.Work, on_first_done: Callable[[], None]) -> None:
        """The first step is on its way: queue the second, and run ``on_first_done`` (on a
        communication thread) when the first is done, then let the second steps go in order."""
        self._first = first
        self._second_steps.enqueue(self)

        def done(future: torch.futures.Future) -> None:
            try:
                future.value()
                on_first_done()
                self.summed = True
                self._second_steps.first_step_done()
            except BaseException as error:  # noqa: BLE001 - surfaced by wait() on the training thread
                self._failure = error
                self._issued.set()

        first.get_future().add_done_callback(done)

    def _second_work(self, group: dist.ProcessGroup) -> dist.Work:
        """Issue the second step on ``group`` (the exchange group): a subclass's own collective."""
        raise NotImplementedError

    def issue_second_step(self, group: dist.ProcessGroup) -> None:
        """Called by `SecondSteps`, in first-step order."""
        second = self._second_work(group)
        with self._lock:
            self._second = second

    def second_step_issued(self) -> None:
        """Called by `SecondSteps` after `issue_second_step`, outside its lock: the callbacks
        registered so far go on the second step (those registered since went on it directly)."""
        with self._lock:
            second, callbacks, self._callbacks = self._second, self._callbacks, []
        assert second is not None, "second_step_issued before issue_second_step"
        for callback in callbacks:
            second.get_future().add_done_callback(lambda _, callback=callback: callback())
        self._issued.set()

    def _wait_steps(self, timeout_s: float, first: str, second: str) -> None:
        """Wait for both steps (``first`` and ``second`` name them in a timeout's message)."""
        deadline = time.monotonic() + timeout_s
        wait_or_raise(self._first, timeout_s, f"{first} of {self._what}")
        if not self._issued.wait(max(0.0, deadline - time.monotonic())):
            raise communication_timeout(f"{second} of {self._what}", timeout_s, None)
        if self._failure is not None:
            raise communication_timeout(f"{first} of {self._what}", timeout_s, self._failure)
        wait_or_raise(self._second, max(0.0, deadline - time.monotonic()), f"{second} of {self._what}")

    def is_completed(self) -> bool:
        second = self._second
        return second is not None and second.is_completed()

    def on_complete(self, callback: Callable[[], None]) -> None:
        with self._lock:
            second = self._second
            if second is None:
                self._callbacks.append(callback)
                return
        second.get_future().add_done_callback(lambda _: callback())


class TwoStepAllReduce(SecondStepOperation):
    """The sum of ``tensor`` over ``group``, in place, in two all-to-alls (see [Note: an all-reduce
    in two steps]). ``wait`` and ``is_completed`` cover both steps."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup, second_steps: SecondSteps, what: str):
        super().__init__(second_steps, what)
        self._tensor = tensor
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        self._sizes = piece_sizes(tensor.numel(), world_size)
        self._mine = self._sizes[rank]
        self._received = torch.empty(self._mine * world_size, dtype=tensor.dtype, device=tensor.device)
        self._send: torch.Tensor | None = None
        first = dist.all_to_all_single(self._received, tensor, [self._mine] * world_size, self._sizes,
                                       group=group, async_op=True)
        self._first_issued(first, self._sum_my_piece)

    def _sum_my_piece(self) -> None:
        """On a communication thread: this rank's piece of the sum, to send to every rank."""
        world_size = len(self._sizes)
        summed = torch.sum(self._received.view(world_size, self._mine), dim=0)
        self._send = summed.repeat(world_size)
        self._received = None  # type: ignore[assignment]

    def _second_work(self, group: dist.ProcessGroup) -> dist.Work:
        """Send this rank's summed piece to every rank."""
        world_size = len(self._sizes)
        return dist.all_to_all_single(self._tensor, self._send, self._sizes, [self._mine] * world_size,
                                      group=group, async_op=True)

    def wait(self, timeout_s: float) -> None:
        self._wait_steps(timeout_s, "the first step", "the second step")
        self._send = None

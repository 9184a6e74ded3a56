"""The dispatcher: from "this bucket is ready" to partitions on the wire, in the agreed order.

One `Dispatcher` per backward pass wraps that pass's `PlanExecutor`. Partitions
are issued by the training thread (gradient hooks) and, when a partition
completes and returns credit, by a communication thread: one at a time, under
a lock, always in plan order. Without the completion path, credit would only
come back at the next gradient hook, and the link would idle through a long
layer's backward computation.

[Note: everything goes by the end of backward] When the backward pass ends,
every partition left goes out at once, on the training thread. Gloo runs
operations side by side on its worker threads, over one connection per peer,
so the bucket the next forward needs first then shares the link with the
partitions planned after it (traced at 1 Gbit/s, VGG-like: its 88 KB issued
together with 1 MB of a later layer took 25 to 45 ms instead of 2). Holding
those back until that bucket is done was tried, and must not be done on the
user's group: collectives are matched by issue order, and after backward()
the ranks' programs may differ. A rank under ``Join`` that ran out of batches
waits in its shadow iteration for partitions the last rank would only issue
at its next forward, which never comes; ``state_dict()`` on rank 0 alone, then
an ``all_reduce`` of a metric, puts the held partitions before the metric on
rank 0 and after it elsewhere; a completion callback's timing differs between
ranks. Only the end of backward is the same place in every rank's program.
(`tests/distributed/test_scheduling.py` has the user's collectives after
backward; `tests/distributed/test_join.py` the shadow iterations.) Holding
needs a group only commsched issues on, with the held partitions issued from
completions.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from commsched.comm.transport import Handle
from commsched.engine.completion import CallbackTracker
from commsched.layout.partitions import Partition, Plan


class PlanExecutor:
    """Issues one backward pass's partitions in plan order, each once ready locally and within credit.

    Driven by events (a bucket became ready, a partition completed, the backward
    pass ended); completed partitions leave the in-flight queue, whatever their
    place in it, when an event arrives, never by spinning. One executor per
    backward pass: it is never reset.
    """

    def __init__(self, plan: Plan):
        self.partitions = plan.partitions
        self.plan = plan.order
        self.credit_bytes = plan.credit_bytes
        self._bucket_ready = [False] * plan.num_buckets
        self._next = 0
        self._in_flight: deque[tuple[int, object]] = deque()
        self._in_flight_bytes = 0

    @property
    def done(self) -> bool:
        return self._next == len(self.plan)

    def mark_ready(self, bucket: int) -> None:
        self._bucket_ready[bucket] = True

    def forget_in_flight(self) -> None:
        """Let go of the handles of partitions in flight (the pass is over: nothing is issued after)."""
        self._in_flight.clear()
        self._in_flight_bytes = 0

    def pump(
        self,
        launch: Callable[[Partition], object],
        is_completed: Callable[[object], bool],
        ignore_credit: bool = False,
        seen_complete: Callable[[Partition, object], None] | None = None,
    ) -> None:
        """Issue every partition the plan, readiness and the window allow now (``seen_complete``:
        told of each partition found complete here)."""
        self.prune(is_completed, seen_complete)
        in_flight = self._in_flight
        plan, partitions, credit = self.plan, self.partitions, self.credit_bytes
        while self._next < len(plan):
            p = partitions[plan[self._next]]
            if not self._bucket_ready[p.bucket]:
                return
            if (
                not ignore_credit and credit is not None and in_flight
                and self._in_flight_bytes + p.nbytes > credit
            ):
                return
            handle = launch(p)
            in_flight.append((p.pid, handle))
            self._in_flight_bytes += p.nbytes
            self._next += 1

    def prune(self, is_completed: Callable[[object], bool],
              seen_complete: Callable[[Partition, object], None] | None = None) -> None:
        """Partitions that completed leave the window, not only from the front: gloo's threads
        finish side by side."""
        in_flight = self._in_flight
        still = []
        for pid, handle in in_flight:
            if not is_completed(handle):
                still.append((pid, handle))
            elif seen_complete is not None:
                seen_complete(self.partitions[pid], handle)
        if len(still) < len(in_flight):
            in_flight.clear()
            in_flight.extend(still)
            self._in_flight_bytes = sum(self.partitions[pid].nbytes for pid, _ in still)


class Dispatcher:
    """Issues one backward pass's partitions: in plan order, when ready, within credit."""

    def __init__(
        self,
        plan: Plan,
        launch: Callable[[Partition], Handle],
        tracker: CallbackTracker,
        credit_from_completions: bool,
        seen_complete: Callable[[Partition, Handle], None] | None = None,
    ):
        """``credit_from_completions``: a completion's callback returns its credit (gloo); else
        only ``is_completed()``, asked at each event, does (NCCL, whose future completes when the
        collective is enqueued); ``seen_complete``: then told of each partition found complete."""
        self._executor = PlanExecutor(plan)
        self._launch = launch
        self._tracker = tracker
        self._credit_from_completions = credit_from_completions
        self._seen_complete = None if credit_from_completions else seen_complete
        self._lock = threading.Lock()
        self._issuing_thread: int | None = None
        self._error: Exception | None = None
        self._completed_inline: list[Handle] = []
        """Partitions whose callback ran at once, inside the pump that issued them (see `_pump`)."""
        self._backward_running = True

    def bucket_ready(self, bucket: int) -> None:
        with self._issuing():
            self._executor.mark_ready(bucket)
            self._pump(_is_completed)

    def poll(self) -> None:
        """Where completions have no callback (NCCL): find the partitions complete by now, at a
        point the training thread passes anyway (a gate)."""
        if self._seen_complete is not None:
            with self._lock:
                self._executor.prune(_is_completed, self._seen_complete)

    def end_backward(self) -> None:
        """The backward pass is over: completions no longer issue (everything left goes now)."""
        self._backward_running = False

    def forget_in_flight(self) -> None:
        """Let go of the handles of partitions in flight, and of the pass's ``launch``: the pass is
        over (see `BackwardPass.drop_handles`). The pass holds this dispatcher and ``launch`` holds
        the pass, so keeping it would leave the pass, and the buckets it holds, to the cyclic
        garbage collector."""
        with self._lock:
            self._executor.forget_in_flight()
            self._launch = _launch_after_pass

    def issue_remaining(self) -> None:
        """Issue every partition left, whatever the window; raise what a completion thread hit.

        See [Note: everything goes by the end of backward].
        """
        with self._issuing():
            self._pump(_is_completed, ignore_credit=True)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        assert self._executor.done, "every partition must be issued by the end of backward"

    def _pump(self, is_completed: Callable[[Handle], bool], ignore_credit: bool = False) -> None:
        """The executor's pump, again while partitions completed inside it: a partition done
        before its callback was attached runs that callback at once, inside this pump, which
        would otherwise keep its credit until the next event."""
        self._executor.pump(self._issue, is_completed, ignore_credit, self._seen_complete)
        while self._completed_inline:
            done, self._completed_inline = self._completed_inline, []

            def completed_or_done(other: Handle, done: list[Handle] = done) -> bool:
                return any(other is d for d in done) or is_completed(other)

            self._executor.pump(self._issue, completed_or_done, ignore_credit)

    def _issue(self, partition: Partition) -> Handle:
        handle = self._launch(partition)
        if self._credit_from_completions:
            self._tracker.when_complete(handle, lambda: self._on_partition_complete(handle))
        return handle

    def _on_partition_complete(self, handle: Handle) -> None:
        """Runs on a communication thread: returned credit may let the next partition go.

        The operation's own ``is_completed()`` still says False while its callbacks
        run (torch marks the work completed after them), so ``handle`` counts as
        completed here: read from the handle alone, its credit would come back
        only at the next event.
        """
        if self._issuing_thread == threading.get_ident():
            # It completed before its callback was attached, inside our own pump: that pump counts it.
            self._completed_inline.append(handle)
            return
        if not self._backward_running:
            return  # everything is issued at the end of backward anyway

        def is_completed(other: Handle) -> bool:
            return other is handle or other.is_completed()

        with self._issuing():
            try:
                if self._backward_running:
                    self._pump(is_completed)
            except Exception as error:  # noqa: BLE001 - surfaced on the training thread
                self._error = error

    @contextmanager
    def _issuing(self) -> Iterator[None]:
        with self._lock:
            self._issuing_thread = threading.get_ident()
            try:
                yield
            finally:
                self._issuing_thread = None


def _is_completed(handle: Handle) -> bool:
    return handle.is_completed()


def _launch_after_pass(partition: Partition) -> Handle:
    raise RuntimeError(f"partition {partition} was issued after its backward pass was over")

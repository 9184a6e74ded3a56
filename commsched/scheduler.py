"""Which partition goes on the wire when: partitions, the agreed order, credit.

Pure logic, no process group: testable with a recording fake launcher.

[Note: the agreed order] Collectives are matched by issue order, so every rank
must issue partitions in the same sequence whatever its timing. A local
priority queue would decide by timing; instead all ranks follow one *plan*, a
fixed sequence of partition ids. Each rank issues the next partition of the
plan as soon as it is ready locally and fits the credit window, and never skips
ahead. The plan is computed by rank 0 by simulating priority scheduling under
credit on its own measured timeline (when each bucket became ready, how fast
the link is), and published once, so the per-partition cost is nothing but
the issue itself. A fixed order cannot adapt to a link faster or slower than
simulated, so `robust_plan` hedges it: where computation sets the pace, only
what the simulation finishes during the backward pass keeps its place (the
rest waits behind the urgent buckets); where the link does, what it starts.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    """A contiguous slice ``[start, end)`` of one bucket's flat buffer."""

    pid: int
    bucket: int
    start: int
    end: int
    nbytes: int
    priority: int
    """Lower is more urgent: the forward position of the bucket's first parameter."""


def make_partitions(
    bucket_numels: Sequence[int],
    element_sizes: Sequence[int],
    bucket_priorities: Sequence[int],
    partition_bytes: int | None,
) -> list[Partition]:
    """Cut every bucket into slices of about ``partition_bytes`` (whole if None).

    The number of slices is the bucket's size over ``partition_bytes``, rounded to
    the nearest (at least one), and slices are as equal as possible: no slice is
    larger than 1.5 times ``partition_bytes`` (or one element), and a bucket just
    over the size, as size-based buckets usually are, is not cut into two halves
    that would cost two collectives instead of one.
    """
    partitions: list[Partition] = []
    for bucket, (numel, size, priority) in enumerate(
        zip(bucket_numels, element_sizes, bucket_priorities, strict=True)
    ):
        if partition_bytes is None:
            pieces = 1
        else:
            target_elements = max(1, partition_bytes // size)
            pieces = min(numel, max(1, int(numel / target_elements + 0.5)))
        for piece in range(pieces):
            start, end = numel * piece // pieces, numel * (piece + 1) // pieces
            partitions.append(Partition(len(partitions), bucket, start, end, (end - start) * size, priority))
    return partitions


def fifo_plan(partitions: Sequence[Partition]) -> list[int]:
    """Buckets in the order they become ready, partitions in order: torch DDP's order."""
    return [p.pid for p in sorted(partitions, key=lambda p: (p.bucket, p.start))]


@dataclass(frozen=True)
class LinkModel:
    """How long one all-reduce of ``n`` bytes takes: ``latency_s + n / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def duration_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class SimulatedSchedule:
    order: list[int]
    """Partition ids in issue order."""
    finish_s: dict[int, float]
    """When each partition's reduction completes, relative to the first ready bucket."""
    start_s: dict[int, float]
    """When each partition gets the link (issued, and every earlier one done)."""


def simulate_schedule(
    partitions: Sequence[Partition],
    bucket_ready_s: Sequence[float],
    link: LinkModel,
    credit_bytes: int | None,
    by_priority: bool,
) -> SimulatedSchedule:
    """Replay one backward pass: buckets become ready at ``bucket_ready_s``, the link
    reduces one partition at a time, and whenever credit allows the most urgent
    ready partition (or the oldest, without priority) is issued.

    After the last bucket is ready nothing more can overtake, so the window no
    longer limits what is issued (the executor does the same).
    """
    last_ready = max(bucket_ready_s) if len(bucket_ready_s) else 0.0

    def rank(p: Partition) -> tuple:
        return (p.priority, p.bucket, p.start) if by_priority else (p.bucket, p.start)

    arrivals = sorted(partitions, key=lambda p: (bucket_ready_s[p.bucket], p.bucket, p.start))
    ready: list[tuple] = []
    order: list[int] = []
    finish: dict[int, float] = {}
    start_on_link: dict[int, float] = {}
    in_flight: deque[tuple[float, int]] = deque()  # (finish time, bytes)
    in_flight_bytes, link_free_at, now, next_arrival = 0, 0.0, 0.0, 0

    while len(order) < len(partitions):
        while next_arrival < len(arrivals) and bucket_ready_s[arrivals[next_arrival].bucket] <= now:
            p = arrivals[next_arrival]
            heapq.heappush(ready, (rank(p), p.pid, p))
            next_arrival += 1
        while in_flight and in_flight[0][0] <= now:
            in_flight_bytes -= in_flight.popleft()[1]
        issued = False
        while ready:
            p = ready[0][2]
            window_open = (
                credit_bytes is None or now >= last_ready or not in_flight
                or in_flight_bytes + p.nbytes <= credit_bytes
            )
            if not window_open:
                break
            heapq.heappop(ready)
            start = max(now, link_free_at)
            start_on_link[p.pid] = start
            link_free_at = start + link.duration_s(p.nbytes)
            finish[p.pid] = link_free_at
            in_flight.append((link_free_at, p.nbytes))
            in_flight_bytes += p.nbytes
            order.append(p.pid)
            issued = True
        if issued:
            continue
        upcoming = []
        if next_arrival < len(arrivals):
            upcoming.append(bucket_ready_s[arrivals[next_arrival].bucket])
        if in_flight:
            upcoming.append(in_flight[0][0])
        now = max(now, min(upcoming))
    return SimulatedSchedule(order, finish, start_on_link)


def robust_plan(
    partitions: Sequence[Partition], schedule: SimulatedSchedule, last_ready_s: float, link_sets_the_pace: bool = False
) -> list[int]:
    """The simulated order, hardened against a link slower than modelled.

    Only partitions the simulation has done before the last bucket is ready
    keep their simulated place; all others follow in priority order. The ones
    kept fill the link during the backward pass; the rest are issued when the
    backward pass ends, most urgent first. Had the simulated order been kept
    whole, late, slow partitions planned ahead of the most urgent bucket would
    hold up the next forward pass.

    "Done" is when the simulation *finishes* a partition where computation sets
    the pace: the link has time to spare, and what matters is that nothing
    non-urgent is still ahead of the input-side buckets. Where the link sets the
    pace (``link_sets_the_pace``), every second it idles is lost, so a partition
    the simulation *starts* before the end keeps its place too: moving it
    behind the urgent bucket would leave the link idle, with partitions ready,
    until the backward pass ends. At most one kept partition is then planned to
    run past the end (the link carries one at a time).
    """
    if link_sets_the_pace:
        early = [pid for pid in schedule.order if schedule.start_s[pid] < last_ready_s]
    else:
        early = [pid for pid in schedule.order if schedule.finish_s[pid] <= last_ready_s]
    kept = set(early)
    late = sorted((p for p in partitions if p.pid not in kept), key=lambda p: (p.priority, p.bucket, p.start))
    return early + [p.pid for p in late]


@dataclass(frozen=True, eq=False)
class Plan:
    """The agreed issue order of every partition, and the credit window it runs under."""

    partitions: tuple[Partition, ...]
    order: tuple[int, ...]
    """Partition ids in issue order: every rank issues exactly this sequence."""
    credit_bytes: int | None
    agreed: bool = False
    """False: torch DDP's order (`fifo_plan`); True: rank 0's plan, agreed by every rank."""

    def __post_init__(self) -> None:
        if sorted(self.order) != list(range(len(self.partitions))):
            raise ValueError("a plan must name every partition exactly once")

    @property
    def num_buckets(self) -> int:
        return 1 + max((p.bucket for p in self.partitions), default=-1)


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
    ) -> None:
        """Issue every partition the plan, readiness and the window allow now."""
        in_flight = self._in_flight
        # Any that completed leaves, not only from the front: gloo's threads finish side by side.
        still = [(pid, handle) for pid, handle in in_flight if not is_completed(handle)]
        if len(still) < len(in_flight):
            in_flight.clear()
            in_flight.extend(still)
            self._in_flight_bytes = sum(self.partitions[pid].nbytes for pid, _ in still)
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

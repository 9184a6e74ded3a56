"""Priority scheduling under credit, simulated on a timeline, and the plan it gives.

Pure logic, no process group. Rank 0 replays one backward pass on its measured
timeline (when each bucket became ready, how fast the link is) to order the
partitions (see [Note: the agreed order] in `commsched.layout.partitions`). A
fixed order cannot adapt to a link faster or slower than simulated, so
`robust_plan` hedges it: only what the simulation starts during the backward
pass keeps its place (the rest waits behind the urgent buckets). Where nothing
waits for one bucket before another, there is nothing to order by urgency:
`arrival_order`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from commsched.layout.partitions import Partition
from commsched.planning.wire import Flight, Wire, wire_share


@dataclass(frozen=True)
class LinkModel:
    """How long one all-reduce of ``n`` bytes takes alone: ``latency_s + n / bytes_per_s``; and how many
    the transport runs at once, taking turns step by step (see `commsched.planning.wire`)."""

    latency_s: float
    bytes_per_s: float
    in_flight: int = 1

    def duration_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s



@dataclass(frozen=True)
class SimulatedSchedule:
    order: list[int]
    """Partition ids in issue order."""
    finish_s: dict[int, float]
    """When each partition's reduction completes, relative to the first ready bucket."""
    start_s: dict[int, float]
    """When each partition gets the link (issued, and a place on it: with one collective in flight,
    every earlier one done)."""


def simulate_schedule(
    partitions: Sequence[Partition],
    bucket_ready_s: Sequence[float],
    link: LinkModel,
    credit_bytes: int | None,
    by_priority: bool,
) -> SimulatedSchedule:
    """Replay one backward pass: buckets become ready at ``bucket_ready_s``, the link
    reduces one partition at a time (or ``link.in_flight`` at once, see
    `commsched.planning.wire`), and whenever credit allows the most urgent
    ready partition (or the oldest, without priority) is issued.

    After the last bucket is ready nothing more can overtake, so the window no
    longer limits what is issued (the executor does the same).
    """
    last_ready = max(bucket_ready_s) if len(bucket_ready_s) else 0.0

    def rank(p: Partition) -> tuple:
        return (p.priority, p.bucket, p.start) if by_priority else (p.bucket, p.start)

    arrivals = sorted(partitions, key=_by_arrival(bucket_ready_s))
    on_link = _OnTheWire(link)
    ready: list[tuple] = []
    order: list[int] = []
    now, next_arrival = 0.0, 0

    while len(order) < len(partitions):
        while next_arrival < len(arrivals) and bucket_ready_s[arrivals[next_arrival].bucket] <= now:
            p = arrivals[next_arrival]
            heapq.heappush(ready, (rank(p), p.pid, p))
            next_arrival += 1
        on_link.complete_until(now)
        issued = False
        while ready:
            p = ready[0][2]
            window_open = (
                credit_bytes is None or now >= last_ready or not on_link.flying
                or on_link.flying_bytes + p.nbytes <= credit_bytes
            )
            if not window_open:
                break
            heapq.heappop(ready)
            on_link.issue(p, now)
            order.append(p.pid)
            issued = True
        if issued:
            continue
        upcoming = []
        if next_arrival < len(arrivals):
            upcoming.append(bucket_ready_s[arrivals[next_arrival].bucket])
        if (done := on_link.next_completion()) is not None:
            upcoming.append(done)
        now = max(now, min(upcoming))
    on_link.complete_until(math.inf)
    return SimulatedSchedule(order, on_link.finish_s, on_link.start_s)


class _OnTheWire:
    """The partitions issued and not yet done, ``link.in_flight`` at once on a `Wire`: with more than
    one, one issued later slows those on the wire, so a finish is known only once nothing else can be
    issued before it."""

    def __init__(self, link: LinkModel):
        self.link = link
        self.finish_s: dict[int, float] = {}
        self.start_s: dict[int, float] = {}
        self._wire = Wire(link.in_flight)
        self._bytes: dict[int, int] = {}
        self.flying_bytes = 0

    @property
    def flying(self) -> int:
        return len(self._bytes)

    def issue(self, p: Partition, now: float) -> None:
        self._wire.progress(now, 1.0)
        duration = self.link.duration_s(p.nbytes)
        self._wire.add(Flight((0, p.pid), duration, wire_share(duration, self.link.latency_s)))
        self._bytes[p.pid] = p.nbytes
        self.flying_bytes += p.nbytes

    def next_completion(self) -> float | None:
        upcoming = self._wire.next_finish(1.0)
        return None if upcoming is None else upcoming[0]

    def complete_until(self, t: float) -> None:
        while (upcoming := self._wire.next_finish(1.0)) is not None and upcoming[0] <= t:
            self._wire.progress(upcoming[0], 1.0)
            done = self._wire.finish(upcoming[1])
            pid = done.key[1]
            self.start_s[pid], self.finish_s[pid] = done.since_s, upcoming[0]
            self.flying_bytes -= self._bytes.pop(pid)
        if math.isfinite(t):
            self._wire.progress(t, 1.0)


def robust_plan(partitions: Sequence[Partition], schedule: SimulatedSchedule, last_ready_s: float) -> list[int]:
    """The simulated order, hardened against a link slower than modelled.

    Only partitions the simulation *starts* before the last bucket is ready
    keep their simulated place; all others follow in priority order. The ones
    kept fill the link during the backward pass; the rest are issued when the
    backward pass ends, most urgent first. Had the simulated order been kept
    whole, late, slow partitions planned ahead of the most urgent bucket would
    hold up the next forward pass. At most one kept partition is planned to
    run past the end (the link carries one at a time), so a link slower than
    modelled delays the urgent buckets by at most about one partition.

    [Note: keeping the link busy] Keeping only the partitions the simulation
    *finishes* before the end (as this once did where computation seemed to
    set the pace) idles the link for the whole backward pass whenever no
    partition fits before the end: at 8 hosts on a 500 Mbit/s link, the
    VGG16 profile's fully connected gradients (ready first, about a 200 ms
    transfer against a 146 ms backward pass) all waited for the convolutions',
    which come last, and an iteration took 421 ms where keeping them took 327
    and torch DDP's best 328. Which rule applied hung on whether the idle
    link's time for every partition exceeded the computation's, which in that
    cell it did by 1%, so the same cell flipped between the two.
    """
    early = [pid for pid in schedule.order if schedule.start_s[pid] < last_ready_s]
    kept = set(early)
    late = sorted((p for p in partitions if p.pid not in kept), key=lambda p: (p.priority, p.bucket, p.start))
    return early + [p.pid for p in late]


def arrival_order(partitions: Sequence[Partition], bucket_ready_s: Sequence[float]) -> list[int]:
    """Every partition in the order its bucket becomes ready on the timeline (ties by bucket, then
    offset): the plan where every reduction is awaited at once, at the end of backward or at
    ``step()`` (forward overlap off).

    [Note: a plan without urgency] Without forward overlap nothing needs one bucket before another,
    and the priority plan only holds the link back: `robust_plan` leaves what the simulation did not
    start during the backward pass to go most urgent first, which is the input side's bucket, ready
    only when the backward pass ends; every partition behind it waits for it, ready or not, while
    the link carries one collective or none. At 8 emulated hosts on the ResNet-50 profile an
    iteration took 361 ms with that plan and 332 with the same partitions in the order they
    became ready (docs/simulator.md, "Why commsched without forward overlap was slower than
    simulated"). In this order no partition ever waits behind one whose bucket is not ready yet
    on the planning timeline.
    """
    return [p.pid for p in sorted(partitions, key=_by_arrival(bucket_ready_s))]


def _by_arrival(bucket_ready_s: Sequence[float]) -> Callable[[Partition], tuple]:
    """The order partitions become ready: their bucket's time, then bucket, then offset."""
    return lambda p: (bucket_ready_s[p.bucket], p.bucket, p.start)

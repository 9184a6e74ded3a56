"""`Wire`: one link of the simulator and the collectives on it, taking turns step by step.

[Note: two collectives at once] gloo runs two collectives of a process group
at once (one per worker thread), on the same connections. A ring all-reduce
among N hosts is 2 (N - 1) steps; in each, every host sends one chunk to its
neighbour and waits for one, so a step costs a hop's latency and the host's
work (the fixed cost, spread over the steps) plus a chunk on the wire. Two
all-reduces in flight take turns on each connection, one step each: a round
of the two lasts as long as the longer step alone, or the two chunks back to
back, whichever is more.

So a small collective right behind a large one advances one step per step of
the large one and is done about when the large one is: at 8 emulated hosts,
64 KiB issued behind 9 MiB was done after 239 ms, which this model puts at 275
(docs/records/2026-11-28-two-collectives-in-flight.md). The model this replaced
let the younger run in the older's gaps at whatever rate they left, which
pairs of like size also fit, but which let a small collective through a large
one in well under half the time it takes (it priced GPT-2's small layers
between large ones too fast). Taking them one at a time, as the simulator once
did, is too slow wherever two overlap (the same record).

The model: a collective of fixed cost ``F`` and wire time ``W`` alone takes
``D = F + W`` (its wire share ``u = W / D``). With collectives ``i`` on the
wire together, a round takes ``R = max(max_i D_i, sum_i W_i)`` (in units of
the whole collective: every one has the same number of steps), and each runs
at rate ``D_i / R`` of its own pace alone. One collective alone runs at full
rate; one that is all fixed cost shares nothing but its turn; up to
``places`` are on the wire (gloo 2; NCCL's one stream and a parameter
server's link 1, where the model is taking turns whole), the rest queue.
Every rate is also slowed while the worker computes (``collective_slowdown``).

Collectives on other connections (a *lane* of their own: the all-to-alls of
a two-step all-reduce, [Note: an all-reduce in two steps] in
`commsched.comm.two_step`) do not take turns with the ring's; they share the
wire's bandwidth. Each lane alone keeps the wire busy ``sum_i W_i / R`` of
the time; where the lanes together want more than all of it, every rate is
slowed by that sum. The first bucket's 1 MiB right behind a 5.49 MiB
all-reduce, at 8 hosts: by the ring 194-200 ms (this model 191-195), in two
all-to-alls 67-80 ms (this model 69-75), on six clusters' links.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


def wire_share(whole_s: float, fixed_s: float) -> float:
    """How much of its link a collective keeps busy alone: its wire time over its whole time
    (``whole_s``), the rest its fixed cost (``fixed_s``)."""
    return (whole_s - fixed_s) / whole_s if whole_s > 0 else 0.0


@dataclass
class Flight:
    """One collective on a wire."""

    key: tuple[int, int]
    """(iteration, unit)."""
    left_s: float
    """Its work left, in seconds at full rate."""
    share: float
    """How much of the link it keeps busy at full rate: its wire time over its whole time alone."""
    since_s: float = 0.0
    """When it got its place on the wire."""
    whole_s: float = 0.0
    """Its time alone, fixed cost and wire (0: ``left_s`` as issued)."""
    lane: int = 0
    """The connections it goes on: flights of one lane take turns step by step; lanes share the
    wire's bandwidth ([Note: two collectives at once])."""

    def __post_init__(self) -> None:
        if self.whole_s <= 0:
            self.whole_s = self.left_s


class Wire:
    """The collectives of one link: up to ``places`` in flight (oldest first), then the queue."""

    def __init__(self, places: int):
        self.places = places
        self.flights: list[Flight] = []
        self.queue: deque[Flight] = deque()
        self.at = 0.0
        """The time up to which ``left_s`` of the flights is accounted."""
        self.version = 0
        """Bumped on every change, so a completion scheduled before it is known to be stale."""

    def rates(self) -> list[float]:
        """Each flight's rate at full speed: its time alone over a round of its lane's flights (1 alone),
        all of them slowed alike where the lanes together want more than the wire."""
        lanes: dict[int, list[Flight]] = {}
        for flight in self.flights:
            lanes.setdefault(flight.lane, []).append(flight)
        round_s, busy = {}, 0.0
        for lane, flights in lanes.items():
            wire_s = sum(f.whole_s * f.share for f in flights)
            round_s[lane] = max(max(f.whole_s for f in flights), wire_s)
            busy += wire_s / round_s[lane] if round_s[lane] > 0 else 0.0
        slowed = max(1.0, busy)
        return [f.whole_s / round_s[f.lane] / slowed if round_s[f.lane] > 0 else 1.0 for f in self.flights]

    def progress(self, t: float, speed: float) -> None:
        """Account the work done from ``at`` to ``t`` at ``speed`` (1: nothing slows the link)."""
        if t > self.at:
            for flight, rate in zip(self.flights, self.rates(), strict=True):
                flight.left_s -= (t - self.at) * speed * rate
            self.at = t

    def add(self, flight: Flight) -> None:
        """Issue ``flight`` at ``at`` (progress the wire there first)."""
        if len(self.flights) < self.places:
            flight.since_s = self.at
            self.flights.append(flight)
        else:
            self.queue.append(flight)
        self.version += 1

    def next_finish(self, speed: float) -> tuple[float, int] | None:
        """When the first of the flights finishes at ``speed`` as things stand, and which; None if none can."""
        best: tuple[float, int] | None = None
        for i, rate in enumerate(self.rates()):
            if rate * speed > 0:
                finish = self.at + max(0.0, self.flights[i].left_s) / (rate * speed)
                if best is None or finish < best[0]:
                    best = (finish, i)
        return best

    def finish(self, index: int) -> Flight:
        """Take flight ``index`` off the wire at ``at``; the next in the queue gets its place."""
        done = self.flights.pop(index)
        if self.queue:
            following = self.queue.popleft()
            following.since_s = self.at
            self.flights.append(following)
        self.version += 1
        return done

    def advance(self, t: float, speed: float = 1.0) -> None:
        """Run the wire to ``t`` at ``speed``: flights done by then leave it, each at its time."""
        while (upcoming := self.next_finish(speed)) is not None and upcoming[0] <= t:
            self.progress(upcoming[0], speed)
            self.finish(upcoming[1])
        self.progress(t, speed)

    def finish_times(self) -> dict[tuple[int, int], float]:
        """Run the wire at full speed until every flight on it and queued is done: when each finishes."""
        done = {}
        while (upcoming := self.next_finish(1.0)) is not None:
            self.progress(upcoming[0], 1.0)
            done[self.finish(upcoming[1]).key] = upcoming[0]
        return done

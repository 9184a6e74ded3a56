"""`Wire`: one link of the simulator and the collectives on it, the younger ones filling the older's gaps.

[Note: two collectives at once] gloo runs two collectives of a process group
at once (one per worker thread), and a ring all-reduce among many hosts leaves
the link idle for part of its time: between its 2 (N - 1) steps, each a hop's
latency, and while the hosts do their share of the work. A second collective
uses those gaps. At 8 emulated hosts on a 0.5 Gbit/s link
(`benchmarks/two_in_flight.py`: an all-reduce there is 14.5 ms of fixed cost
and 29.1 ms per MiB), until the younger of two issued together is done:

| older, younger         | measured | this model | one at a time |
|------------------------|----------|------------|---------------|
| 1 MiB, 1 MiB           | 61.5 ms  | 65.5 ms    | 87.3 ms       |
| 1.56 MiB, 1 MiB        | 76.9 ms  | 81.8 ms    | 103.6 ms      |
| 2.25 MiB, 1 MiB        | 97.7 ms  | 101.9 ms   | 123.7 ms      |
| 5.49 MiB, 1 MiB        | 198.0 ms | 196.2 ms   | 218.0 ms      |
| 9 MiB, 1 MiB           | 310.2 ms | 298.4 ms   | 320.2 ms      |
| 9 MiB, 64 KiB          | 237.6 ms | 34.6 ms    | 292.9 ms      |

Taking them one at a time, as the simulator once did, priced torch DDP with
1 MiB buckets on VGG16 and ResNet-50 at 8 hosts 8-37% too slow; a fixed share of overlap for every
pair cannot give both the first lines and the fifth. What this model misses
is the last line: a small collective right behind a large one waits for
most of it (presumably its messages queue on the same connections behind
the large one's), where the model lets it through in the large one's gaps; that is
why it prices GPT-2 (large layers, small ones between) too fast at 8 hosts.

The model: a collective of fixed cost ``F`` and wire time ``W`` alone
(``F + W`` in all) keeps the link busy a share ``u = W / (F + W)`` of its
time. The oldest on the wire runs at full rate; each younger one runs as fast
as the link's share left by the older ones allows, at most full rate: at rate
``min(1, left / u)``, leaving ``left - rate u`` to the next. A link that
runs one collective at a time (``in_flight`` 1: NCCL's one stream, a
parameter server's link) is the same model with one place; a collective that
is all wire (``F`` 0) leaves no gap, and one that is all fixed cost none to
fill. Every rate is also slowed while the worker computes
(``collective_slowdown``).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass


def wire_share(whole_s: float, fixed_s: float) -> float:
    """How much of its link a collective keeps busy alone: its wire time over its whole time
    (``whole_s``), the rest its fixed cost (``fixed_s``), the gaps another can use."""
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
        """Each flight's rate at full speed: the oldest 1, each younger what the older leave of the link."""
        rates, left = [], 1.0
        for flight in self.flights:
            rate = 1.0 if flight.share <= left else max(0.0, left) / flight.share
            rates.append(rate)
            left -= rate * flight.share
        return rates

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

    def when_done(self, key: tuple[int, int]) -> tuple[float, float]:
        """When flight ``key`` gets its place and when it finishes, at full speed. Exact however many are
        issued after it: a flight's rate depends only on the older ones."""
        ahead = Wire(self.places)
        ahead.at = self.at
        ahead.flights = [dataclasses.replace(flight) for flight in self.flights]
        for flight in self.queue:  # those behind it change nothing for it
            ahead.queue.append(dataclasses.replace(flight))
            if flight.key == key:
                break
        while True:
            upcoming = ahead.next_finish(1.0)
            assert upcoming is not None, f"{key} is not on this wire"
            ahead.progress(upcoming[0], 1.0)
            done = ahead.finish(upcoming[1])
            if done.key == key:
                return done.since_s, upcoming[0]

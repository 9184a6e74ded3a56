"""How busy the machine's cores were while a bench cell ran, and whether they set its pace.

Every emulated host of a cell is a process on this one machine, so with more hosts than
cores the computation and the network path (gloo's threads, the kernel's TCP, the bridge,
the shaper) queue for the same cores, and a cell measures the machine rather than its
links. `CpuSampler` reads ``/proc/stat`` in a background thread while the cell runs;
`cores_set_the_pace` says from its figures whether the cell is to be read that way.

    with CpuSampler() as sampler:
        run_the_cell()
    use = sampler.summary()   # None where /proc/stat cannot be read: the cell is then not marked
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

PROC_STAT = Path("/proc/stat")

SAMPLE_INTERVAL_S = 0.25
"""Long enough for a few jiffies per core (the kernel counts in 1/100 s), short enough for
a cell's phases (start-up, each system's turn) to show as many samples each."""

CORES_BUSY_THRESHOLD = 0.85
"""Median busy share of the cores at or above which the cores set a cell's pace.

Busy is everything but idle and iowait, so the kernel's network path (softirq, the veth
pairs, the shaper) counts. Where the links set the pace, every host spends part of each
iteration blocked on the wire with nothing to run, and that shows as idle time; below
0.85 at the median, more than half of the samples had at least 15% of the cores idle,
so a thread that became runnable usually found a core. At or above it the cores were
(nearly) saturated for most of the run, and a transfer's next step or a backward pass
waited for a core instead of a link. Not 1.0: even an oversubscribed machine shows some
idle per sample, in the hand-offs between processes that wait for one another."""


@dataclass(frozen=True)
class CpuUse:
    """The busy share of the cores over a run, one sample per `SAMPLE_INTERVAL_S`."""

    median: float
    """Median over the samples of busy time / all time of the cores (0 to 1)."""
    p90: float
    """90th percentile of the same."""
    cores: int
    """The cores this process may run on (its affinity), which the hosts share."""
    samples: int
    cores_set_the_pace: bool
    """`cores_set_the_pace` of ``median``."""


def cores_set_the_pace(median_busy: float | None, threshold: float = CORES_BUSY_THRESHOLD) -> bool:
    """Whether a cell whose cores were ``median_busy`` busy (median share, 0 to 1) measured the
    cores rather than the links; False where it was not measured (None)."""
    return median_busy is not None and median_busy >= threshold


def usable_cpus() -> set[int] | None:
    """The CPUs this process may run on (its children inherit them); None where the platform
    does not say, and then every CPU counts."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return None


def read_cpu_times(path: Path = PROC_STAT, cpus: set[int] | None = None) -> tuple[int, int] | None:
    """(busy, total) jiffies since boot, summed over ``cpus`` (every CPU where None, or where
    ``/proc/stat`` lacks one of them); None where ``path`` cannot be read.

    Only the first eight fields add up to the total: guest time is already in user time.
    """
    try:
        text = path.read_text()
    except OSError:
        return None
    every, per_cpu = None, {}
    for line in text.splitlines():
        name, *fields = line.split() or [""]
        if not name.startswith("cpu") or len(fields) < 4:
            continue
        values = [int(v) for v in fields[:8]]
        times = (sum(values) - values[3] - (values[4] if len(values) > 4 else 0), sum(values))
        if name == "cpu":
            every = times
        elif name[3:].isdigit():
            per_cpu[int(name[3:])] = times
    if cpus and cpus <= per_cpu.keys():
        return sum(per_cpu[c][0] for c in cpus), sum(per_cpu[c][1] for c in cpus)
    return every


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``values``, interpolated between the nearest two."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


class CpuSampler:
    """Samples the busy share of this process's cores every ``interval_s`` in a daemon thread,
    from entering the ``with`` block to leaving it."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S, path: Path = PROC_STAT) -> None:
        self.interval_s = interval_s
        self.path = path
        cpus = usable_cpus()
        self.cpus = cpus
        self.cores = len(cpus) if cpus else (os.cpu_count() or 1)
        self.shares: list[float] = []
        self._last: tuple[int, int] | None = None
        self._last_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        now, at = read_cpu_times(self.path, self.cpus), time.monotonic()
        if now is None or self._last is None:
            return
        busy, total = now[0] - self._last[0], now[1] - self._last[1]
        if total > 0:  # no jiffy counted since the last read: nothing to say
            self.shares.append(min(max(busy / total, 0.0), 1.0))
            self._last, self._last_at = now, at

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> CpuSampler:
        self._last, self._last_at = read_cpu_times(self.path, self.cpus), time.monotonic()
        if self._last is not None:
            self._thread = threading.Thread(target=self._loop, name="commsched-cpu-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if time.monotonic() - self._last_at >= self.interval_s / 2:  # the run's tail, if long enough to count
                self._sample()

    def summary(self) -> CpuUse | None:
        """The run's figures; None where ``/proc/stat`` could not be read or no sample was taken."""
        if not self.shares:
            return None
        median = statistics.median(self.shares)
        return CpuUse(median=median, p90=percentile(self.shares, 0.9), cores=self.cores,
                      samples=len(self.shares), cores_set_the_pace=cores_set_the_pace(median))

"""Medians over fresh repeats and the ratios between systems, as the benchmarks' tables give them.

A comparison that one run cannot settle is measured in several fresh process groups or clusters
(repeats). In each, every system's figure is its median iteration; a table gives the median over
repeats of those, and a ratio between two systems is taken within each repeat first (they ran side
by side, under the same load) and then its median over repeats.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Repeat:
    """One fresh group's or cluster's median iteration (seconds), by system name."""

    medians_s: Mapping[str, float]

    @classmethod
    def of(cls, times_s: Mapping[str, Sequence[float]]) -> Repeat:
        """From every measured iteration time of each system."""
        return cls({name: statistics.median(times) for name, times in times_s.items()})

    def fastest(self, names: Iterable[str]) -> str:
        """The fastest of ``names`` in this repeat (best DDP: the fastest of a bucket-size sweep)."""
        return min(names, key=self.medians_s.__getitem__)

    def ratio(self, system: str, against: str | Sequence[str]) -> float:
        """``system``'s time over ``against``'s; several names: over the fastest of them here."""
        other = against if isinstance(against, str) else self.fastest(against)
        return self.medians_s[system] / self.medians_s[other]


def median_s(repeats: Sequence[Repeat], name: str) -> float:
    """The median over repeats of ``name``'s median iteration."""
    return statistics.median(r.medians_s[name] for r in repeats)


def ratios(repeats: Sequence[Repeat], system: str, against: str | Sequence[str]) -> list[float]:
    """`Repeat.ratio` in each repeat."""
    return [r.ratio(system, against) for r in repeats]


def median_and_each(values: Sequence[float], spec: str = ".3f", sep: str = " ") -> str:
    """``0.800 (0.990 0.800 0.500)``: the median, then every value, so one repeat's outlier shows."""
    return f"{statistics.median(values):{spec}} ({sep.join(format(v, spec) for v in values)})"


def ms_cell(repeats: Sequence[Repeat], name: str) -> str:
    """``name``'s median over repeats in ms, for a table."""
    return f"{median_s(repeats, name) * 1e3:.1f}"


def fastest_cell(repeats: Sequence[Repeat], names: Sequence[str], label: Callable[[str], str] = str) -> str:
    """``100.0 (5 25 100)``: the median over repeats of the fastest of ``names`` in each, in ms, and
    which one that was per repeat (``label`` shortens a name)."""
    best = statistics.median(r.medians_s[r.fastest(names)] for r in repeats) * 1e3
    return f"{best:.1f} ({' '.join(label(r.fastest(names)) for r in repeats)})"


def ratio_cell(repeats: Sequence[Repeat], system: str, against: str | Sequence[str]) -> str:
    """`ratios` as `median_and_each`."""
    return median_and_each(ratios(repeats, system, against))

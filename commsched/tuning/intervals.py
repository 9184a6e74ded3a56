"""Rank 0's measured iteration times between switch points, for the auto-tuner and the check of the
cost model's choice alike."""

from __future__ import annotations


class IterationIntervals:
    """Intervals from one synchronised pass's start to the next one's, except those starting before
    `measure_from` (the first iteration on a new layout pays for it) or spanning a pass not seen."""

    def __init__(self) -> None:
        self._last: tuple[int, float] | None = None
        self.measure_from = 0
        self._samples: list[float] = []

    def pass_started(self, iteration: int, now_s: float) -> None:
        """A synchronised pass begins (every one, on rank 0): the interval since the last one ends."""
        last = self._last
        if last is not None and iteration == last[0] + 1 and last[0] >= self.measure_from:
            self._samples.append(now_s - last[1])
        self._last = (iteration, now_s)

    def take(self) -> list[float]:
        """The intervals measured since the last call."""
        samples, self._samples = self._samples, []
        return samples

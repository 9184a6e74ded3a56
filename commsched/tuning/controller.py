"""Rank 0's auto-tuner: it measures iteration times, runs the studies and decides at switch points.

See [Note: auto-tuning] and [Note: drift] in `commsched.tuning`."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from commsched.layout.setting import LayoutSetting
from commsched.strategy import Strategy
from commsched.tuning.decision import Decision, Phase
from commsched.tuning.intervals import IterationIntervals
from commsched.tuning.space import SearchSpace
from commsched.tuning.study import STARTUP_TRIALS, Study, Trial

SETTLE_ITERATIONS = 1
"""Iterations not measured after a change of setting: the first pays for the new layout and plan."""


DRIFT_WINDOW = 10
"""Iterations per drift check once tuned (one small broadcast each)."""


DRIFT_THRESHOLD = 0.2
"""Re-tune when a window's median iteration time differs from the tuned baseline by more than this share."""


MAX_RETUNE_ITERATIONS = 100
"""A re-tune's budget: ``Strategy.autotune_iterations``, at most this many iterations."""


CONFIRM_BEST = 2
"""After the search, its fastest this many settings are measured once more, and the fastest on
that second measurement is adopted: the fastest of a dozen noisy measurements owes part of its
lead to its noise (a setting measured 8% fast in a trial of 3 iterations ran at the others'
speed after); a measurement it was not chosen on does not."""


@dataclass(frozen=True)
class TuningConfig:
    budget_iterations: int
    trial_iterations: int
    seed: int

    @classmethod
    def of(cls, strategy: Strategy) -> TuningConfig:
        return cls(strategy.autotune_iterations, strategy.autotune_trial_iterations, strategy.autotune_seed)

    def trials(self, budget_iterations: int) -> int:
        return max(2, budget_iterations // (SETTLE_ITERATIONS + self.trial_iterations))


class Controller:
    """Rank 0's side: measures iteration times, runs the studies, decides at switch points."""

    def __init__(self, space: SearchSpace, start: LayoutSetting, config: TuningConfig,
                 guesses: Sequence[LayoutSetting] = ()):
        self.space, self.config = space, config
        self._start = start
        self._guesses = tuple(guesses)
        """Measured right after ``start`` in the first study (`simulated_guesses`)."""
        self._current = start
        self._phase = Phase.TUNING
        self._studies = 0
        self._study: Study | None = None
        self._trials_expected = 0
        self._baseline_s: float | None = None
        self._intervals = IterationIntervals()
        self._first = True

    def pass_started(self, iteration: int, now_s: float) -> None:
        """A synchronised pass begins (every one, on rank 0): the interval since the last one ends."""
        self._intervals.pass_started(iteration, now_s)

    def decide(self, iteration: int) -> Decision:
        """At a switch point, after `pass_started` for it."""
        samples = self._intervals.take()
        measured = statistics.median(samples) if samples else None
        previous = self._current
        if self._phase is Phase.TUNED:
            decision = self._steady(measured)
        elif self._study is None:
            decision = self._start_study(Phase.TUNING, self._start, first_measurement=None)
        else:
            decision = self._next_trial(measured)
        self._current = decision.setting
        # The first switch point follows the end of warm-up, which laid out and planned anew.
        changed = decision.setting != previous or self._first
        self._first = False
        self._intervals.measure_from = iteration + (SETTLE_ITERATIONS if changed else 0)
        return decision

    def stop(self) -> Decision:
        """Tuning failed: keep the setting in use, no more switch points."""
        self._phase = Phase.STOPPED
        return Decision(Phase.STOPPED, self._current, 0)

    def _start_study(self, phase: Phase, seed_setting: LayoutSetting, first_measurement: float | None) -> Decision:
        config = self.config
        budget = config.budget_iterations if self._studies == 0 else min(config.budget_iterations,
                                                                          MAX_RETUNE_ITERATIONS)
        self._trials_expected = config.trials(budget)
        self._confirm = min(CONFIRM_BEST, max(0, self._trials_expected - 2))
        self._finalists: list[LayoutSetting] | None = None
        self._confirmed: list[Trial] = []
        self._study = Study(self.space, seed_setting, config.seed + self._studies,
                            startup_trials=STARTUP_TRIALS, then=self._guesses if self._studies == 0 else (self._start, *self._guesses))
        self._studies += 1
        self._phase = phase
        first = self._study.ask()
        if first_measurement is None:
            return self._trial_decision(first, ended_ms=None)
        return self._next_trial(first_measurement)

    def _next_trial(self, measured: float | None) -> Decision:
        study = self._study
        if measured is None:  # nothing measured (a trial of zero intervals): count it as no information
            measured = math.inf
        ended_ms = measured * 1e3
        if self._finalists is None:
            study.tell(measured)
            searching = len(study.trials) < self._trials_expected - self._confirm
            following = study.ask() if searching else None
            if following is not None:
                return self._trial_decision(following, ended_ms)
            self._finalists = self._best_settings(self._confirm)
        else:
            self._confirmed.append(Trial(self._current, measured))
        if self._finalists:
            return self._trial_decision(self._finalists.pop(0), ended_ms)
        # Chosen on one measurement, compared on another: the second carries no selection bias.
        confirmed = [t for t in self._confirmed if math.isfinite(t.median_s)]
        best = min(confirmed, key=lambda t: t.median_s) if confirmed else study.best
        self._phase = Phase.TUNED
        self._baseline_s = None
        return Decision(Phase.TUNED, best.setting, DRIFT_WINDOW + SETTLE_ITERATIONS, ended_ms=ended_ms,
                        trials=len(study.trials) + len(self._confirmed))

    def _best_settings(self, count: int) -> list[LayoutSetting]:
        """The ``count`` fastest settings the search measured (see `CONFIRM_BEST`)."""
        finite = sorted((t for t in self._study.trials if math.isfinite(t.median_s)), key=lambda t: t.median_s)
        return [t.setting for t in finite[:count]]

    def _trial_decision(self, setting: LayoutSetting, ended_ms: float | None) -> Decision:
        measured = len(self._study.trials) + len(self._confirmed)
        return Decision(self._phase, setting, SETTLE_ITERATIONS + self.config.trial_iterations,
                        trial=measured + 1, trials=self._trials_expected, ended_ms=ended_ms)

    def _steady(self, measured: float | None) -> Decision:
        if measured is None:
            return Decision(Phase.TUNED, self._current, DRIFT_WINDOW)
        if self._baseline_s is None:
            self._baseline_s = measured
            return Decision(Phase.TUNED, self._current, DRIFT_WINDOW, window_ms=measured * 1e3,
                            baseline_ms=measured * 1e3)
        baseline = self._baseline_s
        if abs(measured / baseline - 1.0) <= DRIFT_THRESHOLD:
            return Decision(Phase.TUNED, self._current, DRIFT_WINDOW, window_ms=measured * 1e3,
                            baseline_ms=baseline * 1e3)
        decision = self._start_study(Phase.RETUNING, self._current, first_measurement=measured)
        return dataclasses.replace(decision, window_ms=measured * 1e3, baseline_ms=baseline * 1e3)

"""Rank 0's check of the cost model's choice on measured iterations, against the configured buckets sent whole.

[Note: confirming the choice] The cost model predicts from one warm-up
timeline and a link measured idle. Partitions pay only where it predicts
right: each is one more collective, and at many hosts each collective costs
a latency per hop of the ring, which an all-reduce timed among two sizes on
an idle link may understate several times over (at 8 hosts on a 600 Mbit/s
link, 4 MiB partitions were predicted to leave 35 ms of waiting and left 92,
for an iteration 28% slower than torch DDP's). A wrong choice must never
last: so when the cost model chooses partitions (or larger buckets), the
first iterations after warm-up measure them against the configured buckets
sent whole, as torch DDP sends its own, interleaved (`ROUNDS` rounds of
each, `TRIAL_ITERATIONS` measured iterations per trial after one to settle
on the new layout). Of the settings faster than whole buckets in every round
(`faster_in_every_round`: a slow spell of the hosts that falls on one trial
must not decide for good; on a saturated machine, 16 emulated hosts on 2
cores, iterations of one setting spread by half their length), the fastest
by median iteration stays if it is shorter by more than the margin
(`measured_choice` in `commsched.planning.cost_model`); otherwise whole
buckets stay: they issue the fewest collectives at the configured size, as
torch DDP does, and a tie going to them makes the same cell choose the same
way run after run. Where others measured within that margin of the fastest,
the one of fewest collectives stays instead (`fewer_collectives_first`,
there), for the same reason: at 8 emulated hosts on VGG16 whole 5 MiB
buckets and 4 MiB partitions measure within 2% of each other, and without
that rule one cell kept the buckets on one cluster and the partitions on the
next (docs/records/2026-11-27-simulated-best-schedule-at-eight-hosts.md).

Measured beside the choice: its runner-up, the cheapest prediction of
partitions other than the choice, so that partitions are measured whichever
way the cost model ranks them (at 4 emulated hosts on VGG16, a prediction
that put 0.5 MiB partitions behind two whole bucket sizes kept them from
being measured: 1.00x the best DDP, against 1.15x in the runs that measured
them); and the cheapest prediction of whole buckets of a size of their own
(the bucket size torch DDP's users would find by sweeping), since the error
grows with the number of collectives: at 8 emulated hosts whole 1 MiB
buckets, predicted to leave 3-4 ms of waiting, left 35-51
(docs/records/2026-11-27-whole-buckets-beside-the-choice.md).

The margin is what the run's own iterations say a repeat could change
(`confirmation_margin`): `STANDARD_ERRORS` standard errors of the difference
between two settings' medians, from how far each setting's iterations fall from
its median (the widest of the settings), at least `MIN_CONFIRMATION_MARGIN` and
at most `MAX_CONFIRMATION_MARGIN`. On the emulated hosts, whose iterations
spread by a percent or more, it is mostly the largest, 3.0% in 7 of 9 cells
(docs/records/2026-11-28-two-to-sixteen-hosts.md); on a quiet cluster, whose
iterations agree within a few tenths of a percent, whole 100 MiB buckets 2-3%
faster than the configured 25 MiB (512-1024 workers on a slow link, in the
simulator) are kept, as the best torch DDP is tuned.

The trials run on the auto-tuner's switch points (`commsched.engine.tuning`):
rank 0 measures and decides, every rank applies the same decision.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from commsched.layout.setting import LayoutSetting
from commsched.planning.cost_model import MAX_CONFIRMATION_MARGIN, MIN_CONFIRMATION_MARGIN, Setting, measured_choice
from commsched.tuning.controller import SETTLE_ITERATIONS
from commsched.tuning.decision import Decision, Phase
from commsched.tuning.intervals import IterationIntervals
from commsched.tuning.log import TuningLog

ROUNDS = 2
"""Trials of each setting, interleaved: a slow spell of the hosts falls on all alike."""

TRIAL_ITERATIONS = 3
"""Measured iterations per trial (after `SETTLE_ITERATIONS`)."""

STANDARD_ERRORS = 4.0
"""The margin, in standard errors of the difference between two settings' medians: at that distance
noise alone flips a verdict in far fewer than one run in a thousand."""

MAX_SETTINGS = 4
"""The cost model's choice, its runner-up, its best whole buckets and the configured buckets sent whole."""

LENGTH = MAX_SETTINGS * ROUNDS * (SETTLE_ITERATIONS + TRIAL_ITERATIONS)
"""Most iterations from the end of warm-up to the verdict."""


class Confirmation:
    """Rank 0's side, in the shape of `commsched.tuning.controller.Controller`: trials of the cost
    model's choice, of those measured ``beside`` it (its runner-up, its best whole buckets), and of
    ``whole`` (the configured buckets, sent whole), interleaved; then the fastest for good."""

    def __init__(self, chosen: LayoutSetting, whole: LayoutSetting, beside: Sequence[LayoutSetting] = (),
                 rounds: int = ROUNDS, trial_iterations: int = TRIAL_ITERATIONS):
        if chosen == whole:
            raise ValueError("there is nothing to confirm: the cost model chose the configured buckets, whole")
        self.candidates = [chosen]
        for setting in beside:
            if setting not in (*self.candidates, whole):
                self.candidates.append(setting)
        if len(self.candidates) + 1 > MAX_SETTINGS:
            raise ValueError(f"at most {MAX_SETTINGS} settings are measured, whole buckets included")
        self.whole = whole
        self._trials = [*self.candidates, whole] * rounds
        self._trial_iterations = trial_iterations
        self._next = 0
        self._samples: dict[LayoutSetting, list[float]] = {s: [] for s in (*self.candidates, whole)}
        self._trial_medians: dict[LayoutSetting, list[float]] = {s: [] for s in self._samples}
        """Per setting, the median of each of its trials, one per round."""
        self._intervals = IterationIntervals()
        self._current: LayoutSetting | None = None

    def pass_started(self, iteration: int, now_s: float) -> None:
        """A synchronised pass begins (every one, on rank 0): the interval since the last one ends."""
        self._intervals.pass_started(iteration, now_s)

    def decide(self, iteration: int) -> Decision:
        """At a switch point, after `pass_started` for it: the next trial, or the verdict."""
        ended_ms, measured = None, self._intervals.take()
        if self._current is not None:
            self._samples[self._current] += measured
            ended_ms = _median_ms(measured)
            if ended_ms is not None:
                self._trial_medians[self._current].append(ended_ms)
        self._intervals.measure_from = iteration + SETTLE_ITERATIONS
        if self._next < len(self._trials):
            self._current = self._trials[self._next]
            self._next += 1
            return Decision(Phase.TUNING, self._current, SETTLE_ITERATIONS + self._trial_iterations,
                            trial=self._next, trials=len(self._trials), ended_ms=ended_ms)
        margin = confirmation_margin(self._samples)
        self._current = self.verdict(margin)
        fastest_ms = min((m for m in (_median_ms(self._samples[s]) for s in self.candidates) if m is not None),
                         default=None)
        return Decision(Phase.TUNED, self._current, 0, ended_ms=ended_ms, trials=len(self._trials),
                        window_ms=fastest_ms, baseline_ms=_median_ms(self._samples[self.whole]), margin=margin)

    def verdict(self, margin: float) -> LayoutSetting:
        """Of the candidates faster than ``whole`` in every round, the fastest by median iteration if it
        beats ``whole`` by ``margin`` (`confirmation_margin` of these trials), else ``whole``; of
        candidates within that margin of the fastest, the one of fewest collectives (`measured_choice`)."""
        medians = {s: statistics.median(t) for s, t in self._samples.items() if t}
        return measured_choice(consistent(medians, self._trial_medians, self.whole), self.whole, margin, _itself)

    def stop(self) -> Decision:
        """Something failed on rank 0: whole buckets, the cautious setting, and no more switch points."""
        return Decision(Phase.STOPPED, self.whole, 0)


def confirmation_margin(samples_s: Mapping[LayoutSetting, Sequence[float]]) -> float:
    """How much shorter, as a fraction, one setting's median must be to replace another's:
    `STANDARD_ERRORS` standard errors of the difference between two medians of as many iterations as
    the fewest measured (``samples_s``: per setting, its measured iterations), each setting's spread
    taken robustly (the median distance from its median) and the widest one counting; from
    `MIN_CONFIRMATION_MARGIN` to `MAX_CONFIRMATION_MARGIN`, the most where too little was measured."""
    measured = [times for times in samples_s.values() if len(times) >= 2]
    if len(measured) < 2:
        return MAX_CONFIRMATION_MARGIN
    widest = max(_relative_spread(times) for times in measured)
    fewest = min(len(times) for times in measured)
    # The median of n samples varies about 1.25 times as much as their mean; the difference of two, sqrt(2) times.
    margin = STANDARD_ERRORS * 1.2533 * widest * math.sqrt(2 / fewest)
    return min(MAX_CONFIRMATION_MARGIN, max(MIN_CONFIRMATION_MARGIN, margin))


def _relative_spread(times: Sequence[float]) -> float:
    """A robust standard deviation of ``times`` over their median: 1.4826 times the median distance
    from the median (a normal distribution's standard deviation, unmoved by one slow iteration)."""
    middle = statistics.median(times)
    return 1.4826 * statistics.median(abs(t - middle) for t in times) / middle


def faster_in_every_round(trial_ms: Mapping[LayoutSetting, Sequence[float]], setting: LayoutSetting,
                          whole: LayoutSetting) -> bool:
    """Whether each trial of ``setting`` was shorter than ``whole``'s of the same round (the
    trials of each setting, in order: one per round)."""
    ours, theirs = trial_ms.get(setting, ()), trial_ms.get(whole, ())
    return bool(ours) and len(ours) == len(theirs) and all(a < b for a, b in zip(ours, theirs))


def consistent(medians: Mapping[LayoutSetting, float], trial_ms: Mapping[LayoutSetting, Sequence[float]],
               whole: LayoutSetting) -> dict[LayoutSetting, float]:
    """``medians`` of ``whole`` and of the settings faster than it in every round."""
    return {s: ms for s, ms in medians.items() if s == whole or faster_in_every_round(trial_ms, s, whole)}


def _itself(setting: LayoutSetting) -> LayoutSetting:
    """The layout of a setting the check measures: the setting itself (`measured_choice`'s ``layout_of``)."""
    return setting


def whole_buckets(setting: LayoutSetting) -> LayoutSetting:
    """``setting`` without partitions or credit window (its buckets, sent whole)."""
    return setting.with_partitioning(None, None)


def _median_ms(seconds: list[float]) -> float | None:
    return statistics.median(seconds) * 1e3 if seconds else None


def describe(log: TuningLog, chosen: LayoutSetting, whole: LayoutSetting) -> str:
    """Why the setting in use is the one in use (``chosen``: the cost model's; ``whole``: the configured
    buckets sent whole), from ``log``."""
    partitions = describe_choice(chosen)
    if log.phase is Phase.TUNING:
        return (f"the cost model chose {partitions}; measuring it against the configured buckets sent whole "
                f"(trial {log.trial} of {log.trials})")
    if log.phase is Phase.STOPPED:
        return (f"the cost model chose {partitions}; its check against the configured buckets stopped after an "
                "error on rank 0 (see its log), and they stay, sent whole")
    trials: dict[LayoutSetting, list[float]] = {}
    for trial in (log.studies[-1] if log.studies else []):
        trials.setdefault(trial.setting, []).append(trial.median_s * 1e3)
    medians = {s: statistics.median(ms) for s, ms in trials.items()}
    margin = MAX_CONFIRMATION_MARGIN if log.margin is None else log.margin
    overall = measured_choice(medians, whole, margin)
    fastest = measured_choice(consistent(medians, trials, whole), whole, margin)
    measured = "; ".join(f"{describe_choice(setting)}: {ms:.2f} ms ({_rounds(trials[setting])})"
                         for setting, ms in medians.items())

    def ms(value: float | None) -> str:
        return "not measured" if value is None else f"{value:.2f} ms"

    noisy = "not faster than the configured buckets sent whole in every round (too noisy to tell apart)"
    if log.current == whole:
        verdict = (f"{noisy}, which stay" if overall != whole else
                   "measured no faster than the configured buckets sent whole, which stay")
    elif log.current != fastest:
        kept = "kept" if log.current == chosen else f"but {describe_choice(log.current)}, measured beside it, is kept"
        verdict = (f"{kept} (within {margin:.1%} of the fastest, {describe_choice(fastest)}, and with "
                   "fewer collectives)")
    elif log.current == chosen:
        verdict = "kept"
    elif overall == chosen:
        verdict = f"{noisy}; {describe_choice(log.current)}, measured beside it, was, and is kept"
    else:
        verdict = f"measured slower than {describe_choice(log.current)}, measured beside it, which is kept"
    return (f"the cost model chose {partitions}, {verdict}: median iteration {ms(log.window_ms)} at best against "
            f"{ms(log.baseline_ms)} with the configured buckets whole (per setting, and per round: {measured}; "
            f"a margin of {margin:.1%}, from how much iterations of one setting spread)")


def _rounds(trial_ms: Sequence[float]) -> str:
    return ", ".join(f"{ms:.1f}" for ms in trial_ms)


def describe_choice(chosen: LayoutSetting) -> str:
    """``partitions of 1 MiB, credit 4 MiB``, ``whole buckets of 100 MiB, the first too`` or
    ``whole buckets of 25 MiB, the first 1 MiB``."""
    return Setting.of(chosen).describe()

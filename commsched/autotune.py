"""The auto-tuner: which layout is fastest, found on measured iteration times of the real run.

Pure logic, no process group: rank 0's `Controller` measures and decides, every
rank applies the broadcast `Decision` to its `TuningLog` (the reducer does the
broadcast and the switch, `commsched.reducer`).

[Note: auto-tuning] The cost model predicts; the run measures. With
``Strategy(autotune=True)``, after warm-up the run itself is the objective: a
*setting* (partition size, credit window, bucket caps, first bucket, forward
overlap) is tried for a few iterations, its median iteration time (from the
start of one synchronised backward pass to the next) is what it costs, and a
Bayesian optimiser (optuna's TPE sampler, seeded, ask/tell) proposes the next
setting to try from what it has seen. The first trial is the cost model's
choice, so a tuned run is never worse than what warm-up alone gives but for
the iterations spent measuring; the next few are the settings the simulator
(`commsched.simulator`) predicts fastest on the warm-up's timeline, so the
measurements start where the optimum most likely is. After ``autotune_iterations``
iterations the fastest settings are measured once more (`CONFIRM_BEST`) and the
fastest on that second measurement is adopted.

The protocol: settings change only at *switch points*, the start of a
synchronised backward pass whose number every rank knows (each `Decision`
says how many iterations away the next one is). There, rank 0 decides and
broadcasts; every rank lays out the new setting before that pass's state
exists; the iteration after a change is not measured (it pays for the new
layout, the new plan and the optimiser's state in new buckets).

[Note: drift] Once tuned, a window of `DRIFT_WINDOW` iterations is measured
between switch points; the first window after the best setting is adopted is
the baseline. If a later window's median differs from it by more than
`DRIFT_THRESHOLD`, up or down, a new study starts, seeded with the setting in
use (its window is its first measurement), then the first study's starting
point and the simulator's guesses again (on the old timeline, but reasonable
candidates on any link; a re-tune after a link change that measured only the
optimiser's proposals settled 12% above the new rate's best). Up: the link got slower or the
host busier, and finer partitions may now pay. Down too: a much faster link
(or less contention) moves the optimum towards fewer, larger collectives, and
the baseline no longer says what the setting costs. Noise within the threshold
never re-tunes: a median over a window ignores a few slow iterations (a
checkpoint, an evaluation).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from commsched.cost_model import Setting, Timeline
from commsched.profile import LinkProfile, ParameterProfile, Profile
from commsched.strategy import MAX_SIZE_MB, MIB, MIN_BUCKET_MB, MIN_PARTITION_MB, Strategy, require_optuna

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

MAX_REPEATS = 64
"""How many times in a row the optimiser may propose a setting already measured (whose
measurement is reused) before the study is taken as exhausted."""

STARTUP_TRIALS = 3
"""Trials before the optimiser models the objective (the start and two random ones): few, since a
search has only tens of iterations."""

CREDIT_RATIOS = (1.0, 2.0, 4.0, 8.0, None)
"""The credit window as a multiple of the unit on the wire (None: unbounded)."""


@dataclass(frozen=True)
class TunedSetting:
    """Everything the auto-tuner changes: a `Strategy`'s layout fields and forward overlap."""

    partition_mb: float | None
    credit_mb: float | None
    bucket_cap_mb: float
    first_bucket_mb: float
    overlap_forward: bool

    @classmethod
    def of(cls, strategy: Strategy) -> TunedSetting:
        return cls(strategy.partition_mb, strategy.credit_mb, strategy.bucket_cap_mb, strategy.first_bucket_mb,
                   strategy.overlap_forward)

    def applied(self, strategy: Strategy) -> Strategy:
        """``strategy`` with this setting (validated by `Strategy` as any other)."""
        return dataclasses.replace(
            strategy, partition_mb=self.partition_mb, credit_mb=self.credit_mb, bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=self.first_bucket_mb, overlap_forward=self.overlap_forward,
        )

    def layout(self, strategy: Strategy) -> tuple[object, ...]:
        """What the buckets, partitions and plan depend on: bucket limits, partition and credit bytes."""
        applied = self.applied(strategy)
        return tuple(applied.bucket_size_limits_bytes), applied.partition_bytes, applied.credit_bytes

    def behaviour(self, strategy: Strategy) -> tuple[object, ...]:
        """What the run depends on: two settings with the same behaviour run identically
        (a bucket cap above the partition size, say, changes nothing)."""
        return (*self.layout(strategy), self.overlap_forward)

    def describe(self) -> str:
        wire = "whole buckets" if self.partition_mb is None else f"partitions of {self.partition_mb:g} MiB"
        credit = "no credit window" if self.credit_mb is None else f"credit {self.credit_mb:g} MiB"
        return (f"{wire}, {credit}, buckets of {self.bucket_cap_mb:g} MiB (first {self.first_bucket_mb:g} MiB), "
                f"overlap {'on' if self.overlap_forward else 'off'}")

    def encode(self) -> list[float]:
        """Five floats for a broadcast; `decode` is exact (float64 carries every value)."""
        return [_none_as(self.partition_mb), _none_as(self.credit_mb), self.bucket_cap_mb, self.first_bucket_mb,
                1.0 if self.overlap_forward else 0.0]

    @classmethod
    def decode(cls, values: Sequence[float]) -> TunedSetting:
        partition, credit, cap, first, overlap = (float(v) for v in values)
        return cls(_as_none(partition), _as_none(credit), cap, first, overlap > 0.5)


def _none_as(value: float | None) -> float:
    return -1.0 if value is None else float(value)


def _as_none(value: float) -> float | None:
    return None if value < 0 else value


# ------------------------------------------------------------------ the space
@dataclass(frozen=True)
class SearchSpace:
    """The settings the tuner may try: each dimension an ordered list of values.

    Sizes are powers of two spaced by four around the model's gradient bytes,
    with the starting setting's own values added, so the start is a point of the
    space. Ordered, so the optimiser learns "larger is better" from neighbours.
    """

    partition_mb: tuple[float | None, ...]
    """Ascending; None (whole buckets, the largest unit) last."""
    credit_ratio: tuple[float | None, ...]
    """The credit window in units on the wire (the partition, or the bucket cap for whole
    buckets); None (unbounded) last."""
    bucket_cap_mb: tuple[float, ...]
    first_bucket_mb: tuple[float, ...]
    overlap_forward: tuple[bool, ...]

    DIMENSIONS = ("partition_mb", "credit_ratio", "bucket_cap_mb", "first_bucket_mb", "overlap_forward")

    @classmethod
    def around(cls, gradient_bytes: int, start: TunedSetting, overlap_allowed: bool) -> SearchSpace:
        """The space for a model of ``gradient_bytes`` gradient bytes, holding ``start``.

        ``overlap_allowed``: forward overlap may be switched on (the strategy asks
        for it and nothing blocked it during warm-up); otherwise it stays off.
        """
        total_mb = max(gradient_bytes / MIB, MIN_PARTITION_MB)
        partitions = _powers(total_mb / 512, total_mb / 2, MIN_PARTITION_MB)
        caps = _powers(total_mb / 64, total_mb, MIN_BUCKET_MB)
        firsts = _powers(total_mb / 256, total_mb / 4, MIN_BUCKET_MB)
        partition_values: list[float | None] = sorted(set(partitions) | _present(start.partition_mb)) + [None]
        ratio = _credit_ratio(start)
        ratios: list[float | None] = sorted({r for r in CREDIT_RATIOS if r is not None} | _present(ratio)) + [None]
        overlap = (True, False) if overlap_allowed else (False,)
        return cls(
            tuple(partition_values), tuple(ratios),
            tuple(sorted(set(caps) | {start.bucket_cap_mb})), tuple(sorted(set(firsts) | {start.first_bucket_mb})),
            overlap,
        )

    def setting(self, indices: dict[str, int]) -> TunedSetting:
        """The setting at ``indices`` (one per dimension)."""
        partition = self.partition_mb[indices["partition_mb"]]
        cap = self.bucket_cap_mb[indices["bucket_cap_mb"]]
        ratio = self.credit_ratio[indices["credit_ratio"]]
        unit = cap if partition is None else partition
        credit = None if ratio is None else min(MAX_SIZE_MB, max(MIN_PARTITION_MB, unit * ratio))
        return TunedSetting(partition, credit, cap, self.first_bucket_mb[indices["first_bucket_mb"]],
                            self.overlap_forward[indices["overlap_forward"]])

    def indices(self, setting: TunedSetting) -> dict[str, int]:
        """The indices of ``setting``, which must be a point of the space."""
        return {
            "partition_mb": self.partition_mb.index(setting.partition_mb),
            "credit_ratio": self.credit_ratio.index(_credit_ratio(setting)),
            "bucket_cap_mb": self.bucket_cap_mb.index(setting.bucket_cap_mb),
            "first_bucket_mb": self.first_bucket_mb.index(setting.first_bucket_mb),
            "overlap_forward": self.overlap_forward.index(setting.overlap_forward),
        }

    def sizes(self) -> dict[str, int]:
        return {name: len(getattr(self, name)) for name in self.DIMENSIONS}

    def grid(self) -> Iterator[TunedSetting]:
        """Every point of the space (for an exhaustive comparison)."""
        sizes = self.sizes()
        total = math.prod(sizes.values())
        for flat in range(total):
            indices = {}
            for name in self.DIMENSIONS:
                flat, indices[name] = divmod(flat, sizes[name])
            yield self.setting(indices)


def _powers(low: float, high: float, floor: float) -> set[float]:
    """Powers of two from about ``low`` to ``high``, spaced by four, none below ``floor``."""
    exponent = round(math.log2(max(low, floor)))
    values = set()
    while True:
        value = max(floor, min(MAX_SIZE_MB, 2.0**exponent))
        values.add(value)
        if value >= high or value >= MAX_SIZE_MB:
            return values
        exponent += 2


def _present(value: float | None) -> set[float]:
    return set() if value is None else {value}


def _credit_ratio(setting: TunedSetting) -> float | None:
    if setting.credit_mb is None:
        return None
    unit = setting.bucket_cap_mb if setting.partition_mb is None else setting.partition_mb
    return setting.credit_mb / unit


# ------------------------------------------------------------ starting point
@dataclass(frozen=True)
class Warmup:
    """What warm-up gave rank 0: its timeline and the cost model's choice."""

    strategy: Strategy
    timeline: Timeline | None
    """Rank 0's measured timeline and link (None when the cost model did not run)."""
    choice: Setting | None
    """The cost model's partitioning (None: the configured one)."""
    overlap_allowed: bool
    parameters: tuple[tuple[int, int], ...] = ()
    """Per slot: the gradient's elements and bytes per element (for the simulator)."""
    forward_order: tuple[int, ...] = ()
    """Slots in the order the forward pass first reads them."""
    world_size: int = 1


def starting_point(warmup: Warmup) -> TunedSetting:
    """The first trial: the cost model's choice, with the configured bucket caps.

    The hook for a better first guess: a function of the warm-up timeline that
    returns a setting. The simulator's ``best_strategy`` replayed on the same
    timeline (as a `commsched.profile.Profile`) can take this place.
    """
    strategy = warmup.strategy
    choice = warmup.choice or Setting(strategy.partition_mb, strategy.credit_mb)
    return TunedSetting(choice.partition_mb, choice.credit_mb, strategy.bucket_cap_mb, strategy.first_bucket_mb,
                        warmup.overlap_allowed)


StartingPoint = Callable[[Warmup], TunedSetting]

SIMULATED_GUESSES = 3
"""Settings the simulator ranks best, measured right after the starting point."""

MAX_SIMULATED_SETTINGS = 1500
"""A larger space is thinned evenly before it is simulated (each simulation takes about a millisecond)."""


def warmup_profile(warmup: Warmup) -> Profile | None:
    """The warm-up timeline as a `commsched.profile.Profile`, for the simulator; None without one.

    The timeline knows when each gradient was ready and how long the forward
    pass took, not when the forward pass first read each parameter: as the
    cost model does, it is taken to reach each parameter after the share of the
    forward pass equal to the share of parameter bytes read before it. The link
    is the one the cost model measured; the CPU share of the transport stands
    in for the slowdown of computation beside it.
    """
    timeline = warmup.timeline
    if timeline is None or warmup.world_size < 2 or not warmup.parameters or not warmup.forward_order:
        return None
    sizes = warmup.parameters
    total = sum(numel * size for numel, size in sizes) or 1
    first_use, seen = {}, 0
    for slot in warmup.forward_order:
        first_use[slot] = timeline.forward_s * seen / total
        seen += sizes[slot][0] * sizes[slot][1]
    parameters = tuple(
        ParameterProfile(f"slot {slot}", numel, size, first_use.get(slot, timeline.forward_s),
                         timeline.slot_ready_s[slot])
        for slot, (numel, size) in enumerate(sizes)
    )
    link = LinkProfile(warmup.world_size, (), timeline.link.latency_s, timeline.link.bytes_per_s,
                       compute_slowdown=max(0.0, timeline.transport_cpu_share))
    return Profile("warm-up", "rank 0", 0, timeline.forward_s, max(timeline.slot_ready_s, default=0.0), 0.0,
                   parameters, link=link)


def simulated_guesses(warmup: Warmup, space: SearchSpace, count: int = SIMULATED_GUESSES) -> list[TunedSetting]:
    """The settings of ``space`` the simulator predicts fastest on the warm-up's timeline, the fastest
    for each of the ``count`` partition sizes predicted best (fastest first); none where there is
    no timeline to simulate."""
    from commsched.simulator import Cluster, simulate

    profile = warmup_profile(warmup)
    if profile is None or count < 1:
        return []
    cluster = Cluster.from_link(profile.link, workers=warmup.world_size)
    settings = list(space.grid())
    if len(settings) > MAX_SIMULATED_SETTINGS:
        step = len(settings) / MAX_SIMULATED_SETTINGS
        settings = [settings[int(i * step)] for i in range(MAX_SIMULATED_SETTINGS)]
    strategy = dataclasses.replace(warmup.strategy, autotune=False, adaptive=False)
    predicted: dict[tuple[object, ...], tuple[float, TunedSetting]] = {}
    for setting in settings:
        key = setting.behaviour(strategy)
        if key not in predicted:
            predicted[key] = (simulate(profile, cluster, setting.applied(strategy)).iteration_s, setting)
    ranked = sorted(predicted.values(), key=lambda pair: pair[0])
    # One per partition size: neighbours of the best (another credit window) teach the optimiser little.
    guesses: list[TunedSetting] = []
    for _, setting in ranked:
        if all(setting.partition_mb != g.partition_mb for g in guesses):
            guesses.append(setting)
        if len(guesses) == count:
            break
    return guesses


# ----------------------------------------------------------------- the study
@dataclass(frozen=True)
class Trial:
    setting: TunedSetting
    median_s: float


class Study:
    """One optuna study over a `SearchSpace`, asked and told one setting at a time.

    A proposal whose behaviour was measured already is told that measurement
    at once and the optimiser asked again, so no iteration measures a setting
    twice in one study.
    """

    def __init__(self, space: SearchSpace, start: TunedSetting, strategy: Strategy, seed: int, startup_trials: int,
                 then: Sequence[TunedSetting] = ()):
        optuna = require_optuna()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # multivariate TPE is marked experimental
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials, multivariate=True)
        self._study = optuna.create_study(direction="minimize", sampler=sampler)
        queued = {start.behaviour(strategy)}
        self._study.enqueue_trial(space.indices(start))
        for setting in then:  # measured next, in this order (the simulator's best guesses)
            if setting.behaviour(strategy) not in queued:
                queued.add(setting.behaviour(strategy))
                self._study.enqueue_trial(space.indices(setting))
        self._space, self._strategy = space, strategy
        self._measured: dict[tuple[object, ...], float] = {}
        self._pending: tuple[object, TunedSetting] | None = None
        self.trials: list[Trial] = []

    def ask(self) -> TunedSetting | None:
        """The next setting to measure; None when every proposal repeats one measured already."""
        for _ in range(MAX_REPEATS):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trial = self._study.ask()
                indices = {name: trial.suggest_int(name, 0, size - 1) for name, size in self._space.sizes().items()}
            setting = self._space.setting(indices)
            known = self._measured.get(setting.behaviour(self._strategy))
            if known is None:
                self._pending = (trial, setting)
                return setting
            self._study.tell(trial, known)
        return None

    def tell(self, median_s: float) -> None:
        """The median iteration time of the setting last asked for."""
        trial, setting = self._pending
        self._pending = None
        self._study.tell(trial, median_s)
        self._measured[setting.behaviour(self._strategy)] = median_s
        self.trials.append(Trial(setting, median_s))

    @property
    def best(self) -> Trial:
        return min(self.trials, key=lambda t: t.median_s)


# ----------------------------------------------------------------- decisions
class Phase(enum.IntEnum):
    TUNING = 0
    TUNED = 1
    RETUNING = 2
    STOPPED = 3
    """Tuning failed on rank 0 (logged there); the setting in use stays."""


@dataclass(frozen=True)
class Decision:
    """What rank 0 decided at a switch point; every rank applies the same one."""

    phase: Phase
    setting: TunedSetting
    """The setting in use from this switch point on."""
    next_in: int
    """Iterations to the next switch point (0: none; tuning is over for good)."""
    trial: int = 0
    """The trial ``setting`` is, in this study (1-based; 0 outside a study)."""
    trials: int = 0
    """How many trials this study expects."""
    ended_ms: float | None = None
    """Median iteration time of the setting in use until now, if this ends its trial."""
    window_ms: float | None = None
    """Median iteration time of the window that ends here, once tuned."""
    baseline_ms: float | None = None
    """The tuned baseline the windows are compared with."""

    LENGTH = 12

    def encode(self) -> list[float]:
        values = [float(self.phase), *self.setting.encode(), float(self.next_in), float(self.trial),
                  float(self.trials), _none_as(self.ended_ms), _none_as(self.window_ms), _none_as(self.baseline_ms)]
        assert len(values) == self.LENGTH
        return values

    @classmethod
    def decode(cls, values: Sequence[float]) -> Decision:
        values = [float(v) for v in values]
        return cls(Phase(int(values[0])), TunedSetting.decode(values[1:6]), int(values[6]), int(values[7]),
                   int(values[8]), _as_none(values[9]), _as_none(values[10]), _as_none(values[11]))


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

    def __init__(self, space: SearchSpace, start: TunedSetting, strategy: Strategy, config: TuningConfig,
                 guesses: Sequence[TunedSetting] = ()):
        self.space, self.strategy, self.config = space, strategy, config
        self._start = start
        self._guesses = tuple(guesses)
        """Measured right after ``start`` in the first study (`simulated_guesses`)."""
        self._current = start
        self._phase = Phase.TUNING
        self._studies = 0
        self._study: Study | None = None
        self._trials_expected = 0
        self._baseline_s: float | None = None
        self._last: tuple[int, float] | None = None
        self._measure_from = 0
        """Intervals starting before this iteration are not measured (settling)."""
        self._samples: list[float] = []
        self._first = True

    def pass_started(self, iteration: int, now_s: float) -> None:
        """A synchronised pass begins (every one, on rank 0): the interval since the last one ends."""
        last = self._last
        if last is not None and iteration == last[0] + 1 and last[0] >= self._measure_from:
            self._samples.append(now_s - last[1])
        self._last = (iteration, now_s)

    def decide(self, iteration: int) -> Decision:
        """At a switch point, after `pass_started` for it."""
        measured = statistics.median(self._samples) if self._samples else None
        self._samples = []
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
        self._measure_from = iteration + (SETTLE_ITERATIONS if changed else 0)
        return decision

    def stop(self) -> Decision:
        """Tuning failed: keep the setting in use, no more switch points."""
        self._phase = Phase.STOPPED
        return Decision(Phase.STOPPED, self._current, 0)

    def _start_study(self, phase: Phase, seed_setting: TunedSetting, first_measurement: float | None) -> Decision:
        config = self.config
        budget = config.budget_iterations if self._studies == 0 else min(config.budget_iterations,
                                                                          MAX_RETUNE_ITERATIONS)
        self._trials_expected = config.trials(budget)
        self._confirm = min(CONFIRM_BEST, max(0, self._trials_expected - 2))
        self._finalists: list[TunedSetting] | None = None
        self._confirmed: list[Trial] = []
        self._study = Study(self.space, seed_setting, self.strategy, config.seed + self._studies,
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

    def _best_settings(self, count: int) -> list[TunedSetting]:
        """The ``count`` fastest settings the search measured (see `CONFIRM_BEST`)."""
        finite = sorted((t for t in self._study.trials if math.isfinite(t.median_s)), key=lambda t: t.median_s)
        return [t.setting for t in finite[:count]]

    def _trial_decision(self, setting: TunedSetting, ended_ms: float | None) -> Decision:
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


# ------------------------------------------------------------------- the log
@dataclass
class TuningLog:
    """What every rank knows of the tuning: the same `Decision`\\ s applied in the same order."""

    phase: Phase = Phase.TUNING
    current: TunedSetting | None = None
    next_switch: int | None = None
    """The iteration of the next switch point (None: there is none)."""
    studies: list[list[Trial]] = field(default_factory=list)
    """Per study, each trial's setting and median iteration time (seconds)."""
    trial: int = 0
    trials: int = 0
    baseline_ms: float | None = None
    window_ms: float | None = None
    drift: float | None = None
    """At the latest re-tune: the window's median over the baseline."""
    settings: list[tuple[int, TunedSetting]] = field(default_factory=list)
    """Each change: the iteration it took effect at, and the setting."""

    def apply(self, iteration: int, decision: Decision) -> None:
        if decision.phase is Phase.RETUNING and self.phase is Phase.TUNED:
            self.studies.append([])
            self.drift = decision.window_ms / decision.baseline_ms
        elif not self.studies:
            self.studies.append([])
        if decision.ended_ms is not None and self.current is not None:
            self.studies[-1].append(Trial(self.current, decision.ended_ms / 1e3))
        if decision.setting != self.current:
            self.settings.append((iteration, decision.setting))
        self.phase, self.current = decision.phase, decision.setting
        self.trial, self.trials = decision.trial, decision.trials
        self.baseline_ms = decision.baseline_ms if decision.phase is Phase.TUNED else None
        self.window_ms = decision.window_ms
        self.next_switch = iteration + decision.next_in if decision.next_in > 0 else None

    @property
    def best(self) -> Trial | None:
        """Tuned: the latest measurement of the setting in use (for a finalist, its second);
        before that, the fastest measurement so far."""
        trials = [t for t in (self.studies[-1] if self.studies else []) if math.isfinite(t.median_s)]
        if self.phase is Phase.TUNED:
            mine = [t for t in trials if t.setting == self.current]
            if mine:
                return mine[-1]
        return min(trials, key=lambda t: t.median_s) if trials else None

    def describe(self) -> str:
        """Why the setting in use is the one in use."""
        if self.phase is Phase.TUNING:
            return f"tuning: trial {self.trial} of ~{self.trials}"
        if self.phase is Phase.RETUNING:
            change = (self.drift or 1.0) - 1.0
            verb = "rose" if change > 0 else "fell"
            return f"re-tuning: iteration time {verb} {abs(change):.0%}; trial {self.trial} of ~{self.trials}"
        if self.phase is Phase.STOPPED:
            return "tuning stopped after an error on rank 0 (see its log); the setting in use stays"
        best = self.best
        measured = "" if best is None else f" at {best.median_s * 1e3:.2f} ms per iteration"
        count = len(self.studies[-1]) if self.studies else 0
        return f"tuned: {self.current.describe()}{measured} (best of {count} trials)"

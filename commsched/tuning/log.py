"""What every rank knows of the tuning: the same decisions, applied in the same order."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from commsched.layout.setting import LayoutSetting
from commsched.tuning.decision import Decision, Phase
from commsched.tuning.study import Trial


# ------------------------------------------------------------------- the log
@dataclass
class TuningLog:
    """What every rank knows of the tuning: the same `Decision`\\ s applied in the same order."""

    phase: Phase = Phase.TUNING
    current: LayoutSetting | None = None
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
    margin: float | None = None
    """The margin the latest verdict of a check of the cost model's choice applied (`Decision.margin`)."""
    settings: list[tuple[int, LayoutSetting]] = field(default_factory=list)
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
        self.margin = decision.margin
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

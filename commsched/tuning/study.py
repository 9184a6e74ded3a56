"""One Bayesian search (optuna's TPE sampler, seeded), asked and told one setting at a time."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from commsched.layout.setting import LayoutSetting
from commsched.strategy import require_optuna
from commsched.tuning.space import SearchSpace

MAX_REPEATS = 64
"""How many times in a row the optimiser may propose a setting already measured (whose
measurement is reused) before the study is taken as exhausted."""


STARTUP_TRIALS = 3
"""Trials before the optimiser models the objective (the start and two random ones): few, since a
search has only tens of iterations."""


# ----------------------------------------------------------------- the study
@dataclass(frozen=True)
class Trial:
    setting: LayoutSetting
    median_s: float


class Study:
    """One optuna study over a `SearchSpace`, asked and told one setting at a time.

    A proposal whose behaviour was measured already is told that measurement
    at once and the optimiser asked again, so no iteration measures a setting
    twice in one study.
    """

    def __init__(self, space: SearchSpace, start: LayoutSetting, seed: int, startup_trials: int,
                 then: Sequence[LayoutSetting] = ()):
        optuna = require_optuna()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # multivariate TPE is marked experimental
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials, multivariate=True)
        self._study = optuna.create_study(direction="minimize", sampler=sampler)
        queued = {start.behaviour()}
        self._study.enqueue_trial(space.indices(start))
        for setting in then:  # measured next, in this order (the simulator's best guesses)
            if setting.behaviour() not in queued:
                queued.add(setting.behaviour())
                self._study.enqueue_trial(space.indices(setting))
        self._space = space
        self._measured: dict[tuple[object, ...], float] = {}
        self._pending: tuple[object, LayoutSetting] | None = None
        self.trials: list[Trial] = []

    def ask(self) -> LayoutSetting | None:
        """The next setting to measure; None when every proposal repeats one measured already."""
        for _ in range(MAX_REPEATS):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trial = self._study.ask()
                indices = {name: trial.suggest_int(name, 0, size - 1) for name, size in self._space.sizes().items()}
            setting = self._space.setting(indices)
            known = self._measured.get(setting.behaviour())
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
        self._measured[setting.behaviour()] = median_s
        self.trials.append(Trial(setting, median_s))

    @property
    def best(self) -> Trial:
        return min(self.trials, key=lambda t: t.median_s)

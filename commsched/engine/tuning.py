"""Switch points inside a run: rank 0's decisions, every rank's log.

The session exists from the end of warm-up on, with ``Strategy(autotune=True)``
(see [Note: auto-tuning] in `commsched.tuning`) or while the cost model's choice
of partitions is measured against whole buckets (see [Note: confirming the
choice] in `commsched.tuning.confirmation`). At each switch point (the start
of a synchronised backward pass whose number every rank knows) rank 0's
`TuningController` decides, the decision is broadcast on the control group, and every
rank applies it to its `TuningLog`; the engine then lays out and plans the
setting it names, if it changed anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch.distributed as dist

from commsched.comm.transport import Transport
from commsched.engine.groups import ProcessGroups
from commsched.layout.setting import LayoutSetting
from commsched.tuning.confirmation import Confirmation
from commsched.tuning.controller import Controller, TuningConfig
from commsched.tuning.decision import Decision, Phase, agree_on_decision
from commsched.tuning.guesses import TuningStart, simulated_guesses, starting_point
from commsched.tuning.log import TuningLog
from commsched.tuning.space import SearchSpace
from commsched.errors import failures_explained

logger = logging.getLogger("commsched")


class TuningSession:
    """One model's switch points: where they are and what each decided."""

    def __init__(
        self,
        make_controller: Callable[[], TuningController],
        groups: ProcessGroups,
        transport: Transport,
        timeout_s: float,
        decider: str,
    ):
        """``make_controller``: rank 0's decider, made at the first switch point (see `autotuner` and
        `confirmation`); ``decider``: what it is, for errors."""
        self._make_controller, self._decider = make_controller, decider
        self._groups, self._transport, self._timeout_s = groups, transport, timeout_s
        self._controller: TuningController | None = None
        """Rank 0's decider, made at the first switch point."""
        self.log = TuningLog()
        """The decisions so far, the same on every rank."""

    def switches_at(self, iteration: int) -> bool:
        """Whether the pass of ``iteration`` is a switch point."""
        return self.log.next_switch == iteration

    def pass_started(self, iteration: int, now_s: float) -> None:
        """A synchronised pass begins: on rank 0 it ends the interval measured since the last one."""
        if self._controller is not None:
            self._controller.pass_started(iteration, now_s)

    def switch_point(self, iteration: int, in_use: LayoutSetting) -> LayoutSetting:
        """Rank 0 decides, every rank applies (collective on the control group): the setting in use
        from this pass on."""
        control = self._groups.control
        decision = self._decide(iteration, in_use) if dist.get_rank(control) == 0 else None
        with failures_explained(self._transport.explain_failure):
            decision = agree_on_decision(decision, control, self._timeout_s, self._decider)
        self.log.apply(iteration, decision)
        return decision.setting

    def _decide(self, iteration: int, in_use: LayoutSetting) -> Decision:
        """Rank 0's decision; a failure of the tuner stops tuning, never training."""
        try:
            if self._controller is None:
                self._controller = self._make_controller()
            return self._controller.decide(iteration)
        except Exception:  # noqa: BLE001 - tuning is an optimisation: keep training as it is
            logger.exception("commsched: auto-tuning stopped at iteration %d; the setting in use stays", iteration)
            if self._controller is not None:
                return self._controller.stop()
            return Decision(Phase.STOPPED, in_use, 0)


class TuningController(Protocol):
    """Rank 0's decider at switch points: the auto-tuner's `Controller`, or a `Confirmation`."""

    def pass_started(self, iteration: int, now_s: float) -> None: ...

    def decide(self, iteration: int) -> Decision: ...

    def stop(self) -> Decision: ...


def autotuner(config: TuningConfig, start: TuningStart, gradient_bytes: int) -> Callable[[], TuningController]:
    """``Strategy(autotune=True)``'s decider (``start``: what warm-up gave; its timeline matters on rank 0 only)."""
    def make() -> Controller:
        first = starting_point(start)
        space = SearchSpace.around(gradient_bytes, first, start.overlap_allowed)
        return Controller(space, first, config, simulated_guesses(start, space))

    return make


def confirmation(chosen: LayoutSetting, whole: LayoutSetting,
                 beside: Sequence[LayoutSetting] = ()) -> Callable[[], TuningController]:
    """The check of the cost model's ``chosen`` setting and those measured ``beside`` it (its runner-up,
    its best whole buckets) against ``whole``, the configured buckets sent whole; see [Note: confirming
    the choice] in `commsched.tuning.confirmation`."""
    return lambda: Confirmation(chosen, whole, beside)

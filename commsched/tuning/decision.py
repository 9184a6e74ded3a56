"""What rank 0 decides at a switch point, and its broadcast to every rank."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commsched.errors import wait_or_raise
from commsched.layout.setting import LayoutSetting, as_none, none_as


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
    setting: LayoutSetting
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
    margin: float | None = None
    """The verdict of a check of the cost model's choice: how much shorter, as a fraction, a setting
    had to measure to replace another (`commsched.tuning.confirmation.confirmation_margin`)."""

    LENGTH = 13

    def encode(self) -> list[float]:
        values = [float(self.phase), *self.setting.encode(), float(self.next_in), float(self.trial),
                  float(self.trials), none_as(self.ended_ms), none_as(self.window_ms), none_as(self.baseline_ms),
                  none_as(self.margin)]
        assert len(values) == self.LENGTH
        return values

    @classmethod
    def decode(cls, values: Sequence[float]) -> Decision:
        values = [float(v) for v in values]
        return cls(Phase(int(values[0])), LayoutSetting.decode(values[1:6]), int(values[6]), int(values[7]),
                   int(values[8]), as_none(values[9]), as_none(values[10]), as_none(values[11]), as_none(values[12]))


def agree_on_decision(decision: Decision | None, group: dist.ProcessGroup, timeout_s: float, decider: str) -> Decision:
    """Rank 0's `Decision` on every rank (``decision``: rank 0's, None elsewhere); ``decider``
    names who decides, for errors ("the auto-tuner").

    Collective over ``group`` (the control group), at a switch point every rank
    knows; see [Note: auto-tuning].
    """
    message = torch.zeros(Decision.LENGTH, dtype=torch.float64)
    if decision is not None:
        message = torch.tensor(decision.encode(), dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        work = dist.broadcast(message, group=group, group_src=0, async_op=True)
        wait_or_raise(work, timeout_s, f"the broadcast of rank 0's decision at a switch point ({decider}), "
                                       "which every rank reaches at the same synchronised backward pass")
    return decision if decision is not None else Decision.decode(message.tolist())

"""Whether the next forward pass may overlap the reductions, and why not; and an optimizer adopted on the way.

Forward overlap is asked for by `Strategy.overlap_forward` and switched off,
for the rest of the run, by what the backend's update cannot do, by one
replica (nothing to hide), by what warm-up saw the loop do (gradients changed
before ``step()``, a ``GradScaler``) or by an optimizer that cannot be
adopted. The tuner may turn it off for a setting it measures. This object
holds that decision and its reason; the reducer asks it, and it takes the
gates off when overlap can no longer start.

[Note: an adopted optimizer] `commsched.DistributedDataParallel` wraps a model
before its optimizer exists, as torch DDP does. Until warm-up ends, overlap
stays possible (gates, the reads watch), and the first ``step()`` of one
optimizer over every trainable parameter adopts it, as if it had been given to
prepare(): that step runs as torch.optim's own, on gradients already averaged
(warm-up does not overlap), and the next ones are per-bucket updates. No
adoption by the end of warm-up: the model trains as prepared without an
optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from commsched.layout.setting import LayoutSetting
from commsched.update.base import UpdatePolicy

logger = logging.getLogger("commsched")

ONE_REPLICA_REASON = "one replica: there is no reduction to hide, so every bucket is updated at step()"

TUNED_OVERLAP_OFF = "the auto-tuner's setting in use has forward overlap off"


class ForwardOverlap:
    """Overlap asked for, what blocks it for good, and whether an optimizer may still be adopted."""

    def __init__(self, requested: bool, policy: UpdatePolicy, one_replica: bool, awaiting_optimizer: bool,
                 remove_gates: Callable[[], None]):
        """``remove_gates``: takes the forward gates off once overlap can no longer start."""
        self.requested = requested
        self.awaiting_optimizer = awaiting_optimizer
        """No optimizer yet: one may be adopted at its first ``step()`` during warm-up."""
        self._policy, self._remove_gates = policy, remove_gates
        self.blocked: str | None = None if awaiting_optimizer else policy.overlap_blocker
        """Why overlap can no longer start, for the rest of the run (None: it still can)."""
        if requested and self.blocked:
            logger.warning("commsched: overlap_forward is off: %s", self.blocked)
        elif one_replica:
            # Nothing to hide: gates and deferred updates would only cost time.
            self.blocked = ONE_REPLICA_REASON

    def off_reason(self, setting: LayoutSetting) -> str | None:
        """Why forward overlap is (or will be) off under ``setting``; None while it is on or still possible."""
        if not self.requested:
            return "Strategy(overlap_forward=False)"
        if self.blocked:
            return self.blocked
        if not setting.overlap_forward:
            return TUNED_OVERLAP_OFF
        return None

    @property
    def updates_per_bucket(self) -> bool:
        """Whether updates can run bucket by bucket: the policy's own, or one an optimizer adopted later may give."""
        return self._policy.per_bucket or self.awaiting_optimizer

    def block(self, reason: str) -> None:
        """Forward overlap can no longer start: its gates go (the warm-up's reads end with it)."""
        self.blocked = reason
        self._remove_gates()
        if self.requested:
            logger.warning("commsched: overlap_forward is off from now on: %s", reason)

    def optimizer_settled(self) -> None:
        """An optimizer was adopted, or warm-up ended without one: what the policy now cannot do blocks overlap."""
        self.awaiting_optimizer = False
        if self._policy.overlap_blocker is not None:
            self.block(self._policy.overlap_blocker)

    def optimizer_declined(self, reason: str) -> None:
        """The optimizer this model would adopt steps other models' parameters too (``reason``)."""
        self.awaiting_optimizer = False
        self.block(reason)

"""Whether a run reduce-scatters its gradients (``AllReduce(shard_optimizer=True, reduce_scatter=True)``).

[Note: reduce-scattered buckets] in `commsched.comm.reduce_scatter` says what a
reduce-scatter leaves in ``param.grad``. This part decides, for the coordinator,
whether the loop allows it: warm-up always all-reduces and notes a loop that
needs the whole averaged gradients (gradients changed between ``backward()``
and ``step()``, a ``GradScaler``); at its end every rank learns whether any rank
saw one, and only if none did do the buckets laid out from then on go
reduce-scattered. After warm-up such a loop is refused, since it would read NaN.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist

from commsched.comm.agreement import on_any_rank
from commsched.comm.transport import Scattering
from commsched.update.grad_scaling import GRAD_SCALER_REASON
from commsched.watch.guards import GRADIENTS_CHANGED_REASON, whole_gradients_needed_error

logger = logging.getLogger("commsched")

WHOLE_GRADIENTS_ON_ANOTHER_RANK = (
    "another rank's loop changed its gradients between backward() and step(), or used a GradScaler, in warm-up"
)


class ScatterDecision:
    """The loop's need for whole averaged gradients, and the transport's reduce-scatter it decides."""

    def __init__(self, scatter: Scattering | None, control_group: Callable[[], dist.ProcessGroup], timeout_s: float):
        """``scatter``: the transport's (None: never reduce-scattered, and this decides nothing);
        ``control_group``: where the ranks agree, read when they do."""
        self._scatter, self._control_group, self._timeout_s = scatter, control_group, timeout_s
        self._whole_needed: str | None = None
        """Why the loop needs every rank to hold the whole averaged gradients, as warm-up saw."""

    def off_reason(self, warming_up: bool) -> str | None:
        """Why gradients stay all-reduced though the strategy asks for a reduce-scatter; None otherwise."""
        if self._scatter is None or warming_up:
            return None
        return self._whole_needed

    def stepped(self, changed: bool, scaled: bool, warming_up: bool) -> None:
        """At ``step()``: whether the loop needs the whole averaged gradients on every rank. Noted in
        warm-up (they then stay all-reduced); after it, with reduce-scattered buckets, refused. (A
        loop that only reads them finds NaN where they are not averaged.)"""
        reason = GRAD_SCALER_REASON if scaled else GRADIENTS_CHANGED_REASON if changed else None
        if reason is None:
            return
        if self._scatter is not None and self._scatter.active:
            raise whole_gradients_needed_error(
                "a torch.amp.GradScaler stepped this optimizer" if scaled else
                "gradients were changed between backward() and step() (clip_grad_norm_, GradScaler.unscale_, ...)")
        if warming_up and self._whole_needed is None:
            self._whole_needed = reason

    def start(self) -> bool:
        """At the end of warm-up: reduce-scatter from the next layout on, unless some rank's loop was
        seen needing the whole averaged gradients; True if the buckets must be laid out anew for it.
        Every rank decides alike (one all-reduce): the collectives of the two differ."""
        if self._scatter is None:
            return False
        needed_somewhere = on_any_rank(self._whole_needed is not None, self._control_group(), self._timeout_s,
                                       "the agreement on reduce-scattering gradients")
        if needed_somewhere and self._whole_needed is None:
            self._whole_needed = WHOLE_GRADIENTS_ON_ANOTHER_RANK
        if self._whole_needed is not None:
            logger.warning("commsched: gradients stay all-reduced whole (reduce_scatter=True is off): %s",
                           self._whole_needed)
            return False
        self._scatter.start()
        return True

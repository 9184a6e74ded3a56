"""Buffers (BatchNorm statistics) broadcast from rank 0 at each forward pass that records gradients, as torch DDP does.

Under ``Join`` the source is the highest rank still training (see [Note: uneven
inputs] in `commsched.engine.join`). With forward overlap they go on a side
group, so they never queue behind gradient reductions still in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commsched.comm.agreement import broadcast_from, broadcast_from_rank0, highest_rank_still_training
from commsched.engine.groups import ProcessGroups


class BufferBroadcast:
    """The buffers of ``modules`` made equal on every rank."""

    def __init__(self, modules: Sequence[torch.nn.Module], groups: ProcessGroups, timeout_s: float, enabled: bool):
        """``enabled``: ``Strategy.broadcast_buffers`` with more than one replica."""
        self._modules, self._groups, self._timeout_s, self._enabled = modules, groups, timeout_s, enabled

    def __call__(self, training: bool, under_join: bool) -> None:
        """Rank 0's buffers everywhere; ``under_join``, those of the highest rank still ``training``."""
        if not self._enabled:
            return
        # Looked up each time: a buffer may be replaced by a new tensor between iterations.
        buffers = [b for m in self._modules for b in m._buffers.values() if b is not None]
        if not buffers:
            return
        group, timeout_s = self._groups.buffers, self._timeout_s
        if under_join:
            broadcast_from(buffers, highest_rank_still_training(training, group, timeout_s), group, timeout_s)
        else:
            broadcast_from_rank0(buffers, group, timeout_s)

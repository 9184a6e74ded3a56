"""Buffers (BatchNorm statistics) broadcast from rank 0 at the forward passes where torch DDP broadcasts them.

[Note: when buffers are broadcast] torch DDP broadcasts at a forward pass
when the previous forward pass that recorded gradients did so outside
``no_sync()`` (``require_forward_param_sync``; true before the first). With
gradient accumulation the first micro-step broadcasts and the last one does
not; users compare BatchNorm statistics with DDP's, so commsched follows the
same rule. One difference: a forward pass without gradients (evaluation under
``torch.no_grad()``) never communicates here, so that one rank may evaluate
alone; DDP's broadcast there (when due) is made at the next forward pass that
records gradients. Evaluation in ``eval()`` mode leaves the buffers alone, so
training sees the same values as under DDP.

Under ``Join`` every synchronised forward pass broadcasts, from the highest
rank still training, and a joined rank's shadow iteration broadcasts with it
(see [Note: uneven inputs] in `commsched.engine.join`). With forward overlap
the broadcasts go on a side group, so they never queue behind gradient
reductions still in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from commsched.comm.agreement import broadcast_from, highest_rank_still_training
from commsched.device import HostSeam
from commsched.engine.groups import ProcessGroups


class BufferBroadcast:
    """The buffers of ``modules`` made equal on every rank, when torch DDP would make them so."""

    def __init__(self, modules: Callable[[], Sequence[torch.nn.Module]], groups: ProcessGroups, timeout_s: float,
                 enabled: bool, seam: HostSeam):
        """``modules``: the model's modules now (one may be added after ``prepare()``);
        ``enabled``: ``Strategy.broadcast_buffers`` with more than one replica; ``seam``: on a GPU,
        the broadcast orders the stream, the host goes on ([Note: stream-ordered waits] in
        commsched/device.py)."""
        self._modules, self._groups, self._timeout_s, self._enabled = modules, groups, timeout_s, enabled
        self._seam = seam
        self._due = True
        """DDP's ``require_forward_param_sync``: the last forward pass with gradients was synchronised."""

    def before_forward(self, synchronised: bool, under_join: bool) -> None:
        """A forward pass that records gradients begins; ``synchronised``: outside ``no_sync()``.

        See [Note: when buffers are broadcast].
        """
        if under_join:
            if synchronised:
                self._broadcast(training=True, under_join=True)
            return
        if self._due:
            self._broadcast(training=True, under_join=False)
        self._due = synchronised

    def shadow_iteration(self, under_join: bool) -> None:
        """A joined rank's share of the broadcast a training rank makes at its forward pass."""
        self._broadcast(training=False, under_join=under_join)

    def _broadcast(self, training: bool, under_join: bool) -> None:
        """Rank 0's buffers everywhere; ``under_join``, those of the highest rank still ``training``."""
        if not self._enabled:
            return
        # Looked up each time: a buffer may be replaced by a new tensor between iterations.
        buffers = [b for m in self._modules() for b in m._buffers.values() if b is not None]
        if not buffers:
            return
        group, timeout_s = self._groups.buffers, self._timeout_s
        if under_join:
            self._seam.host_read()  # the source is chosen on the host
            source = highest_rank_still_training(training, group, timeout_s, buffers[0].device)
            broadcast_from(buffers, source, group, timeout_s, seam=self._seam)
        else:
            broadcast_from(buffers, 0, group, timeout_s, seam=self._seam)

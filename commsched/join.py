"""Uneven inputs: torch's ``Join`` context manager with a prepared model.

[Note: uneven inputs] When ranks run different numbers of iterations (an
uneven ``DistributedSampler``), a rank that runs out of batches would leave the
others waiting in their collectives. As with torch DDP, training loops run
under ``torch.distributed.algorithms.join.Join([model])``: every forward pass
that will reduce gradients counts the ranks still training (one asynchronous
all-reduce on the control group), and a rank that has left its loop takes part
in each of the others' iterations with no gradients (`GradientReducer.shadow_iteration`):
the buffer broadcast, then every partition in plan order, holding zeros and
flagged unused. Gradients are still divided by the full world size, as DDP's
default (``divide_by_initial_world_size``). When the last rank is done, every
rank takes the parameters and buffers of one of the ranks that trained longest
(its optimizer state stays its own, as with DDP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from commsched.consistency import broadcast_from
from commsched.errors import wait_or_raise

if TYPE_CHECKING:
    from commsched.reducer import GradientReducer


class ShadowIterations(JoinHook):
    """What a prepared model does under ``Join`` once its rank has run out of batches."""

    def __init__(self, reducer: GradientReducer):
        self._reducer = reducer

    def main_hook(self) -> None:
        self._reducer.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        reducer = self._reducer
        reducer.synchronize()
        group, timeout_s = reducer.join_process_group, reducer.strategy.timeout_s
        source = highest_rank_still_training(is_last_joiner, group, timeout_s)
        module = reducer.module
        broadcast_from([*module.parameters(), *module.buffers()], source, group, timeout_s)


def check_join_supported(reducer: GradientReducer) -> None:
    """Refuse what a joined rank cannot shadow, at ``Join`` time rather than as a hang."""
    if reducer.strategy.parameter_server:
        raise RuntimeError(
            "Join (uneven inputs) is not supported with Strategy(backend=ParameterServer(...)): in sync mode "
            "the servers wait for every worker's gradients. Give every worker the same number of batches "
            "(DistributedSampler(drop_last=True)), or use mode='async'."
        )
    if reducer.join_process_group is reducer.process_group and reducer.strategy.overlap_forward:
        raise RuntimeError(
            "Join (uneven inputs) with forward overlap needs commsched's control group, which is made "
            "only for the default process group: prepare() without process_group=, or use "
            "Strategy(overlap_forward=False)."
        )


def highest_rank_still_training(training: bool, group: dist.ProcessGroup, timeout_s: float) -> int:
    """The source of buffers under ``Join`` (torch DDP's choice): one all-reduce on ``group``."""
    candidate = torch.tensor([dist.get_rank(group) if training else -1], dtype=torch.int64)
    work = dist.all_reduce(candidate, dist.ReduceOp.MAX, group=group, async_op=True)
    wait_or_raise(work, timeout_s, "the choice of the rank to copy buffers or parameters from (Join)")
    return int(candidate)

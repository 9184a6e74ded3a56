"""Uneven inputs under torch's ``Join``: how many batches each rank runs, and their data.

Shared by the ``Join`` cases of the unsharded, sharded and reduce-scattered suites.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join


def batch_counts(world_size: int) -> list[int]:
    """Rank 0 runs the most batches, the last rank the fewest (past warm-up and the plan)."""
    return [8 - 2 * rank for rank in range(world_size)]


def out_during_warmup(world_size: int) -> list[int]:
    """The last rank runs out after two batches: it shadows warm-up's last profiled
    iteration, which ends with the link's calibration, and the plan's agreement."""
    return [*batch_counts(world_size)[:-1], 2]


def batches_of(rank: int, count: int, shape: tuple[int, ...], classes: int | None):
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(count):
        x = torch.randn(4, *shape, generator=generator)
        y = (torch.randint(0, classes, (4,), generator=generator) if classes
             else torch.randn(4, 4, generator=generator))
        yield x, y


def loss_of(model, x, y, classes):
    out = model(x)
    return F.cross_entropy(out, y) if classes else F.mse_loss(out, y)


def train_until_one_rank_is_out(model, optimizer, rank, world_size):
    """Under ``Join(throw_on_early_termination=True)``: every rank raises once the first runs out."""
    import pytest

    with pytest.raises(RuntimeError, match="exhausted"):
        with Join([model], throw_on_early_termination=True):
            for x, y in batches_of(rank, batch_counts(world_size)[rank], (8,), None):
                loss_of(model, x, y, None).backward()
                optimizer.step()
                optimizer.zero_grad()

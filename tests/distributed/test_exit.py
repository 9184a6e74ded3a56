"""Ending a run: groups only commsched holds are freed when the model is released.

``commsched.release(model)`` and the exit handler of a model never released
share `GradientReducer.shut_down`. Freed later, while the interpreter
finalizes, a gloo group can abort the process after a clean run (see [Note:
process groups at exit] in commsched/reducer.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import commsched
from commsched.testing import run_ranks
from commsched.testing.models import ParityNet

pytestmark = pytest.mark.distributed


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def groups_freed_at_exit(rank: int, world_size: int) -> tuple[int, int, int]:
    with_world_group = thread_count()
    torch.manual_seed(0)
    model = ParityNet()
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    dist.destroy_process_group()
    after_destroy = thread_count()
    commsched.release(model)  # shuts down as the exit handler does, after waiting for what is in flight
    assert commsched.status(model).lifecycle is commsched.Lifecycle.RELEASED
    return with_world_group, after_destroy, thread_count()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task (Linux)")
def test_destroyed_groups_are_freed_at_exit():
    for rank, (with_world_group, after_destroy, at_exit) in enumerate(
            run_ranks(groups_freed_at_exit, 2, timeout_s=120)):
        # After destroy_process_group() the reducer still holds its buffer group,
        # whose gloo threads run on ...
        assert after_destroy > with_world_group, (rank, with_world_group, after_destroy)
        # ... until release (or the exit handler) lets go and the group's destructor joins them.
        assert at_exit <= with_world_group, (rank, with_world_group, after_destroy, at_exit)

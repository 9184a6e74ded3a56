"""commsched's side groups (see [Note: side groups] in commsched/comm/side_groups.py): on a sub-group of
the job, the ranks outside it take no part, and nothing queues behind the gradients of the ranks
inside it; every model prepared on a group shares one side group, until a failure drops it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import commsched
from commsched.comm import side_groups as control
from commsched.testing import OPTIMIZERS
from commsched.testing.models import BatchNormNet
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

ITERATIONS = 5


def train_on_two_of_three(rank: int, world_size: int) -> str:
    """Ranks 0 and 1 train a BatchNorm model on a sub-group, against torch DDP on the same
    sub-group; rank 2 (a server or another job's rank) only made the group."""
    pair = dist.new_group([0, 1])
    if rank == 2:
        return "outside"
    torch.manual_seed(0)
    base = BatchNormNet()
    ddp = DistributedDataParallel(copy.deepcopy(base), process_group=pair)
    ddp_optimizer = OPTIMIZERS["sgd_momentum_lr_0.1"](ddp.parameters())
    model, optimizer = commsched.prepare(base, OPTIMIZERS["sgd_momentum_lr_0.1"](base.parameters()),
                                         process_group=pair)
    buffer_group = commsched.status(model).process_groups.buffers
    # The forward pass's buffer broadcast must not wait behind gradients still in flight.
    assert buffer_group is not pair, "buffer broadcasts share the gradients' group"
    assert dist.get_process_group_ranks(buffer_group) == [0, 1]
    generator = torch.Generator().manual_seed(5 + rank)
    for _ in range(ITERATIONS):
        x = torch.randn(4, 1, 6, 6, generator=generator) + rank
        y = torch.randint(0, 3, (4,), generator=generator)
        for m, o in ((ddp, ddp_optimizer), (model, optimizer)):
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
    optimizer.synchronize()
    assert commsched.status(model).lifecycle.name == "OVERLAPPING", "the case must run with forward overlap"
    parameters = buffers = 0
    for (name, a), (_, e) in zip(model.named_parameters(), ddp.module.named_parameters(), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=lambda m: f"parameter '{name}': {m}")
        parameters += 1
    for (name, a), (_, e) in zip(model.named_buffers(), ddp.module.named_buffers(), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=lambda m: f"buffer '{name}': {m}")
        buffers += 1
    assert parameters > 0 and buffers > 0, (parameters, buffers)
    commsched.release(model)
    # A second model on the same sub-group (torch names a locally synchronised group by its
    # ranks alone, so making another one would wait forever): it shares the buffer group.
    second = BatchNormNet()
    second, second_optimizer = commsched.prepare(second, torch.optim.SGD(second.parameters(), lr=0.1),
                                                 process_group=pair)
    assert commsched.status(second).process_groups.buffers is buffer_group
    for _ in range(2):
        F.cross_entropy(second(torch.randn(4, 1, 6, 6, generator=generator)), torch.zeros(4, dtype=torch.long)).backward()
        second_optimizer.step()
        second_optimizer.zero_grad()
    commsched.release(second)
    return "trained"


def train_two_models_on_the_default_group(rank: int, world_size: int) -> str:
    """Two models prepared on the default group share its side group; once forgotten (as after
    a failure), the next ``prepare()`` makes a new one."""
    generator = torch.Generator().manual_seed(rank)
    side_groups = []
    for _ in range(3):
        torch.manual_seed(0)
        base = BatchNormNet()
        model, optimizer = commsched.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1))
        side_groups.append(commsched.status(model).process_groups.buffers)
        for _ in range(2):
            x = torch.randn(4, 1, 6, 6, generator=generator)
            F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long)).backward()
            optimizer.step()
            optimizer.zero_grad()
        commsched.release(model)
        if len(side_groups) == 2:
            control.forget_side_groups([side_groups[-1]])
    first, second, third = side_groups
    assert first is not dist.group.WORLD, "buffer broadcasts share the gradients' group"
    assert second is first, "a second model made a second side group"
    assert third is not first, "a forgotten side group was used again"
    return "trained"


def two_models_on_a_group_without_cpu_backend(rank: int, world_size: int) -> str:
    """A group that refuses CPU tensors, as NCCL does, sends the control messages on its side group
    (with gloo for CPU tensors); a second model on it must share that group, not make another."""
    group = dist.new_group(backend="cuda:gloo")
    controls = []
    for _ in range(2):
        model = torch.nn.Linear(4, 2)
        model, _ = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), process_group=group)
        controls.append(commsched.status(model).process_groups.control)
        commsched.release(model)
    assert controls[0] is controls[1], "a second model made a second control group"
    assert str(dist.get_backend(controls[0])) == "cpu:gloo,cuda:gloo"
    return "prepared"


def side_group_cases(rank: int, world_size: int) -> tuple[str, str, str]:
    return (train_on_two_of_three(rank, world_size), train_two_models_on_the_default_group(rank, world_size),
            two_models_on_a_group_without_cpu_backend(rank, world_size))


@in_shared_ranks(side_group_cases, 3, timeout_s=240)
def test_side_groups_on_a_sub_group_and_on_the_default_group(shared_ranks):
    """A sub-group trains exactly with its own side group; models on one group share it."""
    assert shared_ranks.result() == [("trained", "trained", "prepared")] * 2 + [
        ("outside", "trained", "prepared")]

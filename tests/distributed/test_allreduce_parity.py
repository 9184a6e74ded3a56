"""commsched gives single-process training's parameters, and torch DDP's.

Each test spawns one group of real processes and runs a whole grid of cases
inside it (spawning a process that imports torch costs seconds).
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import commsched
from commsched.testing import (
    OPTIMIZERS,
    assert_equal_on_all_ranks,
    assert_same_parameters,
    run_subtests,
)
from commsched.testing.models import BatchNormNet, ParityNet
from commsched.testing.parity import (
    ITERATIONS,
    PARITY_OPTIMIZERS,
    PER_RANK_BATCH,
    batches,
    case_matches_single_process,
    case_no_sync_accumulation,
    fresh_pair,
    rank_slice,
    reference_backward,
    reference_step,
    uses_aux,
)
from commsched.testing.parity import PARITY_STRATEGIES as STRATEGIES
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

def case_backward_twice_without_step(rank, world_size):
    """Two backward passes before one step accumulate, as in single-process training."""
    model, optimizer, reference, reference_optimizer = fresh_pair("sgd_dampening")
    model, optimizer = commsched.prepare(model, optimizer)
    data = list(batches(world_size, iterations=4))
    for pair in (data[:2], data[2:]):
        for iteration, (x, y) in enumerate(pair):
            mine = rank_slice(rank)
            F.mse_loss(model(x[mine], use_aux=uses_aux(iteration, rank)), y[mine]).backward()
            reference_backward(reference, x, y, iteration, world_size)
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert_same_parameters(model, reference)


def case_matches_ddp(rank, world_size, optimizer_name, model_cls):
    """Same initial model, same data: commsched and torch DDP end with the same parameters."""
    torch.manual_seed(0)
    base = model_cls()
    ddp_model = DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=model_cls is ParityNet)
    ddp_optimizer = OPTIMIZERS[optimizer_name](ddp_model.parameters())
    model, optimizer = commsched.prepare(base, OPTIMIZERS[optimizer_name](base.parameters()))
    generator = torch.Generator().manual_seed(99 + rank)
    for iteration in range(ITERATIONS):
        if model_cls is BatchNormNet:
            x = torch.randn(PER_RANK_BATCH, 1, 6, 6, generator=generator)
            y = torch.randint(0, 3, (PER_RANK_BATCH,), generator=generator)
            runs = [(m, o, lambda m: F.cross_entropy(m(x), y)) for m, o in
                    ((ddp_model, ddp_optimizer), (model, optimizer))]
        else:
            x = torch.randn(PER_RANK_BATCH, 8, generator=generator)
            y = torch.randn(PER_RANK_BATCH, 4, generator=generator)
            aux = uses_aux(iteration, rank)
            runs = [(m, o, lambda m: F.mse_loss(m(x, use_aux=aux), y)) for m, o in
                    ((ddp_model, ddp_optimizer), (model, optimizer))]
        for m, o, loss_fn in runs:
            loss_fn(m).backward()
            o.step()
            o.zero_grad()
    optimizer.synchronize()  # updates may still be pending under forward overlap
    parameters = buffers = 0
    for (name, a), (_, e) in zip(model.named_parameters(), ddp_model.module.named_parameters(), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=lambda m: f"parameter '{name}': {m}")
        parameters += 1
    for (name, a), (_, e) in zip(model.named_buffers(), ddp_model.module.named_buffers(), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=lambda m: f"buffer '{name}': {m}")
        buffers += 1
    assert parameters > 0
    assert (buffers > 0) == (model_cls is BatchNormNet), buffers  # ParityNet has none: nothing to compare


def case_state_dicts_keep_torch_format(rank, world_size):
    """Keys stay the user's own; an optimizer checkpoint loads into plain torch.optim and back."""
    model, optimizer, reference, reference_optimizer = fresh_pair("adamw")
    keys = list(model.state_dict())
    model, optimizer = commsched.prepare(model, optimizer)
    x, y = next(batches(world_size))
    F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
    optimizer.step()
    optimizer.zero_grad()
    assert list(model.state_dict()) == keys
    reference.load_state_dict(model.state_dict())
    reference_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert isinstance(optimizer, torch.optim.AdamW)
    compared = 0
    for a, b in zip(optimizer.state_dict()["state"].values(), reference_optimizer.state_dict()["state"].values(),
                    strict=True):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=0, atol=0)
        compared += 1
    assert compared > 0, "the optimizer has no state after a step"
    optimizer.load_state_dict(copy.deepcopy(reference_optimizer.state_dict()))
    # Training continues identically from the reloaded state on both sides.
    x, y = list(batches(world_size, 2))[1]
    F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(1, rank)), y[rank_slice(rank)]).backward()
    optimizer.step()
    optimizer.zero_grad()
    reference_step(reference, reference_optimizer, x, y, 1, world_size)
    assert_same_parameters(model, reference)


def case_buffers_broadcast_at_forward(rank, world_size):
    """BatchNorm statistics diverge per rank in training and are re-synced by the next forward."""
    torch.manual_seed(0)
    model = BatchNormNet()
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 1, 6, 6) + rank  # different statistics on every rank
    F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long)).backward()
    optimizer.step()
    stats = model.features[1].running_mean.clone()
    others = [torch.empty_like(stats) for _ in range(world_size)]
    torch.distributed.all_gather(others, stats)
    assert not all(torch.equal(o, others[0]) for o in others), "ranks should have diverged"
    model.eval()
    model(x)  # records gradients, so buffers are broadcast from rank 0 first
    assert_equal_on_all_ranks(model)


def parity_grid(rank: int, world_size: int) -> None:
    cases = {}
    for (opt, strategy_name), set_to_none in itertools.product(
        itertools.product(PARITY_OPTIMIZERS, STRATEGIES), (True, False)
    ):
        cases[f"single_process/{opt}/{strategy_name}/set_to_none={set_to_none}"] = functools.partial(
            case_matches_single_process, rank, world_size, opt, STRATEGIES[strategy_name], set_to_none
        )
    cases["no_sync_accumulation"] = functools.partial(case_no_sync_accumulation, rank, world_size)
    cases["backward_twice_without_step"] = functools.partial(case_backward_twice_without_step, rank, world_size)
    for opt in PARITY_OPTIMIZERS:
        cases[f"ddp/{opt}/ParityNet"] = functools.partial(case_matches_ddp, rank, world_size, opt, ParityNet)
    cases["state_dicts_keep_torch_format"] = functools.partial(case_state_dicts_keep_torch_format, rank, world_size)
    cases["buffers_broadcast_at_forward"] = functools.partial(case_buffers_broadcast_at_forward, rank, world_size)
    cases["ddp/sgd_dampening/BatchNormNet"] = functools.partial(
        case_matches_ddp, rank, world_size, "sgd_dampening", BatchNormNet)
    run_subtests(cases)


@pytest.mark.parametrize("world_size", [
    pytest.param(world_size, marks=in_shared_ranks(parity_grid, world_size, timeout_s=300)) for world_size in (2, 3)])
def test_parity_grid(shared_ranks, world_size):
    shared_ranks.result()


def single_rank_is_plain_training(rank: int, world_size: int) -> None:
    for opt in PARITY_OPTIMIZERS:
        model, optimizer, reference, reference_optimizer = fresh_pair(opt)
        model, optimizer = commsched.prepare(model, optimizer)
        for iteration, (x, y) in enumerate(batches(1)):
            F.mse_loss(model(x, use_aux=uses_aux(iteration, 0)), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            reference_step(reference, reference_optimizer, x, y, iteration, 1)
        assert_same_parameters(model, reference, rtol=1e-6, atol=1e-7)


@in_shared_ranks(single_rank_is_plain_training, 1, timeout_s=120)
def test_world_size_one_is_plain_training(shared_ranks):
    shared_ranks.result()

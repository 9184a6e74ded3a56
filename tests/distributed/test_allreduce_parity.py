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
    one_process_backward,
    one_process_step,
    reference_copy,
    run_subtests,
)
from commsched.testing.models import BatchNormNet, ParityNet
from tests.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

PER_RANK_BATCH = 4
ITERATIONS = 6

PARITY_OPTIMIZERS = ("sgd_dampening", "sgd_nesterov", "adam", "adamw")
"""The optimizers of the parity grid, by their names in `commsched.testing.OPTIMIZERS`."""

STRATEGIES = {
    "default": commsched.Strategy(),
    "one_bucket_per_tensor": commsched.Strategy(bucket_cap_mb=1e-6, first_bucket_mb=1e-6),
    "small_buckets": commsched.Strategy(bucket_cap_mb=0.002, first_bucket_mb=0.0005),
}


def uses_aux(iteration: int, rank: int) -> bool:
    """aux is unused on some ranks in some iterations, and on every rank in iteration 3."""
    return iteration % 4 != 3 and (iteration + rank) % 3 != 0


def batches(world_size: int, iterations: int = ITERATIONS):
    generator = torch.Generator().manual_seed(1234)
    for _ in range(iterations):
        n = world_size * PER_RANK_BATCH
        yield torch.randn(n, 8, generator=generator), torch.randn(n, 4, generator=generator)


def rank_slice(rank: int) -> slice:
    return slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)


def share_loss(model, x, y, iteration):
    """``loss_of_share(r)``: rank ``r``'s loss on its slice, routed as rank ``r`` routes it
    (so unused-parameter patterns match)."""
    return lambda r: F.mse_loss(model(x[rank_slice(r)], use_aux=uses_aux(iteration, r)), y[rank_slice(r)])


def reference_backward(model, x, y, iteration, world_size):
    """Single-process backward on the concatenated batch (`commsched.testing.one_process_backward`)."""
    one_process_backward(share_loss(model, x, y, iteration), world_size)


def local_step(model, optimizer, x, y, iteration, rank, set_to_none=True):
    """One distributed training step on this rank's slice of the batch."""
    share_loss(model, x, y, iteration)(rank).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)


def reference_step(model, optimizer, x, y, iteration, world_size, set_to_none=True):
    """One step of single-process training on the concatenated batch (`commsched.testing.one_process_step`)."""
    one_process_step(optimizer, share_loss(model, x, y, iteration), world_size, set_to_none=set_to_none)


def fresh_pair(optimizer_name: str, model_cls=ParityNet):
    """A model, its optimizer, and the single-process reference: a copy and an optimizer of its own."""
    torch.manual_seed(0)
    model = model_cls()
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS[optimizer_name])
    return model, OPTIMIZERS[optimizer_name](model.parameters()), reference, reference_optimizer


def case_matches_single_process(rank, world_size, optimizer_name, strategy, set_to_none):
    """Returns the prepared model (not released)."""
    model, optimizer, reference, reference_optimizer = fresh_pair(optimizer_name)
    model, optimizer = commsched.prepare(model, optimizer, strategy)
    for iteration, (x, y) in enumerate(batches(world_size)):
        local_step(model, optimizer, x, y, iteration, rank, set_to_none)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size, set_to_none)
    assert_same_parameters(model, reference)
    assert_equal_on_all_ranks(model)
    if set_to_none:
        assert model.never_used.weight.grad is None
    return model


def case_no_sync_accumulation(rank, world_size, micro_steps=3, steps=2, strategy=None):
    """Gradients accumulated under no_sync, reduced once by the last backward. Returns the model."""
    model, optimizer, reference, reference_optimizer = fresh_pair("adamw")
    model, optimizer = commsched.prepare(model, optimizer, strategy or commsched.Strategy(bucket_cap_mb=0.002))
    data = list(batches(world_size, iterations=steps * micro_steps))
    for start in range(0, len(data), micro_steps):
        for k in range(micro_steps):
            x, y = data[start + k]
            mine = rank_slice(rank)
            last = k == micro_steps - 1
            context = model.no_sync() if not last else torch.enable_grad()
            with context:
                F.mse_loss(model(x[mine], use_aux=uses_aux(start + k, rank)), y[mine]).backward()
            reference_backward(reference, x, y, start + k, world_size)
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert_same_parameters(model, reference)
    assert_equal_on_all_ranks(model)
    return model


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

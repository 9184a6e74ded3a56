"""Optimizers commsched was not given, param groups added after prepare, low-precision updates.

A second optimizer over some of a prepared model's parameters steps exactly
where no reduction can be in flight and is refused where it would step on
unreduced gradients; ``add_param_group`` after ``prepare`` is refused with the
fix, which is checked to work. bfloat16 and float16 models get torch.optim's
own update on the same dtype, bit for bit.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing import (
    OPTIMIZERS,
    assert_equal_on_all_ranks,
    assert_same_parameters,
    one_process_gradients_as_all_reduce,
    reference_copy,
    run_subtests,
)
from commsched.testing.models import ParityNet
from commsched.testing.parity import batches, rank_slice, reference_backward, uses_aux
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

ITERATIONS = WARMUP_ITERATIONS + 3  # past warm-up: forward overlap is on where possible
NOT_GIVEN = r"optimizer Adam, which was not passed to commsched.prepare\(\), is stepping parameter 'head.weight' of a prepared model"


def body_and_head(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    body = [p for name, p in model.named_parameters() if not name.startswith("head.")]
    return body, [model.head.weight, model.head.bias]


body_optimizer = OPTIMIZERS["sgd_momentum"]
head_optimizer = OPTIMIZERS["adam"]


def two_models():
    """A model and its single-process reference (an unprepared copy; each case builds the optimizers)."""
    torch.manual_seed(0)
    model = ParityNet()
    return model, copy.deepcopy(model)


def train(model, optimizers, rank, world_size, *, reference=None, reference_optimizers=(), between=None,
          iterations=ITERATIONS):
    """Each iteration: this rank's backward, every optimizer's step in the order given, zero_grad;
    the reference does the same single-process on the concatenated batch."""
    for iteration, (x, y) in enumerate(batches(world_size, iterations)):
        mine = rank_slice(rank)
        F.mse_loss(model(x[mine], use_aux=uses_aux(iteration, rank)), y[mine]).backward()
        if between is not None:
            between(iteration)
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()
        if reference is not None:
            reference_backward(reference, x, y, iteration, world_size)
            for optimizer in reference_optimizers:
                optimizer.step()
            for optimizer in reference_optimizers:
                optimizer.zero_grad()


# --------------------------------------------------------------- foreign optimizers
def case_foreign_optimizer_refused_under_overlap(rank, world_size, foreign_first):
    """Default Strategy: the head's own Adam would step on unreduced gradients once overlap
    starts; it is refused at its first step (in warm-up), naming it and the fixes."""
    model, _ = two_models()
    body, head = body_and_head(model)
    head_opt = head_optimizer(head)
    model, body_opt = commsched.prepare(model, body_optimizer(body))
    x, y = next(batches(world_size))
    F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
    if not foreign_first:
        body_opt.step()
    with pytest.raises(RuntimeError, match=NOT_GIVEN) as error:
        head_opt.step()
    message = str(error.value)
    assert "Strategy(overlap_forward=False)" in message and "synchronize()" in message
    assert "param groups" in message
    commsched.release(model)


def case_foreign_optimizer_exact_without_overlap(rank, world_size, strategy, foreign_first):
    """Without forward overlap backward() returns with every gradient averaged: a second
    optimizer (here created after prepare) steps exactly as in single-process training."""
    model, reference = two_models()
    body, _ = body_and_head(model)
    model, body_opt = commsched.prepare(model, body_optimizer(body), strategy)
    head_opt = head_optimizer(body_and_head(model)[1])
    ref_body, ref_head = body_and_head(reference)
    reference_optimizers = [body_optimizer(ref_body), head_optimizer(ref_head)]
    order = [head_opt, body_opt] if foreign_first else [body_opt, head_opt]
    train(model, order, rank, world_size, reference=reference, reference_optimizers=reference_optimizers)
    assert_same_parameters(model, reference)
    assert_equal_on_all_ranks(model)


def case_foreign_optimizer_after_synchronize(rank, world_size):
    """Default Strategy, through warm-up and overlap: synchronize() before the second
    optimizer's step makes it exact."""
    model, reference = two_models()
    body, head = body_and_head(model)
    head_opt = head_optimizer(head)
    model, body_opt = commsched.prepare(model, body_optimizer(body))
    ref_body, ref_head = body_and_head(reference)
    reference_optimizers = [body_optimizer(ref_body), head_optimizer(ref_head)]
    train(model, [body_opt], rank, world_size, reference=reference, reference_optimizers=reference_optimizers,
          between=lambda _: (body_opt.synchronize(), head_opt.step(), head_opt.zero_grad()))
    assert commsched.status(model).lifecycle is commsched.Lifecycle.OVERLAPPING
    assert_same_parameters(model, reference)
    assert_equal_on_all_ranks(model)


def case_own_optimizer_with_prepare_none(rank, world_size):
    """prepare(model, None): the user's own optimizer steps after backward(), which then
    waits for every reduction (no per-bucket updates, so no overlap)."""
    model, reference = two_models()
    model, _ = commsched.prepare(model, None)
    optimizer = body_optimizer(model.parameters())
    train(model, [optimizer], rank, world_size, reference=reference,
          reference_optimizers=[body_optimizer(reference.parameters())])
    assert_same_parameters(model, reference)


def case_second_unprepared_model(rank, world_size):
    """An optimizer over another, unprepared model (a teacher, an EMA) is left alone, with
    forward overlap running on the prepared one."""
    model, reference = two_models()
    model, optimizer = commsched.prepare(model, head_optimizer(model.parameters()))
    torch.manual_seed(1)
    other = nn.Linear(8, 4)
    other_reference = copy.deepcopy(other)
    other_opt, other_ref_opt = body_optimizer(other.parameters()), body_optimizer(other_reference.parameters())
    generator = torch.Generator().manual_seed(5 + rank)

    def step_other(_):
        x = torch.randn(4, 8, generator=generator)
        for m, o in ((other, other_opt), (other_reference, other_ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()

    train(model, [optimizer], rank, world_size, reference=reference,
          reference_optimizers=[head_optimizer(reference.parameters())], between=step_other)
    assert commsched.status(model).lifecycle is commsched.Lifecycle.OVERLAPPING
    assert_same_parameters(model, reference)
    compared = 0
    for a, e in zip(other.parameters(), other_reference.parameters(), strict=True):
        assert torch.equal(a, e)
        compared += 1
    assert compared == 2  # nn.Linear's weight and bias


def case_plain_optimizer_after_release(rank, world_size):
    """Once released, the model trains locally: a plain optimizer over the same parameters steps."""
    model, _ = two_models()
    model, optimizer = commsched.prepare(model, body_optimizer(model.parameters()))
    train(model, [optimizer], rank, world_size)
    commsched.release(model)
    local = ParityNet()
    local.load_state_dict(model.state_dict())  # a plain model holding the released values
    plain, plain_local = head_optimizer(model.parameters()), head_optimizer(local.parameters())
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for m, o in ((model, plain), (local, plain_local)):
        F.mse_loss(m(x), y).backward()
        o.step()
    compared = 0
    for (name, a), (_, e) in zip(model.named_parameters(), local.named_parameters(), strict=True):
        assert torch.equal(a, e), name
        compared += 1
    assert compared > 0


def case_foreign_optimizer_in_a_gradient_hook(rank, world_size):
    """An optimizer stepped from a gradient hook (optimizer in backward) would step before
    the reduction, with overlap or without: refused."""
    model, _ = two_models()
    body, head = body_and_head(model)
    head_opt = OPTIMIZERS["adam_no_decay"](head)
    model, body_opt = commsched.prepare(model, body_optimizer(body), commsched.Strategy(overlap_forward=False))
    model.head.weight.register_post_accumulate_grad_hook(lambda p: head_opt.step())
    x, y = next(batches(world_size))
    with pytest.raises(RuntimeError, match=NOT_GIVEN + " during a backward pass"):
        F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()


def case_foreign_optimizer_with_parameter_servers(rank, world_size):
    """The servers hold the values and run the optimizer: a worker's own optimizer is refused."""
    model, _ = two_models()
    body, head = body_and_head(model)
    head_opt = head_optimizer(head)
    strategy = commsched.Strategy(backend=commsched.ParameterServer(num_servers=1))
    if commsched.is_server_rank(1):
        commsched.serve(model, body_optimizer(body), strategy)
        return  # the last rank served until the worker released the model
    model, body_opt = commsched.prepare(model, body_optimizer(body), strategy)
    try:
        x, y = next(batches(1))
        F.mse_loss(model(x), y).backward()
        body_opt.step()
        with pytest.raises(RuntimeError, match=NOT_GIVEN + r"\. With Strategy\(backend=ParameterServer"):
            head_opt.step()
    finally:
        commsched.release(model)


# ---------------------------------------------------------------------- param groups
def case_add_param_group_refused(rank, world_size):
    """The new group would never be updated: refused with the fix; allowed after release()."""
    model, _ = two_models()
    body, head = body_and_head(model)
    model, optimizer = commsched.prepare(model, body_optimizer(body))
    with pytest.raises(RuntimeError, match=r"add_param_group\(\) was called on an optimizer already passed to "
                                           r"commsched.prepare\(\)") as error:
        optimizer.add_param_group({"params": head})
    assert "lr=0" in str(error.value)
    assert len(optimizer.param_groups) == 1
    commsched.release(model)
    optimizer.add_param_group({"params": head})
    assert len(optimizer.param_groups) == 2


def case_group_with_lr_zero_trains_later(rank, world_size):
    """The fix the error names: the head's group starts with lr=0 and gets a learning rate
    after warm-up, under forward overlap; the same as single-process training doing so."""
    model, reference = two_models()

    def groups(m):
        body, head = body_and_head(m)
        return torch.optim.Adam([{"params": body}, {"params": head, "lr": 0.0}], lr=1e-2)

    model, optimizer = commsched.prepare(model, groups(model))
    reference_optimizer = groups(reference)
    initial_head = model.head.weight.detach().clone()

    def unfreeze(iteration):
        if iteration == WARMUP_ITERATIONS:
            optimizer.synchronize()
            assert torch.equal(model.head.weight, initial_head)
            for o in (optimizer, reference_optimizer):
                o.param_groups[1]["lr"] = 1e-2

    train(model, [optimizer], rank, world_size, reference=reference, reference_optimizers=[reference_optimizer],
          between=unfreeze, iterations=ITERATIONS + 2)
    assert commsched.status(model).lifecycle is commsched.Lifecycle.OVERLAPPING
    assert not torch.equal(model.head.weight, initial_head)
    assert_same_parameters(model, reference)


# ------------------------------------------------------------------- low precision
class LowPrecisionNet(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


LOW_PRECISION_OPTIMIZERS = ("sgd_momentum", "adam_eps_1e-4", "adamw_eps_1e-4")
"""By their names in `commsched.testing.OPTIMIZERS`: Adam's eps at 1e-4, which bfloat16 and float16 hold."""


def case_low_precision_matches_torch_optim(rank, world_size, dtype, optimizer_name):
    """Default Strategy (fused updates requested), through warm-up and overlap: the
    parameters are torch.optim's on the same dtype, bit for bit."""
    torch.manual_seed(0)
    model = LowPrecisionNet(dtype)
    make = OPTIMIZERS[optimizer_name]
    reference, reference_optimizer = reference_copy(model, make)
    model, optimizer = commsched.prepare(model, make(model.parameters()))
    for x, y in batches(world_size, ITERATIONS):
        x, y = x.to(dtype), y.to(dtype)
        F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
        optimizer.step()
        optimizer.zero_grad()
        # Gradients averaged as the all-reduce averages them, so that the update alone is compared.
        one_process_gradients_as_all_reduce(
            reference, lambda r, x=x, y=y: F.mse_loss(reference(x[rank_slice(r)]), y[rank_slice(r)]), world_size)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert commsched.status(model).lifecycle is commsched.Lifecycle.OVERLAPPING
    model.state_dict()  # waits for the last updates
    compared = 0
    for (name, a), (_, e) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert a.dtype == dtype
        assert torch.equal(a, e), f"'{name}' differs from torch.optim by up to {(a - e).abs().max().item():.3g}"
        compared += 1
    assert compared > 0
    state, reference_state = optimizer.state_dict()["state"], reference_optimizer.state_dict()["state"]
    assert reference_state.keys() == state.keys() and reference_state, "no optimizer state to compare"
    compared = 0
    for index, entries in reference_state.items():
        for key, value in entries.items():
            assert torch.equal(state[index][key], value), f"state[{index}][{key!r}] differs"
            compared += 1
    assert compared > 0, "the optimizer state holds nothing to compare"


def optimizers_grid(rank: int, world_size: int) -> None:
    cases = {
        "foreign/refused_under_overlap": functools.partial(
            case_foreign_optimizer_refused_under_overlap, rank, world_size, False),
        "foreign/refused_under_overlap/foreign_first": functools.partial(
            case_foreign_optimizer_refused_under_overlap, rank, world_size, True),
        "foreign/after_synchronize": functools.partial(case_foreign_optimizer_after_synchronize, rank, world_size),
        "foreign/prepare_none": functools.partial(case_own_optimizer_with_prepare_none, rank, world_size),
        "foreign/second_unprepared_model": functools.partial(case_second_unprepared_model, rank, world_size),
        "foreign/plain_optimizer_after_release": functools.partial(
            case_plain_optimizer_after_release, rank, world_size),
        "foreign/parameter_servers": functools.partial(case_foreign_optimizer_with_parameter_servers, rank, world_size),
        "param_groups/add_param_group_refused": functools.partial(case_add_param_group_refused, rank, world_size),
        "param_groups/lr_zero_trains_later": functools.partial(case_group_with_lr_zero_trains_later, rank, world_size),
    }
    for label, strategy in {
        "no_overlap": commsched.Strategy(overlap_forward=False),
        "no_overlap_unfused": commsched.Strategy(overlap_forward=False, fuse_optimizer=False),
    }.items():
        for foreign_first in (False, True):
            cases[f"foreign/exact_{label}/foreign_first={foreign_first}"] = functools.partial(
                case_foreign_optimizer_exact_without_overlap, rank, world_size, strategy, foreign_first)
    for dtype in (torch.bfloat16, torch.float16):
        for name in LOW_PRECISION_OPTIMIZERS:
            cases[f"low_precision/{str(dtype).removeprefix('torch.')}/{name}"] = functools.partial(
                case_low_precision_matches_torch_optim, rank, world_size, dtype, name)
    # Last: it leaves a backward pass that raised behind it.
    cases["foreign/in_a_gradient_hook"] = functools.partial(case_foreign_optimizer_in_a_gradient_hook, rank, world_size)
    run_subtests(cases)


@in_shared_ranks(optimizers_grid, 2, timeout_s=300)
def test_optimizers_grid(shared_ranks):
    shared_ranks.result()

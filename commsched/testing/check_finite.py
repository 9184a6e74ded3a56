"""``Strategy(check_finite=...)`` cases: one rank's inf skips the step on every rank, then warns
or raises (tests/distributed/test_check_finite.py says what they check; tests/gpu runs them on
CUDA, the reduce-scattered suite `case_skipped_on_every_rank` with its strategy).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing.mixed_precision import case as scaled_case
from commsched.testing.models import ParityNet
from commsched.testing.parity import batches, rank_slice, reference_step, uses_aux
from commsched.testing.reference import OPTIMIZERS, assert_equal_on_all_ranks, assert_same_parameters, reference_copy
from commsched.testing.subtests import run_subtests


ITERATIONS = 8


INF_AT = (1, WARMUP_ITERATIONS + 2)
"""In warm-up, and after it (with forward overlap, where the strategy has it)."""


def rank_with_inf(world_size: int) -> int:
    """The rank whose gradients get the inf: rank 1, or rank 0 where it is alone."""
    return min(1, world_size - 1)


def loss_with_inf(model, x, y, iteration, rank, inf_at=INF_AT, inf_rank=1):
    """Rank ``rank``'s loss; at ``inf_at`` on rank ``inf_rank``, ``head.bias`` gets an inf gradient."""
    loss = F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(iteration, rank)), y[rank_slice(rank)])
    if rank == inf_rank and iteration in inf_at:
        loss = loss + model.head.bias.sum() * float("inf")
    return loss


def named_in(message: str, iteration: int, rank: int, inf_rank: int, device: str) -> None:
    """``message`` names rank ``inf_rank``, ``iteration`` and ``head.bias``.

    On CUDA the verdict reaches the host without waiting for the averaged gradients
    (see `commsched.engine.finite`), so each rank names the parameters of the buckets
    where it found one itself: ``inf_rank`` names them (``head.bias`` among them),
    the others none.
    """
    where = f"on rank(s) {inf_rank} in iteration {iteration}"
    if device == "cpu":
        assert f"{where}; the averaged gradients of 'head.bias' hold them" in message, message
    elif rank == inf_rank:
        assert f"{where}; this rank's gradients of " in message and "'head.bias'" in message, message
    else:
        assert f"{where}. The step was skipped" in message, message


class Messages(logging.Handler):
    """The warnings commsched logs, kept."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def case_skipped_on_every_rank(rank, world_size, optimizer_name, strategy, device="cpu", names_checked=True,
                               check_prepared=None):
    """``names_checked``: the messages name ``head.bias`` (see `named_in`); ``check_prepared``: called with
    the prepared model at the end, before it is released."""
    torch.manual_seed(0)
    model = ParityNet().to(device)
    inf_rank = rank_with_inf(world_size)
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS[optimizer_name])
    model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), strategy)
    messages = Messages()
    logging.getLogger("commsched").addHandler(messages)
    try:
        for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
            x, y = x.to(device), y.to(device)
            loss_with_inf(model, x, y, iteration, rank, inf_rank=inf_rank).backward()
            optimizer.step()
            optimizer.zero_grad()
            if iteration in INF_AT:
                reference_optimizer.zero_grad()  # one process skips the step
            else:
                reference_step(reference, reference_optimizer, x, y, iteration, world_size)
        optimizer.synchronize()
    finally:
        logging.getLogger("commsched").removeHandler(messages)
    assert_same_parameters(model, reference, rtol=1e-5, atol=1e-6)
    assert_equal_on_all_ranks(model)
    skipped = [m for m in messages.messages if "gradients with inf or NaN" in m]
    assert len(skipped) == len(INF_AT), messages.messages
    for iteration, message in zip(INF_AT, skipped, strict=True):
        if names_checked:
            named_in(message, iteration, rank, inf_rank, device)
        else:
            assert f"on rank(s) {inf_rank} in iteration {iteration}" in message, message
    status = commsched.status(model)
    if strategy.overlap_forward and world_size > 1 and optimizer_name != "rmsprop":
        assert status.overlapping, status  # the second inf came with updates pending at the gates
    if check_prepared is not None:
        check_prepared(model)
    commsched.release(model)


def case_raised_at_the_next_synchronisation(rank, world_size, strategy, device="cpu"):
    torch.manual_seed(0)
    model = ParityNet().to(device)
    inf_rank = rank_with_inf(world_size)
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS["adamw"])
    model, optimizer = commsched.prepare(model, OPTIMIZERS["adamw"](model.parameters()), strategy)
    raised_at = None
    stop = INF_AT[-1]
    for iteration, (x, y) in enumerate(batches(world_size, stop + 2)):
        x, y = x.to(device), y.to(device)
        try:
            loss_with_inf(model, x, y, iteration, rank, inf_at=(stop,), inf_rank=inf_rank).backward()
            optimizer.step()
        except commsched.NonFiniteGradients as error:
            raised_at = iteration, str(error)
            break
        optimizer.zero_grad()
        if iteration < stop:
            reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    # Raised at step() without overlap (one replica has none), else as the next backward pass
    # began; every rank alike.
    assert raised_at is not None, "nothing was raised"
    overlapping = strategy.overlap_forward and world_size > 1
    assert raised_at[0] == (stop if not overlapping else stop + 1), raised_at
    named_in(raised_at[1], stop, rank, inf_rank, device)
    assert "The step was skipped on every rank" in raised_at[1]
    commsched.release(model)
    model.zero_grad()  # the step that raised came before it
    assert_same_parameters(model, reference, rtol=1e-5, atol=1e-6)


def case_grad_scaler_rules(rank, world_size, device="cpu"):
    """The scaler's infs (its scale grows until they come) skip its steps; nothing is raised."""
    scaled_case(world_size, rank, commsched.Strategy(check_finite="raise"), "sgd_momentum", "scaled", device)()


def case_bfloat16_skipped(rank, world_size, device="cpu"):
    """bfloat16 gradients (GradScaler's inf check has no bfloat16 kernel on CUDA): the step with
    an inf leaves every parameter as it was, on every rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model = model.to(device, torch.bfloat16)
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         commsched.Strategy(check_finite="skip"))
    inf_rank, unchanged = rank_with_inf(world_size), 0
    for iteration in range(ITERATIONS):
        x = torch.randn(4, 8, device=device, dtype=torch.bfloat16)
        loss = model(x).float().square().mean()
        if rank == inf_rank and iteration in INF_AT:
            loss = loss + model[2].bias.float().sum() * float("inf")
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]  # a read: waits for pending updates
        optimizer.step()
        optimizer.zero_grad()
        after = [p.detach().clone() for p in model.parameters()]
        same = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert same == (iteration in INF_AT), f"iteration {iteration}: parameters unchanged: {same}"
        unchanged += same
    assert unchanged == len(INF_AT), unchanged
    assert_equal_on_all_ranks(model)
    commsched.release(model)


def check_finite(rank: int, world_size: int, device: str = "cpu") -> None:
    """Every case, with the models and data on ``device``."""
    cases = {}
    strategies = {
        "default": commsched.Strategy(check_finite="skip"),
        "no_overlap_unfused": commsched.Strategy(check_finite="skip", overlap_forward=False, fuse_optimizer=False),
        "small_partitions": commsched.Strategy(check_finite="skip", partition_mb=0.0005, credit_mb=0.001,
                                               adaptive=False),
    }
    for label, strategy in strategies.items():
        for optimizer_name in ("sgd_momentum", "adamw"):
            cases[f"skip/{label}/{optimizer_name}"] = functools.partial(
                case_skipped_on_every_rank, rank, world_size, optimizer_name, strategy, device)
    cases["skip/rmsprop_steps_itself"] = functools.partial(
        case_skipped_on_every_rank, rank, world_size, "rmsprop", commsched.Strategy(check_finite="skip"), device)
    for label, strategy in (("overlap", commsched.Strategy(check_finite="raise")),
                            ("no_overlap", commsched.Strategy(check_finite="raise", overlap_forward=False))):
        cases[f"raise/{label}"] = functools.partial(case_raised_at_the_next_synchronisation, rank, world_size,
                                                   strategy, device)
    cases["grad_scaler_rules"] = functools.partial(case_grad_scaler_rules, rank, world_size, device)
    cases["bfloat16"] = functools.partial(case_bfloat16_skipped, rank, world_size, device)
    run_subtests(cases)

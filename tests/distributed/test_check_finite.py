"""``Strategy(check_finite=...)``: one rank's inf or NaN skips the step on every rank, then warns or raises.

Rank 1 alone puts an inf into one parameter's gradient at some iterations, in
warm-up (no forward overlap) and after it (updates pending at the gates). The
run must end with the parameters of one process that skipped exactly those
steps, on every kernel path (torch's fused kernels take the verdict on the
device; the others skip on the host; an optimizer without per-bucket updates
steps itself), and name rank 1 and the parameter. Under a ``GradScaler`` the
scaler's verdict rules, and nothing is raised.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing import OPTIMIZERS, assert_equal_on_all_ranks, assert_same_parameters, reference_copy
from commsched.testing import run_subtests
from commsched.testing.models import ParityNet
from tests.distributed.test_allreduce_parity import batches, rank_slice, reference_step, uses_aux
from tests.distributed.test_mixed_precision import case as scaled_case
from tests.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

ITERATIONS = 8
INF_AT = (1, WARMUP_ITERATIONS + 2)
"""In warm-up, and after it (with forward overlap, where the strategy has it)."""


def loss_with_inf(model, x, y, iteration, rank, inf_at=INF_AT):
    """Rank ``rank``'s loss; at ``inf_at`` on rank 1, ``head.bias`` gets an inf gradient."""
    loss = F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(iteration, rank)), y[rank_slice(rank)])
    if rank == 1 and iteration in inf_at:
        loss = loss + model.head.bias.sum() * float("inf")
    return loss


class Messages(logging.Handler):
    """The warnings commsched logs, kept."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def case_skipped_on_every_rank(rank, world_size, optimizer_name, strategy):
    torch.manual_seed(0)
    model = ParityNet()
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS[optimizer_name])
    model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), strategy)
    messages = Messages()
    logging.getLogger("commsched").addHandler(messages)
    try:
        for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
            loss_with_inf(model, x, y, iteration, rank).backward()
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
        assert f"on rank(s) 1 in iteration {iteration}; the averaged gradients of 'head.bias' hold them" in message, (
            message)
    commsched.release(model)


def case_raised_at_the_next_synchronisation(rank, world_size, strategy):
    torch.manual_seed(0)
    model = ParityNet()
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS["adamw"])
    model, optimizer = commsched.prepare(model, OPTIMIZERS["adamw"](model.parameters()), strategy)
    raised_at = None
    stop = INF_AT[-1]
    for iteration, (x, y) in enumerate(batches(world_size, stop + 2)):
        try:
            loss_with_inf(model, x, y, iteration, rank, inf_at=(stop,)).backward()
            optimizer.step()
        except commsched.NonFiniteGradients as error:
            raised_at = iteration, str(error)
            break
        optimizer.zero_grad()
        if iteration < stop:
            reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    # Raised at step() without overlap, else as the next backward pass began; every rank alike.
    assert raised_at is not None, "nothing was raised"
    assert raised_at[0] == (stop if not strategy.overlap_forward else stop + 1), raised_at
    assert f"on rank(s) 1 in iteration {stop}; the averaged gradients of 'head.bias' hold them" in raised_at[1]
    assert "The step was skipped on every rank" in raised_at[1]
    commsched.release(model)
    model.zero_grad()  # the step that raised came before it
    assert_same_parameters(model, reference, rtol=1e-5, atol=1e-6)


def case_grad_scaler_rules(rank, world_size):
    """The scaler's infs (its scale grows until they come) skip its steps; nothing is raised."""
    scaled_case(world_size, rank, commsched.Strategy(check_finite="raise"), "sgd_momentum", "scaled")()


def check_finite(rank: int, world_size: int) -> None:
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
                case_skipped_on_every_rank, rank, world_size, optimizer_name, strategy)
    cases["skip/rmsprop_steps_itself"] = functools.partial(
        case_skipped_on_every_rank, rank, world_size, "rmsprop", commsched.Strategy(check_finite="skip"))
    for label, strategy in (("overlap", commsched.Strategy(check_finite="raise")),
                            ("no_overlap", commsched.Strategy(check_finite="raise", overlap_forward=False))):
        cases[f"raise/{label}"] = functools.partial(case_raised_at_the_next_synchronisation, rank, world_size,
                                                   strategy)
    cases["grad_scaler_rules"] = functools.partial(case_grad_scaler_rules, rank, world_size)
    run_subtests(cases)


@in_shared_ranks(check_finite, 2, timeout_s=240)
def test_check_finite(shared_ranks):
    shared_ranks.result()

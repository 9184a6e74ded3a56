"""Mixed precision: ``torch.amp.GradScaler`` and bf16 autocast train exactly like one process.

The scaler's steps are checked where they matter: a step skipped on an inf/NaN
(the first one, while momentum buffers do not exist yet, and later ones), the
scale it backs off and grows again, an explicit ``scaler.unscale_`` before
clipping, for every update path (fused per bucket, per bucket with the param
group's own kernel, the user's optimizer stepping itself with and without its
own scaling support). Infs come from the data, so one process sees them too.
``tests/gpu/`` runs the same cases on CUDA.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import commsched
from commsched.engine.reducer import ONE_REPLICA_REASON
from commsched.testing import OPTIMIZERS, one_process_loss, reference_copy, run_subtests
from commsched.update.grad_scaling import GRAD_SCALER_REASON
from tests.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

PER_RANK = 4
ITERATIONS = 10
"""Past warm-up (3 iterations) and the plan, so every later phase is exercised."""
INF_AT = (0, 4, 7)
"""Iterations whose batch holds an inf: the scaler skips them and halves its scale."""
SLOW_RANK_S = 0.2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.hidden = nn.Sequential(nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(self.first(x)))


STRATEGIES = {
    "default": commsched.Strategy(),
    "no overlap": commsched.Strategy(overlap_forward=False),
    "no priority": commsched.Strategy(priority=False),
    "unfused, no overlap": commsched.Strategy(fuse_optimizer=False, overlap_forward=False),
    "small partitions": commsched.Strategy(partition_mb=0.001, credit_mb=0.002, adaptive=False),
}


def train(model, optimizer, world_size, rank, loop, scaler=None, device="cpu"):
    """``ITERATIONS`` steps on rank ``rank``'s slice of each batch, or (None) on the whole batch.

    Returns the parameters and the scale after each step.
    """
    generator = torch.Generator().manual_seed(11)
    scales = []
    for iteration in range(ITERATIONS):
        x = torch.randn(world_size * PER_RANK, 8, generator=generator)
        y = torch.randn(world_size * PER_RANK, 4, generator=generator)
        x, y = x.to(device), y.to(device)
        if scaler is not None and iteration in INF_AT:
            x[1, 3] = float("inf")  # rank 0's sample: only rank 0 produces the inf
            if rank == 0:
                # A slow rank 0: rank 1's reductions are still in flight when it reaches step(),
                # so a scaler that checked rank 1's own gradients would find no inf there.
                time.sleep(SLOW_RANK_S)

        def loss_of_share(r: int, x=x, y=y) -> torch.Tensor:
            return F.mse_loss(model(x[r * PER_RANK:(r + 1) * PER_RANK]), y[r * PER_RANK:(r + 1) * PER_RANK])

        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=loop == "bf16 autocast"):
            loss = one_process_loss(loss_of_share, world_size) if rank is None else loss_of_share(rank)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            if loop == "unscale and clip":
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        optimizer.zero_grad()
    if hasattr(optimizer, "synchronize"):
        optimizer.synchronize()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, scales


def new_scaler(device: str = "cpu") -> torch.amp.GradScaler:
    return torch.amp.GradScaler(torch.device(device).type, init_scale=2.0**16, growth_interval=2)


def case(world_size, rank, strategy, optimizer_name, loop, device="cpu"):
    def run() -> None:
        torch.manual_seed(0)
        model = Net().to(device)
        reference, reference_optimizer = reference_copy(model, OPTIMIZERS[optimizer_name])
        scaled = loop != "bf16 autocast"
        model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), strategy)
        got, got_scales = train(model, optimizer, world_size, rank, loop, new_scaler(device) if scaled else None,
                                device)
        status = commsched.status(model)
        commsched.release(model)
        want, want_scales = train(reference, reference_optimizer, world_size, None, loop,
                                  new_scaler(device) if scaled else None, device)
        assert got_scales == want_scales  # the same steps skipped, on every rank
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if scaled else {"rtol": 2e-2, "atol": 2e-3}
        assert want.keys() == got.keys() and want, "nothing to compare"
        for name, value in want.items():
            assert torch.isfinite(got[name]).all(), name
            torch.testing.assert_close(got[name], value, **tolerance, msg=lambda m, n=name: f"{n}: {m}")
        if strategy.overlap_forward and optimizer_name != "rmsprop" and world_size == 1:
            assert status.overlap_off_reason == ONE_REPLICA_REASON
        elif scaled and strategy.overlap_forward and optimizer_name != "rmsprop":
            assert status.overlap_off_reason == GRAD_SCALER_REASON

    return run


def scaler_first_seen_after_warmup(rank: int, world_size: int, device: str = "cpu") -> None:
    """With reductions in flight, the scaler's inf check read gradients not yet averaged: refused."""
    torch.manual_seed(0)
    model = Net().to(device)
    model, optimizer = commsched.prepare(model, OPTIMIZERS["sgd_momentum"](model.parameters()), commsched.Strategy())
    x, y = torch.randn(PER_RANK, 8, device=device), torch.randn(PER_RANK, 4, device=device)
    try:
        for _ in range(5):
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert commsched.status(model).overlapping
        scaler = new_scaler(device)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        with pytest.raises(RuntimeError, match=r"GradScaler stepped this optimizer for the first time after warm-up"):
            scaler.step(optimizer)
        assert not hasattr(optimizer, "found_inf")  # a plain step() afterwards is not taken for a scaled one
    finally:
        commsched.release(model)


def mixed_precision_cases(rank: int, world_size: int, device: str = "cpu") -> None:
    cases = {}
    for label, strategy in STRATEGIES.items():
        for optimizer_name in ("sgd_momentum", "adam_no_decay"):
            cases[f"{label} {optimizer_name} scaler"] = case(
                world_size, rank, strategy, optimizer_name, "plain", device)
        cases[f"{label} sgd_momentum unscale and clip"] = case(
            world_size, rank, strategy, "sgd_momentum", "unscale and clip", device)
    for optimizer_name in ("adamw_fused", "rmsprop"):
        for label in ("default", "unfused, no overlap"):
            cases[f"{label} {optimizer_name} scaler"] = case(
                world_size, rank, STRATEGIES[label], optimizer_name, "plain", device)
    for label in ("default", "no overlap"):
        cases[f"{label} sgd_momentum bf16 autocast"] = case(
            world_size, rank, STRATEGIES[label], "sgd_momentum", "bf16 autocast", device)
    if world_size > 1:  # one rank has nothing in flight
        cases["scaler first seen after warm-up"] = lambda: scaler_first_seen_after_warmup(rank, world_size, device)
    run_subtests(cases)


@in_shared_ranks(mixed_precision_cases, 2, timeout_s=400)
def test_mixed_precision_matches_one_process(shared_ranks):
    shared_ranks.result()


@in_shared_ranks(mixed_precision_cases, 1, timeout_s=400)
def test_mixed_precision_one_rank(shared_ranks):
    """The cases tests/gpu runs on one NCCL rank, here on CPU."""
    shared_ranks.result()

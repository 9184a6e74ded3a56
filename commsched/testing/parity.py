"""The parity harness of commsched's own tests, for tests of code built on it too: a model that
leaves a parameter unused on some ranks in some iterations, every rank's batch, and the step of
one process on the concatenated batch to compare with.

    model = case_matches_single_process(rank, world_size, "adamw", commsched.Strategy(), True)

Each case runs on a rank (`commsched.testing.run_ranks`), asserts the parameters equal one
process's and every rank's, and returns the prepared model (not released).
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing.models import ParityNet
from commsched.testing.reference import (
    OPTIMIZERS,
    assert_equal_on_all_ranks,
    assert_same_parameters,
    one_process_backward,
    one_process_step,
    reference_copy,
)

PER_RANK_BATCH = 4
ITERATIONS = 6

PARITY_OPTIMIZERS = ("sgd_dampening", "sgd_nesterov", "adam", "adamw")
"""The optimizers of the parity grid, by their names in `commsched.testing.OPTIMIZERS`."""

PARITY_STRATEGIES = {
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



TINY_PARTITION_MB = 256 / 2**20     # cuts ParityNet's tensors into many partitions
TINY_CREDIT_MB = 512 / 2**20
SCHEDULING_ITERATIONS = WARMUP_ITERATIONS + 4
"""Several iterations with the plan and with overlap."""

SCHEDULING_OPTIMIZERS = ("sgd_nesterov", "adam", "adamw")
"""The optimizers of the scheduling grid, by their names in `commsched.testing.OPTIMIZERS`."""



def train_and_compare(rank, world_size, optimizer_name, strategy, iterations=SCHEDULING_ITERATIONS, delays=None,
                      device="cpu", before_prepare=None):
    """`case_matches_single_process` on ``device`` under ``strategy``: ``delays(iteration)`` runs before
    each iteration, ``before_prepare(model)`` before the model is prepared. Returns the prepared model."""
    torch.manual_seed(0)
    model = ParityNet().to(device)
    if before_prepare is not None:
        before_prepare(model)
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS[optimizer_name])
    model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), strategy)
    for iteration, (x, y) in enumerate(batches(world_size, iterations)):
        x, y = x.to(device), y.to(device)
        mine = rank_slice(rank)
        if delays is not None:
            delays(iteration)
        F.mse_loss(model(x[mine], use_aux=uses_aux(iteration, rank)), y[mine]).backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    assert_same_parameters(model, reference)
    assert_equal_on_all_ranks(model)
    return model


def random_delays(rank: int, world_size: int, device: str = "cpu", strategy: commsched.Strategy | None = None,
                  iterations: int = 120) -> None:
    """4 ranks, each with its own random compute delays in forward and backward:
    issue timing differs everywhere, the agreed order must still hold."""
    rng = random.Random(1000 + rank)
    strategy = strategy or commsched.Strategy(
        partition_mb=TINY_PARTITION_MB, credit_mb=TINY_CREDIT_MB, bucket_cap_mb=0.004, first_bucket_mb=0.001
    )
    holder = {}

    def delays(iteration):
        model = holder.get("model")
        if model is None:
            return
        holder["sleeps"] = {name: rng.random() < 0.3 for name in ("embed", "blocks", "head")}

    def slow_forward(name):
        def hook(module, args):
            if holder.get("sleeps", {}).get(name):
                time.sleep(rng.uniform(0, 0.004))
        return hook

    def slow_backward(name):
        def hook(module, grad_input, grad_output):
            if holder.get("sleeps", {}).get(name):
                time.sleep(rng.uniform(0, 0.004))
        return hook

    def slowed(model):
        for name in ("embed", "blocks", "head"):
            getattr(model, name).register_forward_pre_hook(slow_forward(name))
            getattr(model, name).register_full_backward_hook(slow_backward(name))
        holder["model"] = model

    train_and_compare(rank, world_size, "adamw", strategy, iterations=iterations, delays=delays, device=device,
                      before_prepare=slowed)

"""``Strategy(autotune=True)`` on a tiny budget, and training checked in lockstep with one process
at every iteration while the tuner lays the buckets out anew.

Its strategy needs optuna (``pip install commsched[tune]``): import this module where it is there.
"""

from __future__ import annotations

import copy
import functools
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing.loops import PER_RANK, norm_penalty
from commsched.testing.models import CheckpointedNet
from commsched.testing.parity import TINY_CREDIT_MB, TINY_PARTITION_MB
from commsched.testing.reference import OPTIMIZERS, assert_same_parameters, one_process_loss, reference_copy


TUNE = commsched.Strategy(partition_mb=TINY_PARTITION_MB, credit_mb=TINY_CREDIT_MB, bucket_cap_mb=0.004,
                          first_bucket_mb=0.001, autotune=True, autotune_iterations=12,
                          autotune_trial_iterations=1)
"""Six settings of two iterations each: tuned (and the best adopted) at iteration 15."""


TUNED_BY = WARMUP_ITERATIONS + TUNE.autotune_iterations + 2


ITERATIONS = TUNED_BY + 3


class UsedValues:
    """The parameter values each module computed with, per iteration: checked at every iteration
    without waiting for anything (a wait would hide a stale value under forward overlap)."""

    def __init__(self, model: torch.nn.Module):
        self.iterations: list[dict[str, torch.Tensor]] = [{}]
        for prefix, module in model.named_modules():
            own = [(f"{prefix}.{n}" if prefix else n, p) for n, p in module.named_parameters(recurse=False)]
            if own:
                module.register_forward_hook(functools.partial(self._record, own))

    def _record(self, own, module, args, output) -> None:
        for name, param in own:  # the first use only: a recomputation in backward uses the same values
            self.iterations[-1].setdefault(name, param.detach().clone())

    def next_iteration(self) -> None:
        self.iterations.append({})

    def assert_same_as(self, reference: UsedValues) -> None:
        assert len(self.iterations) == len(reference.iterations)
        compared = 0
        for iteration, (mine, theirs) in enumerate(zip(self.iterations[:-1], reference.iterations[:-1])):
            assert mine and mine.keys() <= theirs.keys(), iteration  # a module unused on this rank ran elsewhere
            for name, value in mine.items():
                torch.testing.assert_close(value, theirs[name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, i=iteration: f"iteration {i}, {n}: {m}")
            compared += 1
        assert compared > 0, "no iteration recorded"


def settings_seen(model: torch.nn.Module) -> list[tuple[str, object]]:
    """This iteration's tuning state as this rank sees it, to compare across ranks."""
    status = commsched.status(model)
    tuning = status.tuning
    if tuning is None:  # a strategy without the auto-tuner
        return [(None, None, status.partitions, status.overlap_off_reason, 0)]
    return [(tuning.phase, tuning.current, status.partitions, status.overlap_off_reason, len(tuning.trials))]


def assert_tuned_the_same_everywhere(model: torch.nn.Module, seen: list, min_changes: int = 3) -> None:
    """Several layouts were tried; every rank has the same history and the same settings in the same order."""
    status = commsched.status(model)
    tuning = status.tuning
    assert tuning.phase == "tuned", tuning.reason
    layouts = {(s.partition_mb, s.credit_mb, s.bucket_cap_mb, s.first_bucket_mb) for _, s in tuning.changes}
    assert len(tuning.changes) >= min_changes and len(layouts) >= 2, tuning.changes
    if tuning.searches == 1:
        assert tuning.trials[0].setting == tuning.changes[0][1]  # the starting point ran first
    mine = (seen, tuning.changes, [(t.setting, t.median_ms) for t in tuning.trials], tuning.reason)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    assert all(other == mine for other in everyone), "the ranks disagree on the tuning"


def train_in_lockstep(rank, world_size, loop, reentrant=None, optimizer_name="sgd_momentum", strategy=TUNE,
                      iterations=ITERATIONS, slow_rank0_from=None):
    """CheckpointedNet with a loop of test_training_loops, against one process, compared at every iteration
    (the values each module computed with) and at the end.

    ``slow_rank0_from``: a callable of the model telling when rank 0's forward
    pass starts to sleep (a slower link or host, as far as iteration times go).
    Returns the prepared model and the tuning state this rank saw at each iteration (`settings_seen`).
    """
    torch.manual_seed(0)
    model = CheckpointedNet(reentrant, "middle")
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS[optimizer_name])
    model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), strategy)
    slow = {"s": 0.0}
    if rank == 0 and slow_rank0_from is not None:
        model.register_forward_pre_hook(lambda module, args: time.sleep(slow["s"]))
    used, reference_used = UsedValues(model), UsedValues(reference)
    generator = torch.Generator().manual_seed(7)
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference_ema = copy.deepcopy(ema)
    seen = []
    iteration = 0
    while iteration < iterations:
        x = torch.randn(world_size * PER_RANK, 8, generator=generator)
        y = torch.randn(world_size * PER_RANK, 4, generator=generator)

        def loss_of_share(net, r, x=x, y=y):
            return F.mse_loss(net(x[r * PER_RANK:(r + 1) * PER_RANK]), y[r * PER_RANK:(r + 1) * PER_RANK])

        for net, opt, loss_of, averages in (
            (model, optimizer, lambda: loss_of_share(model, rank), ema),
            (reference, reference_optimizer,
             lambda: one_process_loss(functools.partial(loss_of_share, reference), world_size), reference_ema),
        ):
            penalty = norm_penalty(net) if loop == "penalty_before_forward" else 0.0
            loss = loss_of()
            (loss + penalty).backward()
            opt.step()
            opt.zero_grad()
            if loop == "step_without_backward" and iteration % 2 == 1:
                opt.step()  # no gradients: torch changes nothing
            if loop == "ema_after_step":
                with torch.no_grad():
                    for n, p in net.named_parameters():
                        averages[n].mul_(0.5).add_(p, alpha=0.5)
        seen += settings_seen(model)
        used.next_iteration()
        reference_used.next_iteration()
        assert reference_ema.keys() == ema.keys() and ema
        for n, value in reference_ema.items():
            torch.testing.assert_close(ema[n], value, rtol=1e-5, atol=1e-6)
        iteration += 1
        if slow_rank0_from is not None:
            iterations = slow_rank0_from(model, iteration, slow, iterations)
    assert iteration > 0
    used.assert_same_as(reference_used)
    assert_same_parameters(model, reference, rtol=1e-5, atol=1e-6)
    return model, seen

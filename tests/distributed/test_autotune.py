"""Strategy(autotune=True) lays the buckets out anew many times in the middle of training: results stay exact.

A tiny budget (one measured iteration per setting, a dozen iterations in all)
makes each case take seconds while the layout, the plan and forward overlap
change every other iteration; each case checks that they did, and that every
rank saw the same sequence of settings.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing import (
    OPTIMIZERS,
    assert_equal_on_all_ranks,
    assert_same_parameters,
    one_process_loss,
    reference_copy,
    run_subtests,
)
from commsched.testing.models import ParityNet
from commsched.testing.parity import (
    TINY_CREDIT_MB,
    TINY_PARTITION_MB,
    batches,
    case_no_sync_accumulation,
    local_step,
    reference_step,
)
from commsched.testing.loops import PER_RANK, norm_penalty
from commsched.testing.models import CheckpointedNet
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

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


def case_parity(rank, world_size, optimizer_name, set_to_none, check_every_iteration=True):
    """ParityNet (two dtypes, parameters unused on some ranks, one never used): exact at every iteration."""
    torch.manual_seed(0)
    model = ParityNet()
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS[optimizer_name])
    model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), TUNE)
    used, reference_used = UsedValues(model), UsedValues(reference)
    seen = []
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        local_step(model, optimizer, x, y, iteration, rank, set_to_none)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size, set_to_none)
        seen += settings_seen(model)
        if check_every_iteration:
            assert_same_parameters(model, reference, rtol=1e-5, atol=1e-6)
        used.next_iteration()
        reference_used.next_iteration()
    used.assert_same_as(reference_used)
    assert_same_parameters(model, reference, rtol=1e-5, atol=1e-6)
    assert_equal_on_all_ranks(model)
    assert_tuned_the_same_everywhere(model, seen)
    commsched.release(model)


LOOPS = ("plain", "step_without_backward", "penalty_before_forward", "ema_after_step")


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


def case_loop(rank, world_size, loop, reentrant=None, optimizer_name="sgd_momentum"):
    model, seen = train_in_lockstep(rank, world_size, loop, reentrant, optimizer_name)
    assert_tuned_the_same_everywhere(model, seen)
    commsched.release(model)


def case_no_sync_across_switch_points(rank, world_size):
    """Gradients accumulated under no_sync in one layout are reduced in the next (every switch point)."""
    model = case_no_sync_accumulation(rank, world_size, micro_steps=2, steps=ITERATIONS, strategy=TUNE)
    assert_tuned_the_same_everywhere(model, [])
    commsched.release(model)


def slow_down_after_tuning(model, iteration, slow, iterations):
    """Once tuned and settled, rank 0's forward pass sleeps; run until the re-tune has ended."""
    tuning = commsched.status(model).tuning
    if slow["s"] == 0.0 and tuning.baseline_ms is not None:
        slow["s"] = max(0.05, 2 * tuning.baseline_ms / 1e3)
        slow["from"] = iteration
    if tuning.searches == 2 and tuning.phase == "tuned":
        return iteration  # done
    return iterations


def drift_retunes(rank, world_size) -> list[str]:
    """A slower rank 0 re-tunes, exactly; returns what the status said while re-tuning (why)."""
    texts = []

    def watch(model, iteration, slow, iterations):
        tuning = commsched.status(model).tuning
        if tuning.phase == "re-tuning":
            texts.append(tuning.reason)
        return slow_down_after_tuning(model, iteration, slow, iterations)

    model, seen = train_in_lockstep(rank, world_size, "plain", iterations=200, slow_rank0_from=watch)
    tuning = commsched.status(model).tuning
    assert tuning.searches == 2 and tuning.phase == "tuned", tuning.reason
    reasons = [entry for entry in seen if entry[0] == "re-tuning"]
    assert reasons, "no re-tune"
    assert_tuned_the_same_everywhere(model, seen, min_changes=1)
    commsched.release(model)
    return texts


def cases(rank: int, world_size: int) -> None:
    all_cases = {}
    # Each optimizer once, and both ways of zeroing gradients (buckets kept or made anew at a switch).
    for optimizer_name, set_to_none in (("sgd_dampening", True), ("adam", False), ("adamw", True)):
        all_cases[f"parity, {optimizer_name}, set_to_none={set_to_none}"] = functools.partial(
            case_parity, rank, world_size, optimizer_name, set_to_none)
    all_cases["parity, adam, compared at the end only (gates under overlap)"] = functools.partial(
        case_parity, rank, world_size, "adam", True, check_every_iteration=False)
    for loop in LOOPS:
        all_cases[f"loop {loop}"] = functools.partial(case_loop, rank, world_size, loop)
    all_cases["non-reentrant checkpoints, adam"] = functools.partial(
        case_loop, rank, world_size, "plain", False, "adam")
    all_cases["no_sync accumulation across switch points"] = functools.partial(
        case_no_sync_across_switch_points, rank, world_size)
    run_subtests(all_cases)


@in_shared_ranks(cases, 2, timeout_s=500)
def test_training_is_exact_across_every_change_of_the_tuned_setting(shared_ranks):
    shared_ranks.result()


@in_shared_ranks(drift_retunes, 2, timeout_s=300)
def test_a_slower_rank_0_re_tunes_exactly_and_says_why(shared_ranks):
    """Once part of the test above (exact across a re-tune) and a run of its own (the reason): one run."""
    texts = shared_ranks.result()
    assert texts[0] == texts[1] and texts[0]
    assert texts[0][0].startswith("re-tuning: iteration time rose "), texts[0][0]


def tuned_setting_without_overlap(rank: int, world_size: int) -> str:
    """overlap_forward=False: every setting tried keeps it off."""
    strategy = dataclasses.replace(TUNE, overlap_forward=False)
    model, seen = train_in_lockstep(rank, world_size, "plain", strategy=strategy)
    tuning = commsched.status(model).tuning
    assert tuning.changes and all(not setting.overlap_forward for _, setting in tuning.changes)
    assert_tuned_the_same_everywhere(model, seen)
    commsched.release(model)
    return tuning.reason


@in_shared_ranks(tuned_setting_without_overlap, 2, timeout_s=120)
def test_overlap_is_never_switched_on_when_the_strategy_has_it_off(shared_ranks):
    texts = shared_ranks.result()
    assert len(texts) == 2
    for text in texts:
        assert text.startswith("tuned: "), text

"""Strategy(autotune=True) lays the buckets out anew many times in the middle of training: results stay exact.

A tiny budget (one measured iteration per setting, a dozen iterations in all)
makes each case take seconds while the layout, the plan and forward overlap
change every other iteration; each case checks that they did, and that every
rank saw the same sequence of settings.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import commsched
from commsched.testing import (
    OPTIMIZERS,
    assert_equal_on_all_ranks,
    assert_same_parameters,
    reference_copy,
    run_subtests,
)
from commsched.testing.autotune import (
    ITERATIONS,
    TUNE,
    UsedValues,
    assert_tuned_the_same_everywhere,
    settings_seen,
    train_in_lockstep,
)
from commsched.testing.models import ParityNet
from commsched.testing.parity import (
    batches,
    case_no_sync_accumulation,
    local_step,
    reference_step,
)
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed


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

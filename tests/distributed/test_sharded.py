"""Sharded optimizer state (``AllReduce(shard_optimizer=True)``) trains exactly like one process.

Every case compares with single-process training on the concatenated batch:
SGD (momentum, Nesterov, weight decay), Adam and AdamW; 2 and 3 ranks, so
buckets whose size is not a multiple of the world size split parameters
between ranks; every scheduling path; the loops of test_training_loops,
``no_sync``, ``GradScaler``, LR schedulers, clipping, the auto-tuner's
layouts. Checkpoints are torch.optim's, loadable by any world size. Each rank
holds only its part of the state. Under ``Join`` the parameters and state are
torch DDP's.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import itertools
import os
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join

import commsched
import commsched.layout.shards
import commsched.update.sharded
from commsched.bench.memory import fix_mmap_threshold, own_peak_rss_mib
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.layout.grad_layout import GradLayout, build_layout
from commsched.testing import (
    OPTIMIZERS,
    assert_equal_on_all_ranks,
    assert_same_parameters,
    one_process_step,
    reference_copy,
    run_subtests,
)
from commsched.testing.models import ParityNet
from commsched.testing.parity import (
    PARITY_OPTIMIZERS,
    batches,
    case_matches_single_process,
    case_no_sync_accumulation,
    local_step,
    rank_slice,
    reference_backward,
    reference_step,
    uses_aux,
)
from commsched.testing.loops import LOOPS, case as loop_case
from commsched.testing.internals import record_updates
from commsched.testing.launch import rank_store
from commsched.testing.join import batch_counts, batches_of, loss_of, out_during_warmup, train_until_one_rank_is_out
from commsched.testing.memory import resident_mib
from commsched.testing.mixed_precision import case as mixed_precision_case
from commsched.testing.sharded import (
    SHARDED,
    STRATEGIES,
    case_autotune_switch_points,
    case_uneven_inputs_under_join,
    sharded,
    sharded_on_device,
    sharded_with_random_delays,
)
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed


AFTER_RESTART = {"rtol": 1e-6, "atol": 1e-8}
"""A restarted run may lay its buckets out otherwise (its first forward pass takes another path),
so a parameter's fragments start elsewhere; torch's fused CPU kernels round an element by its
position in the tensor they are given (vector body or tail): a unit in the last place. With three
ranks gloo's ring also sums some elements in another order, on the unsharded backend too."""


def state_tensors_bytes(state) -> int:
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def trained(rank, world_size, optimizer_name, strategy, iterations):
    """A sharded model and its single-process reference after ``iterations`` steps of ParityNet."""
    torch.manual_seed(0)
    model = ParityNet()
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS[optimizer_name])
    model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), strategy)
    for iteration, (x, y) in enumerate(batches(world_size, iterations)):
        local_step(model, optimizer, x, y, iteration, rank)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    return model, optimizer, reference, reference_optimizer


# ------------------------------------------------------------------ state
def case_each_rank_holds_its_part(rank, world_size, optimizer_name):
    """The optimizer keeps no state of its own; the ranks' parts add up to the whole, each
    about 1/N of it (at most one chunk per bucket more); status says so."""
    model, optimizer, reference, reference_optimizer = trained(
        rank, world_size, optimizer_name, STRATEGIES["small_buckets"], iterations=6)
    assert_same_parameters(model, reference)
    assert len(optimizer.state) == 0, "the optimizer holds state of its own"
    sharding = commsched.status(model).sharding
    assert sharding is not None and sharding.world_size == world_size and sharding.rank == rank
    parts = [None] * world_size
    dist.all_gather_object(parts, (sharding.state_bytes, sharding.owned_elements))
    whole = state_tensors_bytes(reference_optimizer.state)
    # The first bucket the forward pass needs is small here: every rank holds it whole.
    assert len(sharding.whole_buckets) == 1, sharding
    kept_everywhere = sharding.chunk_elements[sharding.whole_buckets[0]]
    owned_everywhere = sum(owned for _, owned in parts)
    assert whole > 0 and owned_everywhere == sharding.total_elements + (world_size - 1) * kept_everywhere
    assert sum(state_bytes for state_bytes, _ in parts) >= whole  # every part is somewhere (and steps besides)
    at_most_per_element = 2 * 8  # two float64 moments
    one_chunk_per_bucket = at_most_per_element * sum(sharding.chunk_elements)
    steps = 4 * len(sharding.chunk_elements) * 8  # a float32 step per fragment, a few fragments per bucket
    assert sharding.state_bytes <= whole / world_size + one_chunk_per_bucket + steps, (sharding, whole)
    assert "sharded over" in commsched.status(model).describe()
    commsched.release(model)


def case_checkpoint_in_torch_format(rank, world_size, optimizer_name):
    """``state_dict()`` gathers torch.optim's format on every rank (equal to the reference's);
    loaded into plain torch.optim (one process: another world size) and back into a sharded
    run, both continue as an uninterrupted run (see `AFTER_RESTART`)."""
    strategy = dataclasses.replace(STRATEGIES["small_buckets"], adaptive=False)
    model, optimizer, reference, reference_optimizer = trained(rank, world_size, optimizer_name, strategy, 5)
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert len(optimizer.state) == 0 or not strategy.shards_optimizer, "state_dict() left the whole state"
    want = reference_optimizer.state_dict()
    assert saved_optimizer["param_groups"] == want["param_groups"]
    assert saved_optimizer["state"].keys() == want["state"].keys() and want["state"]
    for index, state in want["state"].items():
        assert saved_optimizer["state"][index].keys() == state.keys()
        for key, value in state.items():
            torch.testing.assert_close(saved_optimizer["state"][index][key], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, i=index, k=key: f"state {i} {k}: {m}")
    more = list(batches(world_size, 8))[5:]

    def go_on(net, opt, distributed):
        for iteration, (x, y) in enumerate(more, start=5):
            if distributed:
                local_step(net, opt, x, y, iteration, rank)
            else:
                reference_step(net, opt, x, y, iteration, world_size)
        if distributed:
            opt.synchronize()
        return {n: p.detach().clone() for n, p in net.named_parameters()}

    uninterrupted = go_on(model, optimizer, distributed=True)
    torch.manual_seed(1)
    plain = ParityNet()
    plain.load_state_dict(saved_model)
    plain_optimizer = OPTIMIZERS[optimizer_name](plain.parameters())
    plain_optimizer.load_state_dict(copy.deepcopy(saved_optimizer))
    resumed_plain = go_on(plain, plain_optimizer, distributed=False)
    torch.manual_seed(2)
    again = ParityNet()
    again.load_state_dict(saved_model)
    again_optimizer = OPTIMIZERS[optimizer_name](again.parameters())
    again, again_optimizer = commsched.prepare(again, again_optimizer, strategy)
    again_optimizer.load_state_dict(copy.deepcopy(saved_optimizer))
    resumed_sharded = go_on(again, again_optimizer, distributed=True)
    for name, value in uninterrupted.items():
        exact = AFTER_RESTART
        torch.testing.assert_close(resumed_sharded[name], value, **exact, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(resumed_plain[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    commsched.release(model)
    commsched.release(again)


def case_state_made_before_prepare(rank, world_size):
    """An optimizer that already stepped (or loaded a checkpoint) before prepare() keeps its state."""
    torch.manual_seed(0)
    model = ParityNet()
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS["adam"])
    optimizer = OPTIMIZERS["adam"](model.parameters())
    data = list(batches(world_size, 6))
    x, y = data[0]
    for net, opt in ((model, optimizer), (reference, reference_optimizer)):
        reference_step(net, opt, x, y, 0, world_size)
    model, optimizer = commsched.prepare(model, optimizer, STRATEGIES["small_buckets"])
    for iteration, (x, y) in enumerate(data[1:], start=1):
        local_step(model, optimizer, x, y, iteration, rank)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    assert_same_parameters(model, reference)
    commsched.release(model)


def case_release_hands_back_the_state(rank, world_size):
    """After ``commsched.release`` the optimizer holds its whole state and steps on its own."""
    model, optimizer, reference, reference_optimizer = trained(rank, world_size, "adamw", STRATEGIES["default"], 5)
    commsched.release(model)
    assert state_tensors_bytes(optimizer.state) == state_tensors_bytes(reference_optimizer.state)
    x, y = list(batches(world_size, 6))[5]
    for net, opt in ((model, optimizer), (reference, reference_optimizer)):
        reference_step(net, opt, x, y, 5, world_size)  # the same whole batch on every rank
    assert_same_parameters(model, reference)


# ------------------------------------------------------------------ loops
def case_lr_scheduler_and_clipping(rank, world_size, clip_after_synchronize):
    """A scheduler stepped after each step, and ``clip_grad_norm_`` between backward and step
    (it reads the whole averaged gradients, which every rank holds)."""
    torch.manual_seed(0)
    model = ParityNet()
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS["adamw"])
    model, optimizer = commsched.prepare(model, OPTIMIZERS["adamw"](model.parameters()), STRATEGIES["small_buckets"])
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (optimizer, reference_optimizer)]
    for iteration, (x, y) in enumerate(batches(world_size, 8)):
        F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(iteration, rank)), y[rank_slice(rank)]).backward()
        if clip_after_synchronize:
            optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
        reference_backward(reference, x, y, iteration, world_size)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
    assert_same_parameters(model, reference)
    assert_equal_on_all_ranks(model)
    status = commsched.status(model)
    assert (status.overlap_off_reason is None) == clip_after_synchronize, status.overlap_off_reason
    commsched.release(model)


def case_values_used_by_every_forward(rank, world_size, strategy, optimizer_name, loop="plain"):
    """The values each module computes with are the single-process ones at every iteration,
    under forward overlap (the all-gathers end at the gates, whatever order the forward runs)."""
    from commsched.testing.autotune import train_in_lockstep  # which needs optuna (tests/gpu runs without)

    model, _ = train_in_lockstep(rank, world_size, loop, optimizer_name=optimizer_name, strategy=strategy,
                                 iterations=8)
    commsched.release(model)


def case_autotune_under_join(rank, world_size):
    """The auto-tuner's new layouts come while ranks are out of batches under ``Join``: they
    reshard along in their shadowed iterations, and the state stays DDP's."""
    from commsched.testing.autotune import TUNE, TUNED_BY

    # Rank 0 trains past the end of tuning; the others run out two iterations after warm-up,
    # so the tuner's trials from the second on, and its final choice, come while they are out
    # (which of those change the buckets follows the measured times; several always do).
    counts = [TUNED_BY + 6] + [WARMUP_ITERATIONS + 2] * (world_size - 1)

    def laid_out_anew_while_out(model) -> None:
        while_out = [setting for iteration, setting in commsched.status(model).tuning.changes
                     if iteration >= min(counts)]
        assert len(while_out) >= 2, commsched.status(model).tuning.changes

    case_uneven_inputs_under_join(rank, world_size, "adam", dataclasses.replace(TUNE, backend=SHARDED),
                                  counts=lambda n: counts, check_prepared=laid_out_anew_while_out)


def case_first_bucket_whole_when_small(rank, world_size):
    """The bucket the forward pass needs first is kept whole on every rank when it is small and
    not the only one ([Note: the first bucket is not sharded]); a large one is sharded."""
    def whole_buckets(first_width: int, strategy: commsched.Strategy) -> tuple[int, ...]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(first_width, 8), torch.nn.Linear(8, 4))
        model, optimizer = commsched.prepare(model, torch.optim.Adam(model.parameters()), strategy)
        for _ in range(2):
            model(torch.randn(2, first_width)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        sharding = commsched.status(model).sharding
        commsched.release(model)
        return tuple(sharding.chunk_elements[b] for b in sharding.whole_buckets)

    two_buckets = sharded(bucket_cap_mb=1e-4, first_bucket_mb=1e-4, adaptive=False)
    assert whole_buckets(16, two_buckets) == (16 * 8 + 8,)
    large = commsched.layout.shards.WHOLE_FIRST_BUCKET_BYTES // 4 // 8 + 1  # just over the limit
    assert whole_buckets(large, two_buckets) == ()
    assert whole_buckets(16, sharded(adaptive=False)) == ()  # one bucket: sharded, whatever its size


class _HeldBackward(torch.autograd.Function):
    """The identity, whose backward first calls ``hold()``."""

    @staticmethod
    def forward(ctx, x, hold):
        ctx.hold = hold
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hold()
        return grad, None


class _InputLayerLate(torch.nn.Module):
    """A small input layer whose gradients can come late (``hold``), before larger layers."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.rest = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        self.hold: Callable[[], None] | None = None

    def forward(self, x):
        hidden = self.first(x)
        return self.rest(_HeldBackward.apply(hidden, self.hold) if self.hold else hidden)


UPDATED_AHEAD_WITHIN_S = 30.0


def case_next_buckets_updated_while_the_whole_one_is_reduced(rank, world_size):
    """A rank whose first gate waits for the whole first bucket's reduction (one rank's input layer
    comes late) updates the buckets after it meanwhile, and starts their all-gathers ([Note:
    updates ahead of a local bucket]); every rank's parameters stay the single process's.

    Rank 1's input layer comes late by as long as it takes the other ranks to update every other
    bucket (they say so through the job's store), or `UPDATED_AHEAD_WITHIN_S` where they never do:
    no timing decides the order."""
    torch.manual_seed(0)
    model = _InputLayerLate()
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS["adamw"])
    strategy = sharded(priority=False, bucket_cap_mb=0.001, first_bucket_mb=0.0005, adaptive=False, timeout_s=60)
    model, optimizer = commsched.prepare(model, OPTIMIZERS["adamw"](model.parameters()), strategy)
    whole = commsched.status(model).sharding.whole_buckets
    others = len(commsched.status(model).buckets) - len(whole)
    store, key = rank_store(), "updated-ahead-of-the-whole-bucket/{}".format
    late = WARMUP_ITERATIONS + 1
    updated: list[int] = []

    def say_when_the_others_are_updated(bucket: int) -> None:
        if len([b for b in updated if b not in whole]) == others and not set(whole) & set(updated):
            store.set(key(rank), "1")

    def wait_for_the_other_ranks() -> None:
        try:
            store.wait([key(r) for r in range(world_size) if r != 1],
                       datetime.timedelta(seconds=UPDATED_AHEAD_WITHIN_S))
        except (RuntimeError, dist.DistError):
            pass  # they never updated ahead: their assertion below says so

    generator = torch.Generator().manual_seed(7)
    for iteration in range(late + 3):
        x, y = torch.randn(2 * world_size, 8, generator=generator), torch.randn(2 * world_size, 4, generator=generator)

        def loss_of(r, network=model):
            return F.mse_loss(network(x[2 * r:2 * r + 2]), y[2 * r:2 * r + 2])

        model.hold = wait_for_the_other_ranks if iteration == late and rank == 1 else None
        loss = loss_of(rank)
        if iteration == late:  # from this step's updates on, which the next forward pass runs
            record_updates(model, updated, after=say_when_the_others_are_updated if rank != 1 else None)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        one_process_step(reference_optimizer, functools.partial(loss_of, network=reference), world_size)
    assert_same_parameters(model, reference)  # on every rank before any assertion of one: it all-gathers
    commsched.release(model)
    assert len(whole) == 1 and len(updated) >= 3, (whole, updated)
    if rank != 1:
        assert updated.index(whole[0]) > 0, f"the whole bucket was updated first: {updated}"


def case_with_first_bucket_sharded(case) -> None:
    """``case()`` with every bucket sharded, the first one the forward pass needs included."""
    with mock.patch.object(commsched.layout.shards, "WHOLE_FIRST_BUCKET_BYTES", 0):
        case()


# ------------------------------------------------------------------ refusals
def case_refusals(rank, world_size):
    """What cannot be sharded is refused at prepare(), before any collective, with the fix."""
    model = ParityNet()
    with pytest.raises(ValueError, match=r"cannot shard this optimizer's state: RMSprop has no per-bucket update.*"
                                         r"use one of them, or AllReduce\(\) \(unsharded\)"):
        commsched.prepare(model, torch.optim.RMSprop(model.parameters()), sharded())
    with pytest.raises(ValueError, match=r"no optimizer was given to prepare\(\); pass it as"):
        commsched.prepare(model, None, sharded())
    with pytest.raises(ValueError, match=r"AllReduce.shard_optimizer must be True or False, got 1"):
        commsched.AllReduce(shard_optimizer=1)
    assert not isinstance(model, commsched.CommschedModule)
    model, _ = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), sharded())
    second = ParityNet()
    second, _ = commsched.prepare(second, torch.optim.SGD(second.parameters(), lr=0.1), sharded())
    gathers = commsched.status(model).process_groups.parameters
    assert gathers is not None and commsched.status(second).process_groups.parameters is gathers  # one per group
    commsched.release(second)
    commsched.release(model)


# ------------------------------------------------------------------ Join


def case_join_ends_early_then_training_goes_on(rank, world_size):
    """``Join(throw_on_early_termination=True)`` raises on every rank once one is out of batches;
    the loop then goes on without ``Join``, in step on every rank, and ends equal everywhere."""
    torch.manual_seed(0)
    model = ParityNet()
    model, optimizer = commsched.prepare(model, torch.optim.Adam(model.parameters()),
                                         sharded(bucket_cap_mb=0.002, first_bucket_mb=0.0005, timeout_s=60))
    train_until_one_rank_is_out(model, optimizer, rank, world_size)
    for x, y in batches_of(rank + 10, 3, (8,), None):
        loss_of(model, x, y, None).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_equal_on_all_ranks(model)
    commsched.release(model)


def case_join_refuses_a_step_without_backward(rank, world_size):
    """A second ``step()`` on the same gradients inside ``Join`` would start all-gathers that ranks
    out of batches never join: refused at once, on every rank, with the fix."""
    torch.manual_seed(0)
    model = ParityNet()
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05), sharded())
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) without a new backward pass .* inside Join with "
                                           r"sharded optimizer state.*Step once per backward pass"):
        with Join([model]):
            for x, y in batches_of(rank, 2, (8,), None):
                loss_of(model, x, y, None).backward()
                optimizer.step()
            optimizer.step()
    commsched.release(model)


GRID = {
    2: ("default", "one_bucket_per_tensor", "no_priority", "unfused"),
    3: ("small_buckets", "tiny_partitions_and_credit", "no_overlap"),
}
"""The strategies of the parity grid per world size: together, every one of `STRATEGIES`; with
three ranks, chunks split parameters and end in padding."""


def sharded_grid(rank: int, world_size: int) -> None:
    cases = {}
    for optimizer_name, label in itertools.product(PARITY_OPTIMIZERS, GRID[world_size]):
        cases[f"single_process/{optimizer_name}/{label}"] = functools.partial(
            case_matches_single_process, rank, world_size, optimizer_name, STRATEGIES[label], True)
    for optimizer_name in ("sgd_nesterov", "adamw"):
        cases[f"single_process/{optimizer_name}/{GRID[world_size][-1]}/first_bucket_sharded"] = functools.partial(
            case_with_first_bucket_sharded, functools.partial(
                case_matches_single_process, rank, world_size, optimizer_name, STRATEGIES[GRID[world_size][-1]], True))
    cases["first_bucket_whole_when_small"] = functools.partial(case_first_bucket_whole_when_small, rank, world_size)
    cases["next_buckets_updated_while_the_whole_one_is_reduced"] = functools.partial(
        case_next_buckets_updated_while_the_whole_one_is_reduced, rank, world_size)
    cases["single_process/sgd_nesterov/set_to_none=False"] = functools.partial(
        case_matches_single_process, rank, world_size, "sgd_nesterov", STRATEGIES["small_buckets"], False)
    for optimizer_name in ("sgd_momentum", "adamw"):
        cases[f"each_rank_holds_its_part/{optimizer_name}"] = functools.partial(
            case_each_rank_holds_its_part, rank, world_size, optimizer_name)
        cases[f"checkpoint_in_torch_format/{optimizer_name}"] = functools.partial(
            case_checkpoint_in_torch_format, rank, world_size, optimizer_name)
    cases["no_sync_accumulation"] = functools.partial(
        case_no_sync_accumulation, rank, world_size, strategy=STRATEGIES["small_buckets"])
    cases["state_made_before_prepare"] = functools.partial(case_state_made_before_prepare, rank, world_size)
    cases["release_hands_back_the_state"] = functools.partial(case_release_hands_back_the_state, rank, world_size)
    for clip_after_synchronize in (False, True):
        cases[f"lr_scheduler_and_clipping/synchronize={clip_after_synchronize}"] = functools.partial(
            case_lr_scheduler_and_clipping, rank, world_size, clip_after_synchronize)
    for label in ("default", "tiny_partitions_and_credit", "no_priority"):
        cases[f"values_used_by_every_forward/{label}"] = functools.partial(
            case_values_used_by_every_forward, rank, world_size, STRATEGIES[label], "adam")
    cases["refusals"] = functools.partial(case_refusals, rank, world_size)
    join_cases = {"adam/small_buckets": ("adam", "small_buckets", batch_counts, False),
                  "sgd_momentum/no_overlap": ("sgd_momentum", "no_overlap", batch_counts, False),
                  "adam, two groups, tensor lr/no_overlap": ("adam_two_groups_tensor_lr", "no_overlap", batch_counts,
                                                             False),
                  "adam/small_buckets/GradScaler": ("adam_no_decay", "small_buckets", batch_counts, True),
                  "sgd_nesterov/default/out_during_warmup": ("sgd_nesterov", "default", out_during_warmup, False)}
    for name, (optimizer_name, label, counts, scaler) in join_cases.items():
        cases[f"join/{name}"] = functools.partial(case_uneven_inputs_under_join, rank, world_size, optimizer_name,
                                                  STRATEGIES[label], counts, scaler)
    cases["join/adamw/default/no_sync accumulation"] = functools.partial(
        case_uneven_inputs_under_join, rank, world_size, "adamw", STRATEGIES["default"], accumulate=True)
    cases["join/ends_early_then_training_goes_on"] = functools.partial(
        case_join_ends_early_then_training_goes_on, rank, world_size)
    cases["join/step_without_backward_refused"] = functools.partial(
        case_join_refuses_a_step_without_backward, rank, world_size)
    run_subtests(cases)


@pytest.mark.parametrize("world_size", [
    pytest.param(world_size, marks=in_shared_ranks(sharded_grid, world_size, timeout_s=400)) for world_size in (2, 3)])
def test_sharded_grid(shared_ranks, world_size):
    shared_ranks.result()


def sharded_loops(rank: int, world_size: int) -> None:
    """The loops of test_training_loops, mixed precision and the auto-tuner, on sharded state."""
    cases = {}
    for label in ("default", "no_overlap"):
        prepare = functools.partial(commsched.prepare, strategy=STRATEGIES[label])
        for reentrant in (True, False):
            cases[f"{label} {'reentrant' if reentrant else 'non_reentrant'} checkpoint"] = loop_case(
                world_size, rank, "plain", "sgd_momentum", reentrant, "last", prepare)
        for loop in LOOPS[1:]:
            cases[f"{label} {loop}"] = loop_case(world_size, rank, loop, "adam", prepare=prepare)
    for label in ("default", "no_overlap"):
        strategy = STRATEGIES[label]
        cases[f"{label} GradScaler"] = mixed_precision_case(world_size, rank, strategy, "adam_no_decay", "plain")
        cases[f"{label} GradScaler, unscale and clip"] = mixed_precision_case(
            world_size, rank, strategy, "sgd_momentum", "unscale and clip")
    cases["autotune switch points"] = functools.partial(case_autotune_switch_points, rank, world_size)
    cases["autotune switch points under Join"] = functools.partial(case_autotune_under_join, rank, world_size)
    cases["on the CPU device"] = functools.partial(sharded_on_device, rank, world_size, "cpu")
    run_subtests(cases)


@in_shared_ranks(sharded_loops, 2, timeout_s=400)
def test_sharded_training_loops(shared_ranks):
    shared_ranks.result()


@in_shared_ranks(sharded_on_device, 1, "cpu", timeout_s=300)
def test_sharded_state_on_one_rank(shared_ranks):
    """One rank (where the GPU tests run NCCL): nothing to reduce, every loop still exact."""
    shared_ranks.result()


@in_shared_ranks(sharded_with_random_delays, 4, timeout_s=300)
def test_sharded_random_delays_on_four_ranks(shared_ranks):
    shared_ranks.result()


def sharded_checkpoints(rank: int, world_size: int, directory: str) -> None:
    """``save_sharded_state`` / ``load_sharded_state`` through torch.distributed.checkpoint: each
    rank writes and reads only its part; a restart loading it (before its first forward pass)
    continues bit for bit as the uninterrupted run; a run with another bucket layout reads the
    same state; without sharding it is refused with the fix."""

    def case(optimizer_name: str) -> None:
        strategy = dataclasses.replace(STRATEGIES["small_buckets"], adaptive=False)
        model, optimizer, _, _ = trained(rank, world_size, optimizer_name, strategy, 5)
        path = os.path.join(directory, optimizer_name)
        optimizer.save_sharded_state(path)
        assert len(optimizer.state) == 0, "saving gathered the state"
        saved_model, saved_state = copy.deepcopy(model.state_dict()), optimizer.state_dict()
        written = sorted(os.listdir(path))
        assert f"__{rank}_0.distcp" in written and ".metadata" in written, written
        more = list(batches(world_size, 8))[5:]
        for iteration, (x, y) in enumerate(more, start=5):
            local_step(model, optimizer, x, y, iteration, rank)
        optimizer.synchronize()
        torch.manual_seed(7)
        again = ParityNet()
        again.load_state_dict(saved_model)
        again, again_optimizer = commsched.prepare(again, OPTIMIZERS[optimizer_name](again.parameters()), strategy)
        again_optimizer.load_sharded_state(path)  # before the first forward pass: once the buckets exist
        for iteration, (x, y) in enumerate(more, start=5):
            local_step(again, again_optimizer, x, y, iteration, rank)
        again_optimizer.synchronize()
        for (name, got), want in zip(again.named_parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(got, want, **AFTER_RESTART, msg=lambda m, n=name: f"{n}: {m}")
        commsched.release(again)
        other = ParityNet()
        other, other_optimizer = commsched.prepare(
            other, OPTIMIZERS[optimizer_name](other.parameters()), sharded(bucket_cap_mb=1e-6, first_bucket_mb=1e-6))
        other(next(batches(world_size))[0][:2])  # lays the buckets out, one per tensor
        other_optimizer.load_sharded_state(path)
        loaded = other_optimizer.state_dict()
        assert loaded["param_groups"] == saved_state["param_groups"]
        assert loaded["state"].keys() == saved_state["state"].keys() and saved_state["state"]
        for index, state in saved_state["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(loaded["state"][index][key], value, rtol=0, atol=0)
        commsched.release(other)
        plain = ParityNet()
        plain, plain_optimizer = commsched.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
        with pytest.raises(ValueError, match=r"sharded checkpoints need Strategy\(backend=AllReduce\("
                                             r"shard_optimizer=True\)\)"):
            plain_optimizer.save_sharded_state(path)
        commsched.release(plain)
        commsched.release(model)

    run_subtests({name: functools.partial(case, name) for name in ("sgd_nesterov", "adam")})


@in_shared_ranks(sharded_checkpoints, 2, timeout_s=200, tmp_dir=True)
def test_sharded_checkpoints(shared_ranks):
    shared_ranks.result()


RESHARD_WIDTH, RESHARD_LAYERS = 512, 32
"""1 MiB per parameter, Adam's state 64 MiB in all: far above what else a new layout allocates."""
RESHARD_CAPS_MB = (4.5, 2.5)
"""Buckets of four parameters, then of two: every rank's fragments change."""


def reset_peak_rss() -> None:
    """Linux: from now on ``ru_maxrss`` is the peak since this call."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def resharding_rise(rank: int, world_size: int, caps_mb: tuple[float, float] = RESHARD_CAPS_MB,
                    held_by_a_graph: bool = False) -> dict | None:
    """[Note: resharding one bucket at a time] The sharded update policy on its own: Adam steps
    on one layout, then the buckets are laid out anew (as the cost model's choice and the
    auto-tuner's switch points do) and every rank's fragments change. How far the peak RSS rose
    above the RSS before, from the new layout to the end of the first update in it, while the
    parameters and the state moved; afterwards the parameters and the whole state must be
    single-process Adam's. ``held_by_a_graph``: as in training, the new layout comes between a
    forward pass, whose graph holds every parameter, and its backward pass ([Note: a new layout
    is cut after the backward pass]). None where glibc's mmap threshold cannot be fixed (then
    freed blocks stay resident and the peak says nothing)."""
    if not fix_mmap_threshold():
        return None
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(RESHARD_WIDTH, RESHARD_WIDTH)) for _ in range(RESHARD_LAYERS)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer, reference_optimizer = torch.optim.Adam(params, lr=1e-3), torch.optim.Adam(reference, lr=1e-3)
    updates = commsched.update.sharded.ShardedUpdate(optimizer, True, lambda: dist.group.WORLD, timeout_s=60)

    def laid_out(cap_mb: float) -> GradLayout:
        return build_layout([f"p{i}" for i in range(len(params))], params, range(len(params)),
                            [int(cap_mb * 2**20)] * 2, False, lambda bucket_set: [])

    def set_gradients(step: int) -> None:
        for param, expected in zip(params, reference, strict=True):
            gradient = torch.randn(param.shape, generator=torch.Generator().manual_seed(step))  # averaged: alike
            param.grad.copy_(gradient)
            expected.grad = gradient.clone()

    for param in params:
        param.grad = torch.zeros_like(param)
    cap_mb, new_cap_mb = caps_mb
    updates.attach(laid_out(cap_mb))
    for step in range(3):
        set_gradients(step)
        updates.step_on_current_gradients(optimizer.step, again=False)
        reference_optimizer.step()
    layouts = [updates.status().chunk_elements]
    loss = None
    if held_by_a_graph:
        for param, expected in zip(params, reference, strict=True):
            param.grad.zero_()
            expected.grad = torch.ones_like(expected)  # the gradient of the loss below
        # As in an nn.Linear with an input that needs its gradient: the graph saves a view of each
        # weight (its transpose), which holds the weight's storage until the backward pass.
        inputs = torch.ones(1, RESHARD_WIDTH, requires_grad=True)
        loss = sum(F.linear(inputs, param).sum() for param in params)
    else:
        set_gradients(3)
    updates.detach()
    layout = laid_out(new_cap_mb)  # the gradients move into the new buckets
    before = resident_mib()
    reset_peak_rss()
    updates.attach(layout)
    if loss is not None:
        loss.backward()
        del loss
    updates.step_on_current_gradients(optimizer.step, again=False)
    rise = own_peak_rss_mib() - before
    reference_optimizer.step()
    layouts.append(updates.status().chunk_elements)
    updates.close()  # the whole state back in the optimizer
    for param, expected in zip(params, reference, strict=True):
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=1e-5, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer.state[param][key], reference_optimizer.state[expected][key],
                                       rtol=1e-5, atol=1e-7)
    whole_state_mib = 2 * sum(p.numel() * p.element_size() for p in params) / 2**20
    return {"rise_mib": rise, "layouts": layouts, "whole_state_mib": whole_state_mib}


def resharding_results(shared_ranks) -> list[dict]:
    """Every rank's `resharding_rise`, or a skip where the peak RSS cannot be measured so."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("resets the peak RSS through /proc/self/clear_refs (Linux)")
    results = shared_ranks.result()
    if any(result is None for result in results):
        pytest.skip("needs glibc's mallopt to fix the mmap threshold")
    return results


@in_shared_ranks(resharding_rise, 2, timeout_s=200)
def test_a_new_layout_never_gathers_the_whole_state(shared_ranks):
    """Resharding holds at most one old bucket's whole state at a time, not the model's (it held
    all of it, and more, when every bucket was gathered before any was cut)."""
    for result in resharding_results(shared_ranks):
        before, after = result["layouts"]
        assert before != after, f"the layout did not change, so nothing was resharded: {before}"
        assert result["rise_mib"] < result["whole_state_mib"] / 2, result


@in_shared_ranks(resharding_rise, 2, (64.0, 2.5), timeout_s=200)
def test_a_new_layout_moves_a_large_bucket_state_a_piece_at_a_time(shared_ranks):
    """From one bucket of every parameter (32 MiB) to small ones, the peak rises by that bucket's
    parameters, held in the old flat buffer while they move into the new ones; moving the state
    (a kind and a piece at a time) rises by less. Gathering the bucket's state whole, both of
    Adam's kinds at once, rose by 3 times the parameters' bytes; one kind at a time, by 2.5; a
    piece at a time, but with both kinds' new fragments made first, by 1.3 ([Note: resharding
    one bucket at a time] in `commsched.update.resharding`)."""
    for result in resharding_results(shared_ranks):
        before, after = result["layouts"]
        assert len(before) == 1 and len(after) > 1, result["layouts"]
        parameters_mib = result["whole_state_mib"] / 2
        assert result["rise_mib"] < 1.2 * parameters_mib, result


@in_shared_ranks(resharding_rise, 2, RESHARD_CAPS_MB, True, timeout_s=200)
def test_a_new_layout_between_forward_and_backward_moves_after_the_backward_pass(shared_ranks):
    """A new layout comes at the start of a backward pass, while the forward pass's graph holds
    every weight's storage (``F.linear`` saves a view of it): made there, the new flat buffers sat
    beside the old ones, every parameter twice (the peak rose 34 MiB, above the 32 MiB of
    parameters). Made at the first update, after the backward pass, each old buffer goes as its
    parameters move: the peak rises by a few buckets and a piece of state, as without a graph
    (13-15 MiB; [Note: a new layout is cut after the backward pass])."""
    for result in resharding_results(shared_ranks):
        before, after = result["layouts"]
        assert before != after, f"the layout did not change, so nothing was resharded: {before}"
        parameters_mib = result["whole_state_mib"] / 2
        assert result["rise_mib"] < 0.75 * parameters_mib, result


# ------------------------------------------------- Join: a last iteration never stepped
def last_iteration_unstepped(rank: int, world_size: int, unstepped_rank: int) -> str:
    """Under ``Join`` with sharded state, rank 0 has 6 batches and rank 1 has 4; ``unstepped_rank``
    runs its last backward pass without ``step()``. Each rank's error, as the script sees it."""
    torch.manual_seed(0)
    model = ParityNet()
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05), sharded(timeout_s=4))
    batches = 6 if rank == 0 else 4
    generator = torch.Generator().manual_seed(rank)
    try:
        with Join([model]):
            for index in range(batches):
                F.mse_loss(model(torch.randn(4, 8, generator=generator)), torch.zeros(4, 4)).backward()
                if not (rank == unstepped_rank and index == batches - 1):
                    optimizer.step()
                    optimizer.zero_grad()
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_the_last_trainer_leaving_an_iteration_unstepped_is_told_why(ranks):
    """Rank 0, the last still training, ends its loop after a backward pass without ``step()``:
    rank 1, out of batches, waits for that step's record and gives up with the fix; rank 0, which
    waited in ``Join``'s own count (it got gloo's bare "Connection closed by peer" there), is woken
    into a shadowed iteration and says that its unstepped iteration is the cause, with the fix."""
    messages = ranks(last_iteration_unstepped, 2, 0, timeout_s=120)
    assert "CommunicationTimeout: rank 1: the record of the others' step" in messages[1], messages
    assert "step after every synchronised backward pass" in messages[1], messages
    assert messages[0].startswith("CommunicationTimeout: rank 0:"), messages
    assert "This rank's loop under Join ended with a backward pass that optimizer.step() never followed" in \
        messages[0], messages
    assert "Step after every synchronised backward pass inside Join" in messages[0], messages


def test_a_rank_leaving_an_iteration_unstepped_that_the_others_stepped_is_refused(ranks):
    """Rank 1 runs out of batches after a backward pass it never steps, which rank 0 stepped: its
    part of the state would miss that update, so it is refused at once with the fix, and rank 0,
    whose all-gathers wait for rank 1's part, names rank 1 (not "another rank")."""
    messages = ranks(last_iteration_unstepped, 2, 1, timeout_s=120)
    assert messages[1].startswith("RuntimeError: rank 1: its loop under Join ended with a backward pass that "
                                  "optimizer.step() never followed, while the ranks still training stepped"), messages
    assert "Step after every synchronised backward pass inside Join" in messages[1], messages
    assert messages[0].startswith("CommunicationTimeout: rank 0:") and "Rank 1 " in messages[0], messages


def state_dict_on_rank_0_only(rank: int, world_size: int) -> str:
    """Sharded state: only rank 0 calls ``optimizer.state_dict()`` (collective), rank 1 trains on."""
    torch.manual_seed(0)
    model = ParityNet()
    model, optimizer = commsched.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01), sharded(timeout_s=4))
    generator = torch.Generator().manual_seed(rank)
    try:
        for index in range(8):
            F.mse_loss(model(torch.randn(4, 8, generator=generator)), torch.zeros(4, 4)).backward()
            optimizer.step()
            optimizer.zero_grad()
            if index == WARMUP_ITERATIONS + 2 and rank == 0:
                optimizer.state_dict()
    except commsched.CommunicationTimeout as error:
        return str(error)
    return "no error"


def test_a_state_dict_on_one_rank_only_is_named_on_every_rank(ranks):
    """Rank 0 waits in the state dict's collective, rank 1 at its next collective (with
    ``autotune=False``, it was called "the broadcast of rank 0's auto-tuning decision", and blamed
    on rank 0 having stopped): each says what it waited for, and rank 1 quotes what rank 0 waited
    for, which names the fix."""
    messages = ranks(state_dict_on_rank_0_only, 2, timeout_s=120)
    state_dict_wait = ("the all-reduce of which parameters have optimizer state (sharded optimizer state; every "
                       "rank must take part: optimizer.state_dict() and commsched.release() are collective)")
    assert messages[0].startswith(f"rank 0: {state_dict_wait}"), messages
    assert "auto-tuning" not in messages[1], messages
    assert f"Rank 0 had waited for {state_dict_wait}." in messages[1], messages

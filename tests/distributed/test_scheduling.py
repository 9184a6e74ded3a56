"""Priority, partitions, credit and forward overlap keep single-process results."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing import (
    OPTIMIZERS,
    assert_same_parameters,
    one_process_step,
    reference_copy,
    run_subtests,
)
from commsched.testing.models import ParityNet, ReadsLateEarlyLater
from commsched.testing.parity import (
    TINY_CREDIT_MB,
    TINY_PARTITION_MB,
    batches,
    random_delays,
    rank_slice,
    reference_step,
    uses_aux,
)
from commsched.testing.scheduling import ITERATIONS, collected_logs, scheduling_grid
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world_size", [
    pytest.param(world_size, marks=in_shared_ranks(scheduling_grid, world_size, timeout_s=400))
    for world_size in (2, 3)])
def test_every_combination_matches_single_process(shared_ranks, world_size):
    shared_ranks.result()


@in_shared_ranks(random_delays, 4, timeout_s=400)
def test_random_delays_on_four_ranks_no_hang_exact_results(shared_ranks):
    shared_ranks.result()


# ---------------------------------------------------------------- one spawn, many behaviours
def prepared_pair(optimizer_factory, strategy=None, model_cls=ParityNet):
    torch.manual_seed(0)
    model = model_cls()
    reference, reference_optimizer = reference_copy(model, optimizer_factory)
    model, optimizer = commsched.prepare(model, optimizer_factory(model.parameters()), strategy)
    return model, optimizer, reference, reference_optimizer


def run_until_overlap(rank, world_size, model, optimizer, reference, reference_optimizer, iterations=ITERATIONS):
    for iteration, (x, y) in enumerate(batches(world_size, iterations)):
        F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(iteration, rank)), y[rank_slice(rank)]).backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    assert commsched.status(model).overlapping, "the run never reached forward overlap"


def case_lr_scheduler(rank, world_size):
    model, optimizer, reference, reference_optimizer = prepared_pair(OPTIMIZERS["sgd_nesterov"])
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (optimizer, reference_optimizer)]
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(iteration, rank)), y[rank_slice(rank)]).backward()
        optimizer.step()
        optimizer.zero_grad()
        schedulers[0].step()  # changes lr before the pending updates run: they must use the old one
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
        schedulers[1].step()
    assert commsched.status(model).overlapping
    assert_same_parameters(model, reference)


def case_checkpoint_moves_to_plain_torch_and_back(rank, world_size):
    model, optimizer, reference, reference_optimizer = prepared_pair(OPTIMIZERS["adamw"])
    run_until_overlap(rank, world_size, model, optimizer, reference, reference_optimizer)
    plain_model, plain_optimizer = copy.deepcopy(reference), OPTIMIZERS["adamw"](reference.parameters())
    plain_model.load_state_dict(model.state_dict())
    plain_optimizer = OPTIMIZERS["adamw"](plain_model.parameters())
    plain_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    plain_state, reference_state = plain_optimizer.state_dict()["state"], reference_optimizer.state_dict()["state"]
    assert plain_state.keys() == reference_state.keys() and reference_state, "no optimizer state to compare"
    for index in reference_state:
        torch.testing.assert_close(plain_state[index]["exp_avg"], reference_state[index]["exp_avg"], rtol=1e-4, atol=1e-6)
    # and back: a fresh commsched run resumes from plain torch's checkpoint
    resumed, resumed_optimizer, _, _ = prepared_pair(OPTIMIZERS["adamw"])
    resumed.load_state_dict(plain_model.state_dict())
    resumed_optimizer.load_state_dict(copy.deepcopy(plain_optimizer.state_dict()))
    x, y = list(batches(world_size, ITERATIONS + 1))[-1]
    for m, o in ((resumed, resumed_optimizer),):
        F.mse_loss(m(x[rank_slice(rank)], use_aux=uses_aux(ITERATIONS, rank)), y[rank_slice(rank)]).backward()
        o.step()
        o.zero_grad()
    reference_step(reference, reference_optimizer, x, y, ITERATIONS, world_size)
    assert_same_parameters(resumed, reference)


def buckets_holding(model, prefix: str) -> set[int]:
    """The buckets that hold parameters whose names start with ``prefix``."""
    found = {b.index for b in commsched.status(model).buckets if any(n.startswith(prefix) for n in b.parameters)}
    assert found, f"no bucket holds a parameter named {prefix}*"
    return found


def case_gates_wait_only_for_their_own_module(rank, world_size):
    one_bucket_per_module = commsched.Strategy(bucket_cap_mb=0.0005, first_bucket_mb=0.0005)
    model, optimizer, reference, reference_optimizer = prepared_pair(OPTIMIZERS["sgd_nesterov"], one_bucket_per_module)
    run_until_overlap(rank, world_size, model, optimizer, reference, reference_optimizer)
    assert not buckets_holding(model, "embed.") & buckets_holding(model, "head.")
    x, y = next(batches(world_size, 1))
    F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
    head_before = model.head.weight.detach().clone()
    embed_before = model.embed.weight.detach().clone()
    optimizer.step()  # returns at once: nothing updated yet
    assert torch.equal(model.head.weight, head_before) and torch.equal(model.embed.weight, embed_before)
    model.embed(x[rank_slice(rank)])  # the embed module's gate releases its own update only
    assert not torch.equal(model.embed.weight, embed_before)
    assert torch.equal(model.head.weight, head_before)
    optimizer.synchronize()
    assert not torch.equal(model.head.weight, head_before)


def case_eval_under_no_grad_waits_too(rank, world_size):
    model, optimizer, reference, reference_optimizer = prepared_pair(OPTIMIZERS["adam"])
    run_until_overlap(rank, world_size, model, optimizer, reference, reference_optimizer)
    x = torch.randn(5, 8)
    model.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=1e-5)
    model.train()


class UsesChildWeightEarly(nn.Module):
    """The parent uses ``proj.weight`` functionally, before (and without) calling ``proj``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.body = nn.Linear(8, 4)

    def forward(self, x, use_aux=True):
        return self.body(torch.tanh(F.linear(x, self.proj.weight)))


def train_beside_one_process(rank, world_size, model, optimizer, reference, reference_optimizer,
                             before_iteration=lambda iteration: None):
    """Each iteration: this rank's share on ``model``, the whole batch on ``reference`` (one process)."""
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        before_iteration(iteration)
        F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
        optimizer.step()
        optimizer.zero_grad()
        one_process_step(reference_optimizer, lambda r: F.mse_loss(reference(x[rank_slice(r)]), y[rank_slice(r)]),
                         world_size)


def case_parameter_used_before_its_module(rank, world_size):
    model, optimizer, reference, reference_optimizer = prepared_pair(
        OPTIMIZERS["sgd_nesterov"], model_cls=UsesChildWeightEarly)
    train_beside_one_process(rank, world_size, model, optimizer, reference, reference_optimizer)
    assert commsched.status(model).overlapping
    assert_same_parameters(model, reference)


class TinyTransformer(nn.Module):
    """Two attention layers: ``nn.MultiheadAttention`` reads ``out_proj``'s parameters without calling it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x, use_aux=True):
        tokens = self.embed(x).unsqueeze(1).expand(-1, 3, -1)
        return self.head(self.encoder(tokens).mean(1))


def case_attention_waits_for_out_proj_itself(rank, world_size):
    """Each attention module's gate waits for its own ``out_proj``, which trains exactly."""
    one_bucket_per_module = commsched.Strategy(bucket_cap_mb=0.0005, first_bucket_mb=0.0005)
    # SGD: the key projection's bias gets gradients that are zero but for rounding, which Adam
    # would scale up to whole steps of either sign.
    model, optimizer, reference, reference_optimizer = prepared_pair(
        OPTIMIZERS["sgd_nesterov"], one_bucket_per_module, model_cls=TinyTransformer)
    run_until_overlap(rank, world_size, model, optimizer, reference, reference_optimizer)
    assert_same_parameters(model, reference)
    x, y = next(batches(world_size, 1))
    F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
    attention = model.encoder.layers[1].self_attn
    out_proj_before = attention.out_proj.weight.detach().clone()
    optimizer.step()  # returns at once: nothing updated yet
    assert torch.equal(attention.out_proj.weight, out_proj_before)
    tokens = torch.randn(2, 3, 16)
    attention(tokens, tokens, tokens)  # its gate releases its own parameters' updates, out_proj's too
    assert not torch.equal(attention.out_proj.weight, out_proj_before)
    optimizer.synchronize()


def case_control_flow_that_changes_in_warmup_is_gated_at_the_start(rank, world_size):
    """A parameter a warm-up pass reads before its gates is waited for at the forward start, and trains exactly."""
    one_bucket_per_module = commsched.Strategy(bucket_cap_mb=0.0001, first_bucket_mb=0.0001)
    model, optimizer, reference, reference_optimizer = prepared_pair(
        OPTIMIZERS["sgd_nesterov"], one_bucket_per_module, model_cls=ReadsLateEarlyLater)

    def from_the_second_on_read_late_first(iteration):
        model.read_late_first = reference.read_late_first = iteration > 0

    train_beside_one_process(rank, world_size, model, optimizer, reference, reference_optimizer,
                             before_iteration=from_the_second_on_read_late_first)
    status = commsched.status(model)
    assert status.overlapping
    assert status.gated_at_forward_start == ("late.bias",)
    assert "waited for at the forward start (read before their modules in warm-up): late.bias" in status.describe()
    assert_same_parameters(model, reference)


def case_realistic_loop_with_clipping_matches_ddp(rank, world_size, synchronize_first=False):
    """AdamW with decay / no-decay groups, clip_grad_norm_ after backward, zero_grad(set_to_none=True),
    snapshots through model.module when present: only the wrap differs from the DDP version.

    ``synchronize_first``: ``optimizer.synchronize()`` before clipping, every iteration, keeps
    forward overlap on."""
    torch.manual_seed(0)
    base = ParityNet()

    def make_optimizer(model):
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)

    def train(model, optimizer):
        losses, generator = [], torch.Generator().manual_seed(5 + rank)
        for _ in range(ITERATIONS + 2):
            x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if synchronize_first and isinstance(optimizer, commsched.CommschedOptimizer):
                optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        snapshot = getattr(model, "module", model).state_dict()
        return losses, snapshot

    ddp = DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)
    ddp_losses, ddp_snapshot = train(ddp, make_optimizer(ddp))
    ours = copy.deepcopy(base)
    ours, ours_optimizer = commsched.prepare(ours, make_optimizer(ours))
    our_losses, our_snapshot = train(ours, ours_optimizer)
    assert our_losses == pytest.approx(ddp_losses, rel=1e-4, abs=1e-6)
    assert ddp_snapshot.keys() == our_snapshot.keys() and ddp_snapshot, "no state to compare"
    for key, value in ddp_snapshot.items():
        torch.testing.assert_close(our_snapshot[key], value, rtol=1e-4, atol=1e-5)
    status = commsched.status(ours)
    if synchronize_first:
        assert status.overlap_off_reason is None and status.lifecycle is commsched.Lifecycle.OVERLAPPING, status
        return
    reason = status.overlap_off_reason
    assert reason is not None and "clip_grad_norm_" in reason
    assert status.lifecycle is commsched.Lifecycle.SYNCHRONOUS


def case_gradient_change_during_overlap_is_an_error(rank, world_size):
    model, optimizer, reference, reference_optimizer = prepared_pair(OPTIMIZERS["sgd_nesterov"])
    run_until_overlap(rank, world_size, model, optimizer, reference, reference_optimizer)
    x, y = next(batches(world_size, 1))
    F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    with pytest.raises(RuntimeError, match=r"modified between backward\(\) and step\(\) while their reductions"):
        optimizer.step()
    optimizer.synchronize()  # the documented way: settle, then touch
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    optimizer.step()
    optimizer.synchronize()


def case_unsupported_optimizer_still_trains(rank, world_size):
    with collected_logs() as records:
        model, optimizer, reference, reference_optimizer = prepared_pair(OPTIMIZERS["rmsprop_momentum"])
    assert any("RMSprop has no per-bucket update" in r.getMessage() for r in records)
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(iteration, rank)), y[rank_slice(rank)]).backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    assert_same_parameters(model, reference)


def case_forward_order_sets_priority(rank, world_size):
    """Registration order puts `head` first; the forward pass runs `embed` first."""

    class Reordered(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(16, 4)
            self.embed = nn.Linear(8, 16)

        def forward(self, x):
            return self.head(torch.relu(self.embed(x)))

    torch.manual_seed(0)
    model = Reordered()
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    status = commsched.status(model)
    flags = status.buckets[status.flags_bucket]
    assert "embed.weight" in flags.parameters, "the forward-first layer must be most urgent"
    most_urgent = min(status.buckets, key=lambda b: b.priority)
    assert most_urgent.index == status.flags_bucket and most_urgent.partitions >= 1
    optimizer.step()


def case_status_follows_the_lifecycle(rank, world_size):
    """status(): recording, then warm-up, then overlapping with rank 0's plan; figures of each iteration."""
    torch.manual_seed(0)
    model = ParityNet()
    with pytest.raises(ValueError, match=r"status\(\) takes a model returned by commsched.prepare\(\)"):
        commsched.status(model)
    model, optimizer = commsched.prepare(model, OPTIMIZERS["sgd_nesterov"](model.parameters()))
    status = commsched.status(model)
    assert status.lifecycle is commsched.Lifecycle.RECORDING and not status.buckets and status.iterations == 0
    assert status.transport == f"all-reduce over {world_size} ranks (gloo)"
    seen = []
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(iteration, rank)), y[rank_slice(rank)]).backward()
        optimizer.step()
        optimizer.zero_grad()
        status = commsched.status(model)
        seen.append(status.lifecycle)
        assert status.iterations == iteration + 1
        assert status.current_iteration.iteration == iteration
        assert status.current_iteration.partitions_issued == status.partitions
        assert status.current_iteration.bytes_issued == sum(b.nbytes for b in status.buckets)
    W = commsched.Lifecycle
    assert seen == [W.WARMUP] * WARMUP_ITERATIONS + [W.OVERLAPPING] * (ITERATIONS - WARMUP_ITERATIONS)
    assert status.overlapping and status.overlap_off_reason is None and "agreed" in status.plan
    assert status.previous_iteration.iteration == ITERATIONS - 2
    assert {n for b in status.buckets for n in b.parameters} == {n for n, p in model.named_parameters()}
    text = status.describe()
    assert "overlapping" in text and "forward overlap: on" in text and f"iteration {ITERATIONS - 1}" in text
    optimizer.synchronize()
    synchronous = commsched.Strategy(overlap_forward=False)
    model, optimizer, _, _ = prepared_pair(OPTIMIZERS["sgd_nesterov"], synchronous)
    for iteration, (x, y) in enumerate(batches(world_size, WARMUP_ITERATIONS + 1)):
        F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
        optimizer.step()
        optimizer.zero_grad()
    status = commsched.status(model)
    assert status.lifecycle is W.SYNCHRONOUS and status.overlap_off_reason == "Strategy(overlap_forward=False)"
    assert "agreed" in status.plan and "in the order they became ready" in status.plan


def case_user_collectives_between_backward_and_forward(rank, world_size):
    """The user's own collectives on the same group after backward(), some after a wait
    on rank 0 alone, meet their peers' and sum what they should: every partition is
    issued by the end of backward (see [Note: everything goes by the end of backward])."""
    strategy = commsched.Strategy(partition_mb=TINY_PARTITION_MB, credit_mb=TINY_CREDIT_MB, adaptive=False,
                                  bucket_cap_mb=0.004, first_bucket_mb=0.001)
    model, optimizer, reference, reference_optimizer = prepared_pair(OPTIMIZERS["adam"], strategy)
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        loss = F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(iteration, rank)), y[rank_slice(rank)])
        loss.backward()
        mean_loss = loss.detach().clone()
        torch.distributed.all_reduce(mean_loss)  # logging, before step()
        optimizer.step()
        if rank == 0:
            model.state_dict()  # a checkpoint on rank 0 alone: waits for this iteration's updates
        marker = torch.full((3,), float(rank + 1))
        torch.distributed.all_reduce(marker)  # and a metric after it, before the next forward
        optimizer.zero_grad()
        with torch.no_grad():
            expected_loss = sum(
                F.mse_loss(reference(x[rank_slice(r)], use_aux=uses_aux(iteration, r)), y[rank_slice(r)])
                for r in range(world_size)
            )
        torch.testing.assert_close(mean_loss, expected_loss, rtol=1e-4, atol=1e-6)
        assert marker.tolist() == [world_size * (world_size + 1) / 2] * 3
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    assert commsched.status(model).overlapping
    assert_same_parameters(model, reference)


def case_release_then_train_locally(rank, world_size):
    """After release(), hooks are gone and step() is the optimizer's own: local training, as plain torch."""
    model, optimizer, reference, reference_optimizer = prepared_pair(OPTIMIZERS["adamw"])
    run_until_overlap(rank, world_size, model, optimizer, reference, reference_optimizer)
    commsched.release(model)
    assert commsched.status(model).lifecycle is commsched.Lifecycle.RELEASED
    plain = copy.deepcopy(reference)  # a plain model holding the released model's values and state
    plain.load_state_dict(model.state_dict())
    plain_optimizer = OPTIMIZERS["adamw"](plain.parameters())
    plain_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # load_state_dict shares tensors
    generator = torch.Generator().manual_seed(77 + rank)  # each rank its own data: nothing is reduced now
    for _ in range(2):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
        for m, o in ((model, optimizer), (plain, plain_optimizer)):
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    compared = 0
    for (name, a), (_, e) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"parameter '{name}': {m}")
        compared += 1
    assert compared > 0


def behaviours(rank: int, world_size: int) -> None:
    run_subtests({
        "lr_scheduler": functools.partial(case_lr_scheduler, rank, world_size),
        "checkpoint_plain_torch_and_back": functools.partial(case_checkpoint_moves_to_plain_torch_and_back, rank, world_size),
        "gates_wait_only_for_own_module": functools.partial(case_gates_wait_only_for_their_own_module, rank, world_size),
        "eval_under_no_grad_waits": functools.partial(case_eval_under_no_grad_waits_too, rank, world_size),
        "parameter_used_before_its_module": functools.partial(case_parameter_used_before_its_module, rank, world_size),
        "attention_waits_for_out_proj": functools.partial(case_attention_waits_for_out_proj_itself, rank, world_size),
        "control_flow_changes_in_warmup": functools.partial(
            case_control_flow_that_changes_in_warmup_is_gated_at_the_start, rank, world_size),
        "realistic_loop_with_clipping": functools.partial(case_realistic_loop_with_clipping_matches_ddp, rank, world_size),
        "clipping_after_synchronize_keeps_overlap": functools.partial(
            case_realistic_loop_with_clipping_matches_ddp, rank, world_size, synchronize_first=True),
        "gradient_change_during_overlap": functools.partial(case_gradient_change_during_overlap_is_an_error, rank, world_size),
        "unsupported_optimizer": functools.partial(case_unsupported_optimizer_still_trains, rank, world_size),
        "forward_order_sets_priority": functools.partial(case_forward_order_sets_priority, rank, world_size),
        "status_follows_the_lifecycle": functools.partial(case_status_follows_the_lifecycle, rank, world_size),
        "release_then_train_locally": functools.partial(case_release_then_train_locally, rank, world_size),
        "user_collectives_between_backward_and_forward": functools.partial(
            case_user_collectives_between_backward_and_forward, rank, world_size),
    })


@in_shared_ranks(behaviours, 2, timeout_s=300)
def test_scheduling_behaviours(shared_ranks):
    shared_ranks.result()

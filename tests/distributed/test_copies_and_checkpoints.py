"""Copies and checkpoints of a prepared model.

A deep copy (EMA, SWA) and a pickled whole module are plain modules of the
user's class holding the parameters ``step()`` made, also while its updates
are still pending under forward overlap; the original keeps training. A
checkpoint taken at any iteration and loaded by new processes continues
exactly as the run that was never interrupted.
"""

from __future__ import annotations

import copy
import functools
import io
import itertools
import os

import pytest
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import ExponentialLR
from torch.optim.swa_utils import AveragedModel

import commsched
from commsched.lifecycle import WARMUP_ITERATIONS
from commsched.module import CommschedModule
from commsched.testing import run_subtests
from commsched.testing.models import ParityNet
from tests.distributed.test_allreduce_parity import (
    OPTIMIZERS,
    assert_same_parameters,
    batches,
    local_step,
    rank_slice,
    reference_step,
    uses_aux,
)

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2
ITERATIONS = 10
COPY_AT = WARMUP_ITERATIONS + 1
"""Copies are taken right after this iteration's step(), with its updates pending (forward overlap)."""


class UserNet(ParityNet):
    """The user's own class, defined outside commsched."""


def count_calls(module, args, output):
    """A hook of the user's own: copies keep it."""
    module.calls = getattr(module, "calls", 0) + 1


def fresh_pair(optimizer_name):
    torch.manual_seed(0)
    model = UserNet()
    reference = copy.deepcopy(model)
    return model, OPTIMIZERS[optimizer_name](model.parameters()), reference, OPTIMIZERS[optimizer_name](reference.parameters())


def assert_plain(copied, user_hooks=()):
    """The user's class, no reducer, and no hooks but the user's own (``(module name, table)`` pairs)."""
    assert type(copied) is UserNet, type(copied)
    assert not isinstance(copied, CommschedModule)
    assert not hasattr(copied, "_commsched_reducer")
    for name, module in copied.named_modules():
        for table_name, table in vars(module).items():
            if "hooks" in table_name and isinstance(table, dict) and (name, table_name) not in user_hooks:
                assert not table, f"module '{name}' still has {table_name}: {dict(table)}"
    for name, param in copied.named_parameters():
        assert not param._post_accumulate_grad_hooks, f"parameter '{name}' still has gradient hooks"


def assert_parameters_equal(actual, expected, what):
    for (name, a), b in zip(actual.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}, parameter '{name}': {m}")


def assert_waited(copied, stale):
    """The updates were still pending when the copy was asked for, and the copy has them."""
    assert any(not torch.equal(c, s) for c, s in zip(copied.parameters(), stale, strict=True)), (
        "no update was pending before the copy: the case tests nothing"
    )


# ----------------------------------------------------------------- copies


def case_deepcopy_is_plain_and_current(rank, world_size, optimizer_name):
    model, optimizer, reference, reference_optimizer = fresh_pair(optimizer_name)
    model.head.register_forward_hook(count_calls)
    model, optimizer = commsched.prepare(model, optimizer)
    twin, twin_optimizer = commsched.prepare(*fresh_pair(optimizer_name)[:2])
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        local_step(model, optimizer, x, y, iteration, rank)
        local_step(twin, twin_optimizer, x, y, iteration, rank)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
        if iteration == COPY_AT:
            assert commsched.status(model).lifecycle is commsched.Lifecycle.OVERLAPPING
            stale = [p.detach().clone() for p in model.parameters()]
            copied = copy.deepcopy(model)
            assert_plain(copied, user_hooks={("head", "_forward_hooks")})
            assert_waited(copied, stale)
            assert_parameters_equal(copied, model, "copy against the original")
            assert_same_parameters(copied, reference)
            for (name, c), p in zip(copied.named_parameters(), model.parameters(), strict=True):
                assert c.untyped_storage().data_ptr() != p.untyped_storage().data_ptr(), name
            at_copy = copy.deepcopy(copied)
    # The original kept its hooks and reducer: it trained on exactly as a model never copied.
    assert isinstance(model, CommschedModule) and model.embed.weight._post_accumulate_grad_hooks
    optimizer.synchronize()
    twin_optimizer.synchronize()
    assert_parameters_equal(model, twin, "original against a model never copied")
    assert_same_parameters(model, reference)
    # ... without touching the copy, which trains on its own, locally, without touching the original.
    assert_parameters_equal(copied, at_copy, "copy after the original trained on")
    after_training = copy.deepcopy(model)
    calls = model.head.calls
    local_optimizer = torch.optim.SGD(copied.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    F.mse_loss(copied(x), y).backward()
    local_optimizer.step()
    assert all(p.grad is None for p in model.parameters())
    assert copied.head.calls == at_copy.head.calls + 1 and model.head.calls == calls
    assert_parameters_equal(model, after_training, "original after the copy trained")
    assert any(not torch.equal(c, p) for c, p in zip(copied.parameters(), at_copy.parameters()))


def case_whole_module_pickled(rank, world_size):
    model, optimizer, reference, reference_optimizer = fresh_pair("adam")
    model, optimizer = commsched.prepare(model, optimizer)
    data = list(batches(world_size, ITERATIONS))
    for iteration, (x, y) in enumerate(data[:COPY_AT + 1]):
        local_step(model, optimizer, x, y, iteration, rank)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    stale = [p.detach().clone() for p in model.parameters()]
    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert b"commsched" not in buffer.getvalue(), "the file names commsched: it needs commsched to load"
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert_plain(loaded)
    assert_waited(loaded, stale)
    assert_parameters_equal(loaded, model, "loaded against the original")
    assert_same_parameters(loaded, reference)
    for iteration, (x, y) in enumerate(data[COPY_AT + 1:], start=COPY_AT + 1):
        local_step(model, optimizer, x, y, iteration, rank)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    assert_same_parameters(model, reference)


def case_swa_averaged_model(rank, world_size):
    model, optimizer, reference, reference_optimizer = fresh_pair("sgd")
    model, optimizer = commsched.prepare(model, optimizer)
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        local_step(model, optimizer, x, y, iteration, rank)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
        if iteration == COPY_AT:
            averaged, reference_averaged = AveragedModel(model), AveragedModel(reference)
        if iteration >= COPY_AT:
            optimizer.synchronize()
            averaged.update_parameters(model)
            reference_averaged.update_parameters(reference)
    assert_plain(averaged.module)
    assert averaged.n_averaged.item() == ITERATIONS - COPY_AT
    assert_same_parameters(averaged, reference_averaged)
    assert_same_parameters(model, reference)


def case_ema_after_synchronize(rank, world_size):
    model, optimizer, reference, reference_optimizer = fresh_pair("adam")
    model, optimizer = commsched.prepare(model, optimizer)
    ema, reference_ema = copy.deepcopy(model), copy.deepcopy(reference)
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        local_step(model, optimizer, x, y, iteration, rank)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
        optimizer.synchronize()
        with torch.no_grad():
            for averages, params in ((ema, model), (reference_ema, reference)):
                for average, param in zip(averages.parameters(), params.parameters(), strict=True):
                    average.lerp_(param, 0.25)
    assert_plain(ema)
    assert_same_parameters(ema, reference_ema)
    assert_same_parameters(model, reference)


def copies(rank: int, world_size: int) -> None:
    run_subtests({
        "deepcopy/sgd": functools.partial(case_deepcopy_is_plain_and_current, rank, world_size, "sgd"),
        "deepcopy/adam": functools.partial(case_deepcopy_is_plain_and_current, rank, world_size, "adam"),
        "torch.save(model)": functools.partial(case_whole_module_pickled, rank, world_size),
        "swa_averaged_model": functools.partial(case_swa_averaged_model, rank, world_size),
        "ema_after_synchronize": functools.partial(case_ema_after_synchronize, rank, world_size),
    })


def test_copies_of_a_prepared_model(ranks):
    ranks(copies, WORLD_SIZE, timeout_s=240)


# ------------------------------------------------------------ checkpoints

CHECKPOINT_OPTIMIZERS = ("sgd", "adam")
STOP_AFTER = (WARMUP_ITERATIONS - 1, WARMUP_ITERATIONS + 2)
"""Iterations before the restart: while warming up, before the plan; and with the plan, overlapping."""
SAVE_POINTS = ("after_step", "after_zero_grad")
LOAD_ORDERS = ("load_after_prepare", "load_before_prepare")


def make_scheduler(optimizer):
    return ExponentialLR(optimizer, gamma=0.8)  # the learning rate changes at every iteration


def prepared(optimizer_name, seed=0):
    torch.manual_seed(seed)
    model = UserNet()
    model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()))
    return model, optimizer, make_scheduler(optimizer)


def train(model, optimizer, scheduler, rank, world_size, start, stop, zero_grad_last=True):
    for iteration, (x, y) in itertools.islice(enumerate(batches(world_size, stop)), start, None):
        mine = rank_slice(rank)
        F.mse_loss(model(x[mine], use_aux=uses_aux(iteration, rank)), y[mine]).backward()
        optimizer.step()
        scheduler.step()
        if zero_grad_last or iteration < stop - 1:
            optimizer.zero_grad()


def uninterrupted_path(directory, optimizer_name, rank):
    return os.path.join(directory, f"uninterrupted-{optimizer_name}-rank{rank}.pt")


def checkpoint_path(directory, optimizer_name, stop, save_point):
    return os.path.join(directory, f"checkpoint-{optimizer_name}-k{stop}-{save_point}.pt")


def case_uninterrupted(rank, world_size, directory, optimizer_name):
    model, optimizer, scheduler = prepared(optimizer_name)
    _, _, reference, reference_optimizer = fresh_pair(optimizer_name)
    reference_scheduler = make_scheduler(reference_optimizer)
    train(model, optimizer, scheduler, rank, world_size, 0, ITERATIONS)
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
        reference_scheduler.step()
    assert_same_parameters(model, reference)
    torch.save(model.state_dict(), uninterrupted_path(directory, optimizer_name, rank))


def uninterrupted(rank: int, world_size: int, directory: str) -> None:
    run_subtests({name: functools.partial(case_uninterrupted, rank, world_size, directory, name)
                  for name in CHECKPOINT_OPTIMIZERS})


def case_save(rank, world_size, directory, optimizer_name, stop, save_point):
    """Train ``stop`` iterations; right after the last step() (or its zero_grad()), checkpoint on rank 0."""
    model, optimizer, scheduler = prepared(optimizer_name)
    train(model, optimizer, scheduler, rank, world_size, 0, stop, zero_grad_last=save_point == "after_zero_grad")
    overlapping = commsched.status(model).lifecycle is commsched.Lifecycle.OVERLAPPING
    assert overlapping == (stop > WARMUP_ITERATIONS)
    stale = [p.detach().clone() for p in model.parameters()]
    if save_point == "after_step":
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    else:
        checkpoint = {"optimizer": optimizer.state_dict(), "model": model.state_dict()}
    checkpoint["scheduler"] = scheduler.state_dict()
    if overlapping:
        # The updates of the last step() were pending: state_dict() waited for them.
        assert any(not torch.equal(checkpoint["model"][name], s)
                   for (name, _), s in zip(model.named_parameters(), stale, strict=True))
    if rank == 0:
        torch.save(checkpoint, checkpoint_path(directory, optimizer_name, stop, save_point))


def save_checkpoints(rank: int, world_size: int, directory: str) -> None:
    run_subtests({
        f"{name}/k={stop}/{point}": functools.partial(case_save, rank, world_size, directory, name, stop, point)
        for name, stop, point in itertools.product(CHECKPOINT_OPTIMIZERS, STOP_AFTER, SAVE_POINTS)
    })


def case_resume(rank, world_size, directory, optimizer_name, stop, save_point, load_order):
    """New processes, fresh objects (other initial values), the checkpoint, the remaining iterations."""
    checkpoint = torch.load(checkpoint_path(directory, optimizer_name, stop, save_point), weights_only=True)
    if load_order == "load_after_prepare":
        model, optimizer, scheduler = prepared(optimizer_name, seed=1)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    else:
        torch.manual_seed(1)
        model = UserNet()
        model.load_state_dict(checkpoint["model"])
        optimizer = OPTIMIZERS[optimizer_name](model.parameters())
        optimizer.load_state_dict(checkpoint["optimizer"])
        model, optimizer = commsched.prepare(model, optimizer)
        scheduler = make_scheduler(optimizer)
    scheduler.load_state_dict(checkpoint["scheduler"])
    train(model, optimizer, scheduler, rank, world_size, stop, ITERATIONS)
    # Warm-up and plan ran again after the restart; overlapping again at the end.
    assert commsched.status(model).lifecycle is commsched.Lifecycle.OVERLAPPING
    expected = torch.load(uninterrupted_path(directory, optimizer_name, rank), weights_only=True)
    resumed = model.state_dict()
    assert list(resumed) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0,
                                   msg=lambda m: f"'{name}' after the restart: {m}")


def resume_from_checkpoints(rank: int, world_size: int, directory: str) -> None:
    run_subtests({
        f"{name}/k={stop}/{point}/{order}": functools.partial(
            case_resume, rank, world_size, directory, name, stop, point, order)
        for name, stop, point, order in itertools.product(CHECKPOINT_OPTIMIZERS, STOP_AFTER, SAVE_POINTS, LOAD_ORDERS)
    })


def test_checkpoint_restart_continues_exactly(ranks, tmp_path):
    """Three runs, each with new processes and a new process group: uninterrupted, up to k, from k."""
    directory = str(tmp_path)
    ranks(uninterrupted, WORLD_SIZE, directory, timeout_s=180)
    ranks(save_checkpoints, WORLD_SIZE, directory, timeout_s=180)
    ranks(resume_from_checkpoints, WORLD_SIZE, directory, timeout_s=240)

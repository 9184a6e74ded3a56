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
from commsched import CommschedModule, CommschedOptimizer
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing import OPTIMIZERS, assert_same_parameters, run_subtests
from commsched.testing.models import ParityNet
from commsched.testing.parity import batches, local_step, rank_slice, reference_step, uses_aux
from commsched.testing.parity import fresh_pair as parity_pair
from commsched.testing.shared_ranks import in_shared_ranks

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
    """The user's model, its optimizer, and the single-process reference (test_allreduce_parity's)."""
    return parity_pair(optimizer_name, model_cls=UserNet)


def assert_nothing_of_commsched(obj, what):
    """No attribute of ``obj`` is named after commsched or holds an object of commsched's."""
    assert vars(obj), f"{what} has no attributes"
    for attribute, value in vars(obj).items():
        assert "commsched" not in attribute.lower(), f"{what} has an attribute '{attribute}'"
        assert not type(value).__module__.startswith("commsched"), (
            f"{what}.{attribute} is a {type(value).__module__}.{type(value).__qualname__}")


def assert_plain(copied, user_hooks=()):
    """The user's class, nothing of commsched's, and no hooks but the user's own (``(module name, table)`` pairs)."""
    assert type(copied) is UserNet, type(copied)
    assert not isinstance(copied, CommschedModule)
    tables = parameters = 0
    for name, module in copied.named_modules():
        assert not isinstance(module, CommschedModule), name
        assert_nothing_of_commsched(module, f"module '{name}'")
        for table_name, table in vars(module).items():
            if "hooks" in table_name and isinstance(table, dict):
                tables += 1
                if (name, table_name) not in user_hooks:
                    assert not table, f"module '{name}' still has {table_name}: {dict(table)}"
    for name, param in copied.named_parameters():
        assert not param._post_accumulate_grad_hooks, f"parameter '{name}' still has gradient hooks"
        parameters += 1
    assert tables > 0 and parameters > 0, (tables, parameters)


def assert_parameters_equal(actual, expected, what):
    compared = 0
    for (name, a), b in zip(actual.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}, parameter '{name}': {m}")
        compared += 1
    assert compared > 0, f"{what}: no parameters"


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
            compared = 0
            for (name, c), p in zip(copied.named_parameters(), model.parameters(), strict=True):
                assert c.untyped_storage().data_ptr() != p.untyped_storage().data_ptr(), name
                compared += 1
            assert compared > 0
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
    model, optimizer, reference, reference_optimizer = fresh_pair("sgd_dampening")
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
        "deepcopy/sgd_dampening": functools.partial(
            case_deepcopy_is_plain_and_current, rank, world_size, "sgd_dampening"),
        "deepcopy/adam": functools.partial(case_deepcopy_is_plain_and_current, rank, world_size, "adam"),
        "torch.save(model)": functools.partial(case_whole_module_pickled, rank, world_size),
        "swa_averaged_model": functools.partial(case_swa_averaged_model, rank, world_size),
        "ema_after_synchronize": functools.partial(case_ema_after_synchronize, rank, world_size),
    })


@in_shared_ranks(copies, WORLD_SIZE, timeout_s=240)
def test_copies_of_a_prepared_model(shared_ranks):
    shared_ranks.result()


# ------------------------------------------------------------ checkpoints

CHECKPOINT_OPTIMIZERS = ("sgd_dampening", "adam")
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


def uninterrupted_and_save_checkpoints(rank: int, world_size: int, directory: str) -> None:
    """The uninterrupted runs, and the runs up to k that checkpoint (the resumed runs need new processes)."""
    run_subtests({
        **{f"uninterrupted/{name}": functools.partial(case_uninterrupted, rank, world_size, directory, name)
           for name in CHECKPOINT_OPTIMIZERS},
        **{f"save/{name}/k={stop}/{point}": functools.partial(
            case_save, rank, world_size, directory, name, stop, point)
           for name, stop, point in itertools.product(CHECKPOINT_OPTIMIZERS, STOP_AFTER, SAVE_POINTS)},
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
    assert list(resumed) == list(expected) and expected, "nothing to compare"
    for name, value in expected.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0,
                                   msg=lambda m: f"'{name}' after the restart: {m}")


def resume_from_checkpoints(rank: int, world_size: int, directory: str) -> None:
    run_subtests({
        f"{name}/k={stop}/{point}/{order}": functools.partial(
            case_resume, rank, world_size, directory, name, stop, point, order)
        for name, stop, point, order in itertools.product(CHECKPOINT_OPTIMIZERS, STOP_AFTER, SAVE_POINTS, LOAD_ORDERS)
    })


@in_shared_ranks(uninterrupted_and_save_checkpoints, WORLD_SIZE, timeout_s=240, tmp_dir=True)
def test_checkpoint_restart_continues_exactly(ranks, shared_ranks):
    """The uninterrupted runs and the runs up to k, then the runs from k in new processes with a new process group."""
    shared_ranks.result()
    ranks(resume_from_checkpoints, WORLD_SIZE, str(shared_ranks.path), timeout_s=240)


# ------------------------------------------------------- optimizer copies


OPTIMIZER_CLASSES = {"sgd_dampening": torch.optim.SGD, "adam": torch.optim.Adam}


def assert_plain_optimizer(copied, optimizer_name):
    """torch.optim's own class (so not commsched's mixed one), and nothing of commsched's."""
    assert type(copied) is OPTIMIZER_CLASSES[optimizer_name], type(copied)
    assert not isinstance(copied, CommschedOptimizer)
    assert_nothing_of_commsched(copied, "the optimizer")


def assert_same_optimizer_state(actual, expected, what):
    """Same hyper-parameters, and per parameter (matched by position) the same state."""
    assert len(actual.param_groups) == len(expected.param_groups)
    parameters = values = 0
    for group, reference_group in zip(actual.param_groups, expected.param_groups, strict=True):
        assert {k: v for k, v in group.items() if k != "params"} == {
            k: v for k, v in reference_group.items() if k != "params"}, what
        for index, (param, reference_param) in enumerate(zip(group["params"], reference_group["params"], strict=True)):
            state, reference_state = actual.state.get(param, {}), expected.state.get(reference_param, {})
            assert set(state) == set(reference_state), f"{what}, parameter {index}: {set(state)} != {set(reference_state)}"
            parameters += 1
            for key, value in reference_state.items():
                torch.testing.assert_close(torch.as_tensor(state[key]).to(torch.as_tensor(value).dtype),
                                           torch.as_tensor(value), rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"{what}, parameter {index}, state '{key}': {m}")
                values += 1
    assert parameters > 0 and values > 0, f"{what}: nothing compared ({parameters} parameters, {values} values)"


def optimizer_tensors(optimizer):
    return [t.detach().clone() for state in optimizer.state.values() for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0]


def train_and_reference_step(model, optimizer, scheduler, reference, reference_optimizer, reference_scheduler,
                             x, y, iteration, rank, world_size):
    """One step of this rank's training and of the single-process reference (zero_grad left to the caller)."""
    mine = rank_slice(rank)
    F.mse_loss(model(x[mine], use_aux=uses_aux(iteration, rank)), y[mine]).backward()
    optimizer.step()
    scheduler.step()
    reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    reference_scheduler.step()


def train_until_copy(optimizer_name, rank, world_size):
    """Train past warm-up; return right after the last step(), with its updates pending."""
    model, optimizer, reference, reference_optimizer = fresh_pair(optimizer_name)
    model, optimizer = commsched.prepare(model, optimizer)
    scheduler, reference_scheduler = make_scheduler(optimizer), make_scheduler(reference_optimizer)
    data = list(batches(world_size, ITERATIONS))
    for iteration, (x, y) in enumerate(data[:COPY_AT + 1]):
        if iteration:
            optimizer.zero_grad()
        train_and_reference_step(model, optimizer, scheduler, reference, reference_optimizer, reference_scheduler,
                                 x, y, iteration, rank, world_size)
    assert commsched.status(model).lifecycle is commsched.Lifecycle.OVERLAPPING
    stale = [p.detach().clone() for p in model.parameters()], optimizer_tensors(optimizer)
    return model, optimizer, scheduler, reference, reference_optimizer, reference_scheduler, data, stale


def assert_optimizer_waited(copied, stale_tensors):
    assert any(not torch.equal(c, s) for c, s in zip(optimizer_tensors(copied), stale_tensors, strict=True)), (
        "no optimizer update was pending before the copy: the case tests nothing"
    )


def train_rest(model, optimizer, scheduler, reference, reference_optimizer, reference_scheduler, data, rank,
               world_size):
    """The original trains on after the copy, exactly."""
    for iteration, (x, y) in enumerate(data[COPY_AT + 1:], start=COPY_AT + 1):
        optimizer.zero_grad()
        train_and_reference_step(model, optimizer, scheduler, reference, reference_optimizer, reference_scheduler,
                                 x, y, iteration, rank, world_size)
    optimizer.zero_grad()
    assert_same_parameters(model, reference)
    assert_same_optimizer_state(optimizer, reference_optimizer, "the original after training on")


def case_optimizer_deepcopy(rank, world_size, optimizer_name):
    (model, optimizer, scheduler, reference, reference_optimizer, reference_scheduler, data,
     (stale_params, stale_state)) = train_until_copy(optimizer_name, rank, world_size)
    copied = copy.deepcopy(optimizer)
    assert_plain_optimizer(copied, optimizer_name)
    assert_optimizer_waited(copied, stale_state)
    assert_same_optimizer_state(copied, reference_optimizer, "copy against single-process training")
    params = [p for group in copied.param_groups for p in group["params"]]
    assert all(type(p) is torch.nn.Parameter and not p._post_accumulate_grad_hooks for p in params)
    assert not any(p is q for p, q in zip(params, model.parameters()))
    assert any(not torch.equal(p, s) for p, s in zip(params, stale_params, strict=True))
    compared = 0
    for p, e in zip(params, reference_optimizer.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(p, e, rtol=1e-4, atol=1e-5)
        compared += 1
    assert compared > 0
    # The copy is an optimizer of its own: it steps its own parameters, not the model's.
    before = [p.detach().clone() for p in model.parameters()]
    for p in params:
        p.grad = torch.ones_like(p)
    copied.step()
    copied.state_dict()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    train_rest(model, optimizer, scheduler, reference, reference_optimizer, reference_scheduler, data, rank,
               world_size)


def case_deepcopy_optimizer_with_model(rank, world_size):
    """In one deepcopy, the optimizer first: both copies are current, and the copied optimizer
    steps the copied model's parameters."""
    (model, optimizer, scheduler, reference, reference_optimizer, reference_scheduler, data,
     (stale_params, stale_state)) = train_until_copy("adam", rank, world_size)
    copies_ = copy.deepcopy({"opt": optimizer, "model": model})
    copied_optimizer, copied_model = copies_["opt"], copies_["model"]
    assert_plain_optimizer(copied_optimizer, "adam")
    assert_plain(copied_model)
    assert_optimizer_waited(copied_optimizer, stale_state)
    assert_waited(copied_model, stale_params)
    assert_same_parameters(copied_model, reference)
    assert_same_optimizer_state(copied_optimizer, reference_optimizer, "copy against single-process training")
    copied_params = copied_optimizer.param_groups[0]["params"]
    assert len(copied_params) == len(list(copied_model.parameters()))
    assert all(p is q for p, q in zip(copied_params, copied_model.parameters(), strict=True)), (
        "the copied optimizer does not hold the copied model's parameters"
    )
    # The pair trains on locally as single-process training, with the reference pair copied the same way.
    twin = copy.deepcopy({"opt": reference_optimizer, "model": reference})
    for iteration, (x, y) in enumerate(data[COPY_AT + 1:COPY_AT + 3], start=COPY_AT + 1):
        for pair in (copies_, twin):
            pair["opt"].zero_grad()
            reference_step(pair["model"], pair["opt"], x, y, iteration, world_size)
    assert_same_parameters(copied_model, twin["model"])
    train_rest(model, optimizer, scheduler, reference, reference_optimizer, reference_scheduler, data, rank,
               world_size)


def case_optimizer_pickled(rank, world_size):
    (model, optimizer, scheduler, reference, reference_optimizer, reference_scheduler, data,
     (stale_params, stale_state)) = train_until_copy("adam", rank, world_size)
    buffer = io.BytesIO()
    torch.save(optimizer, buffer)
    assert b"commsched" not in buffer.getvalue(), "the file names commsched: it needs commsched to load"
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert_plain_optimizer(loaded, "adam")
    assert_optimizer_waited(loaded, stale_state)
    assert_same_optimizer_state(loaded, reference_optimizer, "loaded against single-process training")
    # Saved together, the loaded optimizer holds the loaded model's parameters.
    buffer = io.BytesIO()
    torch.save({"model": model, "opt": optimizer}, buffer)
    buffer.seek(0)
    both = torch.load(buffer, weights_only=False)
    assert_plain(both["model"])
    assert_plain_optimizer(both["opt"], "adam")
    assert all(p is q for p, q in zip(both["opt"].param_groups[0]["params"], both["model"].parameters(), strict=True))
    assert_same_parameters(both["model"], reference)
    train_rest(model, optimizer, scheduler, reference, reference_optimizer, reference_scheduler, data, rank,
               world_size)


def optimizer_copies(rank: int, world_size: int) -> None:
    run_subtests({
        "deepcopy(opt)/sgd_dampening": functools.partial(case_optimizer_deepcopy, rank, world_size, "sgd_dampening"),
        "deepcopy(opt)/adam": functools.partial(case_optimizer_deepcopy, rank, world_size, "adam"),
        "deepcopy({opt, model})": functools.partial(case_deepcopy_optimizer_with_model, rank, world_size),
        "torch.save(opt)": functools.partial(case_optimizer_pickled, rank, world_size),
    })


@in_shared_ranks(optimizer_copies, WORLD_SIZE, timeout_s=240)
def test_copies_of_a_prepared_optimizer(shared_ranks):
    shared_ranks.result()

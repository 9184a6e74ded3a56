"""Code written for torch DDP, run on commsched: DDP's attributes and idioms, and the drop-in wrapper.

Each script runs once on torch DDP and once on commsched, with only the
wrapping line changed; the parameters must match (torch DDP is the reference
here: it is what these scripts were written against).
"""

from __future__ import annotations

import copy
import io
import typing
import unittest.mock
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS, Lifecycle
from commsched.testing import run_subtests
from commsched.testing.ddp_scripts import (
    MICRO_STEPS,
    STEPS,
    assert_same_state,
    case_drop_in,
    nanogpt_loop,
    net,
    torch_ddp_reference,
)
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed


def case_require_backward_grad_sync(rank):
    """One synchronised backward pass per optimizer step, and DDP's parameters."""
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = commsched.prepare(model, optimizer)
    raw_model = model.module
    assert raw_model is not model and type(raw_model).__name__ == "Sequential", type(raw_model)
    assert isinstance(raw_model, nn.Sequential) and not hasattr(raw_model, "module")
    typing.get_type_hints(type(model)), typing.get_type_hints(type(optimizer))  # as transformers reads them
    group, calls, real_all_reduce = commsched.status(model).process_groups.replicas, [], dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        if kwargs.get("group") is group:
            calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    def count_after_warmup(step):
        if step == WARMUP_ITERATIONS + 1:  # the link's calibration and the plan are behind
            dist.all_reduce = counting_all_reduce

    try:
        nanogpt_loop(model, optimizer, rank, on_step=count_after_warmup)
    finally:
        dist.all_reduce = real_all_reduce
    status = commsched.status(model)
    counted_steps = STEPS - WARMUP_ITERATIONS - 1
    assert len(calls) == status.partitions * counted_steps, (
        f"{len(calls)} all-reduces in {counted_steps} optimizer steps of {MICRO_STEPS} micro-steps, "
        f"{status.partitions} partition(s) each")
    assert status.iterations == STEPS, f"{status.iterations} synchronised backward passes for {STEPS} steps"
    assert status.lifecycle is Lifecycle.OVERLAPPING, status
    assert_same_state(raw_model.state_dict(), torch_ddp_reference(rank))
    commsched.release(model)


def case_drop_in_with_uneven_inputs(rank):
    """``with model.join():`` as torch DDP's, one rank a batch short."""
    results = []
    for wrap in (TorchDDP, commsched.DistributedDataParallel):
        model = wrap(net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        generator = torch.Generator().manual_seed(7 + rank)
        with model.join():
            for _ in range(STEPS - rank):
                x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
                F.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        results.append(model.module.state_dict())
        if wrap is not TorchDDP:
            commsched.release(model.module)
    assert_same_state(results[1], results[0])


def case_refused_arguments(rank):
    """What the drop-in cannot honour fails at once, naming what to use instead (nothing collective runs)."""
    refused = {
        "mixed_precision": (dict(mixed_precision=object()), "reduce_dtype"),
        "bucket_cap_mb_list": (dict(bucket_cap_mb_list=[1, 25]), "bucket_cap_mb"),
        "delay_all_reduce_named_params": (dict(delay_all_reduce_named_params=[]), "leave it None"),
        "dim": (dict(dim=1), "dim must be 0"),
        "device_ids": (dict(device_ids=[1]), "must name the one device"),
        "buffers": (dict(broadcast_buffers=True, forward_sync_buffers=False), "disagree"),
    }
    for arguments, message in refused.values():
        with pytest.raises(ValueError, match=message):
            commsched.DistributedDataParallel(net(), **arguments)


def case_model_with_its_own_module(rank):
    """A model whose own submodule is named ``module`` keeps it, with a warning."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = net()

        def forward(self, x):
            return self.module(x)

    model = Wrapper()
    inner = model.module
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.module is inner
    assert any("attribute of its own named 'module'" in str(w.message) for w in caught), [str(w.message) for w in caught]
    commsched.release(model)


def unwrap_recursively(model: nn.Module) -> nn.Module:
    """The shape of timm's ``unwrap_model`` (and transformers' without accelerate): any ``.module`` is a wrapper."""
    if hasattr(model, "module"):
        return unwrap_recursively(model.module)
    return model


def unwrap_while(model: nn.Module, most: int = 10) -> nn.Module:
    """``while hasattr(m, "module"): m = m.module``, failing instead of looping forever."""
    for _ in range(most):
        if not hasattr(model, "module"):
            return model
        model = model.module
    raise AssertionError(f"still a .module after {most} unwrappings: {type(model).__name__}")


def unwrappers() -> dict[str, typing.Callable[[nn.Module], nn.Module]]:
    from accelerate.utils import extract_model_from_parallel
    from transformers import modeling_utils

    def transformers_without_accelerate(model):
        with unittest.mock.patch.object(modeling_utils, "is_accelerate_available", lambda: False):
            return modeling_utils.unwrap_model(model)

    return {
        "recursive (timm)": unwrap_recursively,
        "while hasattr": unwrap_while,
        "transformers": modeling_utils.unwrap_model,
        "transformers without accelerate": transformers_without_accelerate,
        "accelerate": extract_model_from_parallel,
        "accelerate, recursive": lambda model: extract_model_from_parallel(model, recursive=True),
    }


def case_unwrapping_ends(rank):
    """Code that takes wrappers off until there is no ``.module`` ends, at a module of the user's
    class that is the prepared model's raw view: its parameters and state dict are the trained ones,
    and its copies are plain (timm's EMA, ``distribute_bn``); through the drop-in, at the model
    itself, as under torch DDP ([Note: model.module] in `commsched.prepared.module`)."""
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = commsched.prepare(model, optimizer)
    raw_model = model.module
    by_type = ("accelerate", "transformers")  # unwrap torch DDP's class only
    for name, unwrap in unwrappers().items():
        unwrapped = unwrap(model)
        assert unwrapped is (model if name in by_type else raw_model), (name, type(unwrapped))
    assert [id(p) for p in raw_model.parameters()] == [id(p) for p in model.parameters()]
    assert commsched.status(raw_model).iterations == 0
    nanogpt_loop(raw_model, optimizer, rank)  # trained through the raw view, as through the model
    reference = torch_ddp_reference(rank)
    assert_same_state(unwrap_recursively(model).state_dict(), reference)
    ema = copy.deepcopy(unwrap_recursively(model))
    assert type(ema) is nn.Sequential, type(ema)
    assert_same_state(ema.state_dict(), reference)
    buffer = io.BytesIO()
    torch.save(raw_model, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False)) is nn.Sequential
    with pytest.raises(RuntimeError, match="already called on this model"):
        commsched.prepare(raw_model, torch.optim.SGD(raw_model.parameters(), lr=0.1))
    commsched.release(raw_model)

    inner = net()
    wrapped = commsched.DistributedDataParallel(inner)
    assert wrapped.module is inner and not hasattr(inner, "module")
    for name, unwrap in unwrappers().items():
        assert unwrap(wrapped) is inner, name
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    nanogpt_loop(wrapped, optimizer, rank)
    raw_model = wrapped.module
    assert_same_state(raw_model.state_dict(), reference)
    commsched.release(raw_model)


def case_optimizer_over_some_parameters(rank):
    """The drop-in adopts one optimizer over every parameter; a second one is refused with the fixes."""
    model = commsched.DistributedDataParallel(net())
    body, head = list(model.module[:3].parameters()), list(model.module[3:].parameters())
    optimizers = [torch.optim.SGD(body, lr=0.1), torch.optim.Adam(head, lr=0.1)]
    F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
    with pytest.raises(RuntimeError, match="adopts one optimizer over every trainable parameter"):
        optimizers[0].step()
    commsched.release(model.module)


def case_one_optimizer_over_two_wrapped_models(rank):
    """An encoder and a head, each wrapped, one optimizer over both (torch DDP allows it): trained
    exactly as torch DDP trains them, forward overlap off with the reason (it was refused, saying
    the optimizer "was not passed to commsched.prepare()", which the script never called)."""
    results = []
    for wrap in (TorchDDP, commsched.DistributedDataParallel):
        torch.manual_seed(0)
        encoder, head = wrap(nn.Sequential(nn.Linear(8, 16), nn.Tanh())), wrap(nn.Linear(16, 4))
        optimizer = torch.optim.AdamW([*encoder.parameters(), *head.parameters()], lr=1e-2, weight_decay=0.1)
        generator = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
            F.mse_loss(head(encoder(x)), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append({**encoder.module.state_dict(), **{f"head.{k}": v for k, v in head.module.state_dict().items()}})
        if wrap is not TorchDDP:
            for model in (encoder, head):
                assert "several commsched.DistributedDataParallel" in commsched.status(model).overlap_off_reason
                commsched.release(model.module)
    assert_same_state(results[1], results[0])


def ddp_idioms(rank: int, world_size: int) -> None:
    run_subtests({
        "require_backward_grad_sync and .module after prepare()": lambda: case_require_backward_grad_sync(rank),
        "the drop-in wrapper adopts the optimizer built after it": lambda: case_drop_in(rank),
        "the drop-in's join()": lambda: case_drop_in_with_uneven_inputs(rank),
        "refused arguments": lambda: case_refused_arguments(rank),
        "a model with its own 'module'": lambda: case_model_with_its_own_module(rank),
        "an optimizer over some parameters": lambda: case_optimizer_over_some_parameters(rank),
        "unwrapping ends at the model": lambda: case_unwrapping_ends(rank),
        "one optimizer over two wrapped models": lambda: case_one_optimizer_over_two_wrapped_models(rank),
    })


@in_shared_ranks(ddp_idioms, 2, timeout_s=240)
def test_ddp_scripts_run_unchanged(shared_ranks):
    shared_ranks.result()

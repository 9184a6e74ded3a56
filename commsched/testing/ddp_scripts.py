"""Scripts written for torch DDP: nanoGPT's accumulation loop, its result on torch DDP, and the
drop-in wrapper's run of it (tests/distributed/test_ddp_idioms.py; tests/gpu on CUDA).
"""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS, Lifecycle


STEPS = WARMUP_ITERATIONS + 5


MICRO_STEPS = 3


def net(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)


def nanogpt_loop(model, optimizer, rank, scheduler=None, device="cpu", inputs_on="cpu", on_step=None):
    """nanoGPT's accumulation: ``require_backward_grad_sync`` is True only for the last micro-step.

    ``inputs_on``: where the inputs are made (a wrapper given ``device_ids`` moves them).
    ``on_step(step)``: runs before each optimizer step's micro-steps.
    """
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        if on_step is not None:
            on_step(step)
        for micro_step in range(MICRO_STEPS):
            model.require_backward_grad_sync = micro_step == MICRO_STEPS - 1
            x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
            (F.mse_loss(model(x.to(inputs_on)), y.to(device)) / MICRO_STEPS).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def assert_same_state(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def torch_ddp_reference(rank, with_scheduler=False, device="cpu"):
    device_ids = None if device == "cpu" else [torch.device(device)]
    model = TorchDDP(net(device), device_ids=device_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5) if with_scheduler else None
    nanogpt_loop(model, optimizer, rank, scheduler, device)
    return model.module.state_dict()


def case_drop_in(rank, device="cpu"):
    """torch DDP's script, the import swapped: the optimizer and its scheduler built after the
    wrapper are adopted, the checkpoint keys and isinstance checks are DDP's (on a GPU, with
    ``device_ids``, the inputs are moved as torch DDP moves them)."""
    import pytest

    device_ids = None if device == "cpu" else [torch.device(device)]
    model = commsched.DistributedDataParallel(net(device), device_ids=device_ids, find_unused_parameters=True,
                                              bucket_cap_mb=25)
    assert isinstance(model, TorchDDP)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)
    nanogpt_loop(model, optimizer, rank, scheduler, device)
    status = commsched.status(model.module)
    assert status.iterations == STEPS and status.lifecycle is Lifecycle.OVERLAPPING, status
    assert isinstance(optimizer, commsched.CommschedOptimizer), type(optimizer)
    reference = torch_ddp_reference(rank, with_scheduler=True, device=device)
    assert_same_state(model.module.state_dict(), reference)
    assert_same_state(model.state_dict(), {f"module.{k}": v for k, v in reference.items()})
    assert scheduler.get_last_lr() == [1e-2 * 0.5 ** (STEPS // 3)], scheduler.get_last_lr()
    with pytest.raises(ValueError, match=r"takes torch's built-in comm hooks only .*Strategy\(reduce_dtype"):
        model.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(RuntimeError, match=r"register_comm_hook\(\) must be called before the first forward pass"):
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match=r"model\.module"):
        torch.save(model, io.BytesIO())
    commsched.release(model.module)

"""Gradients accumulate straight into their buckets ([Note: views ahead of backward]), and ``.grad`` keeps
its single-process meaning: None where no gradient came."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import commsched
from commsched.testing import run_subtests
from commsched.testing.models import ParityNet
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed


class CountCopies(TorchDispatchMode):
    """Counts in-place copies (the hook's move of a new gradient into its bucket)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def prepared(strategy: commsched.Strategy):
    torch.manual_seed(0)
    model = ParityNet()
    return commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), strategy)


def step(model, optimizer, use_aux=True):
    F.mse_loss(model(torch.randn(4, 8), use_aux=use_aux), torch.randn(4, 4)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def assert_gradients_are_bucket_views(model, used: list[str]) -> None:
    """Each gradient of ``used`` is a view into its bucket's flat buffer (``commsched.status``'s buckets):
    cut from one buffer per bucket (``.grad._base``), of the bucket's size, sharing its storage."""
    params = dict(model.named_parameters())
    buffers: list[torch.Tensor] = []
    checked = []
    for bucket in commsched.status(model).buckets:
        mine = [name for name in bucket.parameters if name in used]
        if not mine:
            continue
        flat = params[mine[0]].grad._base
        assert flat is not None, f"the gradient of '{mine[0]}' is not a view into a bucket"
        assert flat.numel() * flat.element_size() == bucket.nbytes, (mine[0], bucket)
        assert all(flat is not other for other in buffers), f"bucket {bucket.index} shares a buffer with another"
        buffers.append(flat)
        start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        spans = []
        for name in mine:
            grad = params[name].grad
            assert grad._base is flat, f"the gradient of '{name}' is not a view into its bucket's buffer"
            assert grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), name
            spans.append((grad.data_ptr(), grad.data_ptr() + grad.numel() * grad.element_size(), name))
            checked.append(name)
        spans.sort()
        assert start <= spans[0][0] and spans[-1][1] <= end, f"a gradient lies outside bucket {bucket.index}"
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"gradients overlap in bucket {bucket.index}"
    assert sorted(checked) == sorted(used), (checked, used)


def no_copy_per_gradient(strategy: commsched.Strategy) -> None:
    """After zero_grad(set_to_none=True), backward copies no gradient into a bucket."""
    model, optimizer = prepared(strategy)
    for _ in range(8):  # past warm-up
        step(model, optimizer)
    optimizer.synchronize()
    loss = F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4))
    with CountCopies() as counted:
        loss.backward()
    used = [name for name, _ in model.named_parameters() if name.split(".")[0] != "never_used"]
    assert used
    assert_gradients_are_bucket_views(model, used)
    # The usage flags of the flags bucket are one copy; no gradient is.
    assert counted.copies <= 1, f"{counted.copies} copies in one backward pass"


def unused_parameters_stay_none(rank: int) -> None:
    """A parameter no rank used has grad None after backward, as in single-process training."""
    model, optimizer = prepared(commsched.Strategy())
    for iteration in range(8):
        step(model, optimizer, use_aux=iteration % 2 == 0)
    optimizer.synchronize()
    F.mse_loss(model(torch.randn(4, 8), use_aux=False), torch.randn(4, 4)).backward()
    optimizer.synchronize()
    assert model.aux.weight.grad is None and model.never_used.weight.grad is None
    assert model.head.weight.grad is not None


def input_gradients_leave_grad_none() -> None:
    """A backward pass that reaches no parameter (an input gradient) leaves every .grad None."""
    model, optimizer = prepared(commsched.Strategy())
    for _ in range(8):
        step(model, optimizer)
    optimizer.synchronize()
    x = torch.randn(4, 8, requires_grad=True)
    (grad_x,) = torch.autograd.grad(F.mse_loss(model(x), torch.randn(4, 4)), x)
    assert grad_x.shape == x.shape
    params = list(model.parameters())
    assert params and all(p.grad is None for p in params), "a view handed out stayed .grad"
    step(model, optimizer)  # and training goes on


def views_ahead_cases(rank: int, world_size: int) -> None:
    run_subtests({
        "no copy, default": lambda: no_copy_per_gradient(commsched.Strategy()),
        "no copy, without overlap": lambda: no_copy_per_gradient(commsched.Strategy(overlap_forward=False)),
        "unused parameters stay None": lambda: unused_parameters_stay_none(rank),
        "input gradients leave .grad None": input_gradients_leave_grad_none,
    })


@in_shared_ranks(views_ahead_cases, 2, timeout_s=180)
def test_views_ahead(shared_ranks):
    shared_ranks.result()

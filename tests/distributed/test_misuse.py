"""Misuse gets a clear error on every rank, never a hang."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing import run_subtests
from commsched.testing.hung_peers import HANG_POINTS, hung_peer, prepared, train_step
from commsched.testing.models import ParityNet
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed


def expect_after_prepare(change, match):
    def case():
        model, optimizer = prepared()
        train_step(model, optimizer)
        change(model)
        with pytest.raises(RuntimeError, match=match) as error:
            train_step(model, optimizer)
        assert "before calling commsched.prepare()" in str(error.value)

    return case


def case_model_differs(rank, hidden_on_rank1, match):
    def case():
        torch.manual_seed(0)
        model = ParityNet(hidden=hidden_on_rank1 if rank == 1 else 16)
        with pytest.raises(ValueError, match=match):
            commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    return case


def case_extra_parameter_on_rank1(rank):
    def case():
        torch.manual_seed(0)
        model = ParityNet()
        if rank == 1:
            model.extra = nn.Parameter(torch.zeros(2))
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] differ.*Entry counts per rank: \[\d+, \d+\]"):
            commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    return case


def case_prepare_twice():
    model, optimizer = prepared()
    with pytest.raises(RuntimeError, match="already called on this model"):
        commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def case_optimizer_reused_for_second_model():
    _, optimizer = prepared()
    other = ParityNet()
    with pytest.raises(RuntimeError, match="already passed to commsched.prepare"):
        commsched.prepare(other, optimizer)


def case_optimizer_with_foreign_parameters():
    model, other = ParityNet(), ParityNet()
    optimizer = torch.optim.SGD([*model.parameters(), other.head.weight], lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[\d+\] \(shape \(4, 16\)\) is not a parameter"):
        commsched.prepare(model, optimizer)


def case_lr_scheduler_created_before_prepare():
    """As Lightning and accelerate build them: the scheduler goes on counting the prepared
    optimizer's steps (no "lr_scheduler.step() before optimizer.step()" warning), which are
    commsched's (the optimizer's own class would skip its per-bucket updates)."""
    trained = []
    for scheduler_first in (True, False):
        torch.manual_seed(0)
        model = ParityNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if scheduler_first:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        model, optimizer = commsched.prepare(model, optimizer)
        if not scheduler_first:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(WARMUP_ITERATIONS + 3):
                train_step(model, optimizer)
                scheduler.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** (WARMUP_ITERATIONS + 3))
        assert commsched.status(model).overlapping
        trained.append([p.detach().clone() for p in model.parameters()])
        commsched.release(model)
    for before, after in zip(*trained, strict=True):
        torch.testing.assert_close(before, after, rtol=0, atol=0)


def case_lr_scheduler_after_prepare_works():
    model, optimizer = prepared()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(3):
        train_step(model, optimizer)
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def case_not_a_strategy():
    model = ParityNet()
    with pytest.raises(ValueError, match="strategy must be a commsched.Strategy"):
        commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), {"bucket_cap_mb": 1})


def case_double_backward():
    model, optimizer = prepared()
    loss = F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4))
    with pytest.raises(RuntimeError, match=r"create_graph=True"):
        loss.backward(create_graph=True)
    with pytest.raises(RuntimeError, match="previous backward pass did not finish"):
        model(torch.randn(4, 8))


def case_sparse_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 1))
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"'0.weight' received a sparse gradient"):
        model(torch.tensor([[1, 2], [3, 4]])).sum().backward()


def misuse_grid(rank: int, world_size: int) -> None:
    def replace_parameter(model):
        model.head.bias = nn.Parameter(torch.zeros(4))

    def resize_parameter(model):
        model.head.bias.data = torch.zeros(5)

    run_subtests({
        "model_differs_in_shape": case_model_differs(rank, 17, r"differs across ranks at entry #0: rank 0 has parameter 'gain' shape=\(16,\).*"
            r"this is rank \d, which has parameter 'gain' shape=\((16|17),\)"),
        "extra_parameter_on_one_rank": case_extra_parameter_on_rank1(rank),
        "prepare_twice": case_prepare_twice,
        "optimizer_reused": case_optimizer_reused_for_second_model,
        "optimizer_with_foreign_parameters": case_optimizer_with_foreign_parameters,
        "lr_scheduler_before_prepare": case_lr_scheduler_created_before_prepare,
        "lr_scheduler_after_prepare": case_lr_scheduler_after_prepare_works,
        "not_a_strategy": case_not_a_strategy,
        "double_backward": case_double_backward,
        "sparse_gradient": case_sparse_gradient,
        "parameter_added": expect_after_prepare(
            lambda m: setattr(m, "extra", nn.Parameter(torch.zeros(3))), "'extra' was added"),
        "module_removed": expect_after_prepare(
            lambda m: setattr(m, "never_used", None), "'never_used.bias' was removed"),
        "parameter_frozen": expect_after_prepare(
            lambda m: m.head.weight.requires_grad_(False),
            "'head.weight' changed requires_grad from True to False"),
        "parameter_replaced": expect_after_prepare(replace_parameter, "'head.bias' was replaced"),
        "parameter_resized": expect_after_prepare(resize_parameter, r"'head.bias' changed shape from \(4,\) to \(5,\)"),
    })


@in_shared_ranks(misuse_grid, 2, timeout_s=180)
def test_misuse_raises_on_every_rank(shared_ranks):
    shared_ranks.result()


@pytest.mark.parametrize("hang_at", sorted(HANG_POINTS))
def test_hung_peer_times_out(ranks, hang_at):
    elapsed, _ = ranks(hung_peer, 2, hang_at, timeout_s=120)
    assert 1.5 <= elapsed < 7.0, f"rank 0 gave up after {elapsed:.1f} s, expected about 2 s"


def dead_peer(rank: int, world_size: int) -> float | None:
    """Rank 1's process ends; rank 0 must fail promptly with an error that says so."""
    model, optimizer = prepared()
    train_step(model, optimizer)
    if rank == 1:
        return None  # the harness tears down its process group and the process exits
    start = time.monotonic()
    with pytest.raises(commsched.CommunicationTimeout, match="Another rank probably died"):
        for _ in range(3):
            train_step(model, optimizer)
    return time.monotonic() - start


def test_dead_peer_fails_fast(ranks):
    elapsed, _ = ranks(dead_peer, 2, timeout_s=120)
    assert elapsed < 30.0, f"rank 0 took {elapsed:.1f} s to notice its peer was gone"

"""The parameter-server backend gives single-process training's parameters.

Same cases as the all-reduce parity grid, for 2 and 3 workers with 1 and 2
servers: each group of spawned ranks runs every case; server ranks call
``commsched.serve()``, which returns once every worker has released its model.
"""

from __future__ import annotations

import copy
import functools
import itertools
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _get_default_store

import commsched
from commsched.api import ServingFinished
from commsched.testing import OPTIMIZERS, one_process_backward, reference_copy, run_subtests
from commsched.testing.models import BatchNormNet
from commsched.testing.servers import prepare_or_serve as serving
from commsched.testing.parity import (
    PARITY_OPTIMIZERS,
    batches,
    fresh_pair,
    local_step,
    rank_slice,
    reference_backward,
    reference_step,
    uses_aux,
)
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

PS_STRATEGIES = {
    "default": {},
    # Blocks of ~512 bytes: parameters are cut into rows and span both servers.
    "small_blocks": {"bucket_cap_mb": 0.002, "first_bucket_mb": 0.0005, "partition_mb": 0.0005},
    "no_priority_no_overlap": {"priority": False, "overlap_forward": False, "partition_mb": 0.0005},
    "no_credit_unfused": {"credit_mb": None, "fuse_optimizer": False, "partition_mb": 0.001},
    # The servers' blocks, not the partitions, set the size: workers and servers must cut alike.
    "blocks_below_partitions": {"bucket_cap_mb": 0.004, "partition_mb": 0.004, "block_mb": 0.0005},
}


SERVER_REPORTS: list = []
"""What each server rank's serve() returned, in this rank's process."""


def prepare_or_serve(model, optimizer, num_servers, **kwargs):
    return serving(model, optimizer, num_servers, reports=SERVER_REPORTS, **kwargs)

ONE_BLOCK_PER_TENSOR = {"bucket_cap_mb": 1e-6, "first_bucket_mb": 1e-6}
"""A Linear layer's weight and bias in a block each: with two servers, each holds one."""


def finish(model) -> None:
    """Tell the servers this worker is done with the model (as process exit would)."""
    commsched.release(model)


def assert_close_parameters(model, reference, rtol=1e-4, atol=1e-5):
    model.state_dict()  # waits for pending pulls under forward overlap
    compared = 0
    for (name, a), (_, e) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"parameter '{name}': {m}")
        compared += 1
    assert compared > 0


def case_matches_single_process(rank, world_size, servers, optimizer_name, strategy_name, set_to_none):
    workers = world_size - servers
    model, optimizer, reference, reference_optimizer = fresh_pair(optimizer_name)
    if prepare_or_serve(model, optimizer, servers, **PS_STRATEGIES[strategy_name]) is None:
        return
    try:
        for iteration, (x, y) in enumerate(batches(workers, iterations=8)):
            local_step(model, optimizer, x, y, iteration, rank, set_to_none)
            reference_step(reference, reference_optimizer, x, y, iteration, workers, set_to_none)
        assert_close_parameters(model, reference)
        if strategy_name == "blocks_below_partitions":  # 4.4 KB of parameters: one 4 KiB partition or two
            assert commsched.status(model).partitions >= 8, commsched.status(model).partitions
        assert model.never_used.weight.grad is None
    finally:
        finish(model)


def case_param_groups_and_lr_schedule(rank, world_size, servers):
    """Two param groups with their own LR, a scheduler stepping every iteration."""
    workers = world_size - servers
    torch.manual_seed(0)
    model, reference = fresh_pair("sgd_dampening")[0::2]

    def build(m):
        decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in m.named_parameters() if not n.endswith("weight")]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": 3e-3}],
                                 lr=1e-2, weight_decay=0.0)

    optimizer = build(model)
    reference_optimizer = build(reference)
    reference_schedule = torch.optim.lr_scheduler.StepLR(reference_optimizer, step_size=2, gamma=0.5)
    if prepare_or_serve(model, optimizer, servers) is None:
        return
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    try:
        for iteration, (x, y) in enumerate(batches(workers, iterations=7)):
            mine = rank_slice(rank)
            F.mse_loss(model(x[mine], use_aux=uses_aux(iteration, rank)), y[mine]).backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            reference_step(reference, reference_optimizer, x, y, iteration, workers)
            reference_schedule.step()
        assert_close_parameters(model, reference)
    finally:
        finish(model)


def case_no_sync_accumulation(rank, world_size, servers, micro_steps=3):
    workers = world_size - servers
    model, optimizer, reference, reference_optimizer = fresh_pair("adam")
    if prepare_or_serve(model, optimizer, servers) is None:
        return
    try:
        data = list(batches(workers, iterations=2 * micro_steps))
        for start in range(0, len(data), micro_steps):
            for k in range(micro_steps):
                x, y = data[start + k]
                context = model.no_sync() if k < micro_steps - 1 else torch.enable_grad()
                with context:
                    F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(start + k, rank)),
                               y[rank_slice(rank)]).backward()
                reference_backward(reference, x, y, start + k, workers)
            optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        assert_close_parameters(model, reference)
    finally:
        finish(model)


def _train(model, optimizer, rank, workers, data):
    for iteration, (x, y) in data:
        local_step(model, optimizer, x, y, iteration, rank)


def case_checkpoint_resumes_exactly(rank, world_size, servers):
    """Server-held optimizer state is in optimizer.state_dict(); loading it resumes exactly.

    The checkpoint also loads into plain torch.optim, and continuing there
    matches continuing on the parameter servers.
    """
    workers = world_size - servers
    data = list(enumerate(batches(workers, iterations=8)))
    model, optimizer, reference, reference_optimizer = fresh_pair("adamw")
    if prepare_or_serve(model, optimizer, servers, partition_mb=0.0005) is None:
        return
    try:
        _train(model, optimizer, rank, workers, data[:4])
        model_state = copy.deepcopy(model.state_dict())
        optimizer_state = copy.deepcopy(optimizer.state_dict())
        assert len(optimizer_state["state"]) > 0 and all(
            "exp_avg" in s and float(s["step"]) >= 3 for s in optimizer_state["state"].values())
        _train(model, optimizer, rank, workers, data[4:])
        optimizer.synchronize()  # the last pulls are installed lazily under forward overlap
        straight = [p.detach().clone() for p in model.parameters()]
        # Plain torch from the checkpoint, single process on the concatenated batches.
        reference.load_state_dict(model_state)
        reference_optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        for iteration, (x, y) in data[4:]:
            reference_step(reference, reference_optimizer, x, y, iteration, workers)
        assert straight
        for a, e in zip(straight, reference.parameters(), strict=True):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
        # Resume on the servers: load, train the same batches again, same result.
        model.load_state_dict(model_state)
        optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        _train(model, optimizer, rank, workers, data[4:])
        model.state_dict()
        for a, e in zip(model.parameters(), straight, strict=True):  # straight: not empty (checked above)
            torch.testing.assert_close(a, e, rtol=0, atol=0)
    finally:
        finish(model)


def case_buffers_stay_on_workers(rank, world_size, servers):
    """BatchNorm buffers are rank 0's, broadcast among the workers; the servers hold parameters only.

    The reference runs each worker's micro-batch (BatchNorm in training mode uses
    its own batch's statistics, as on the workers) and keeps the running
    statistics of rank 0's micro-batch, which the workers broadcast.
    """
    workers = world_size - servers
    torch.manual_seed(0)
    model = BatchNormNet()
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS["sgd_momentum_lr_0.1"])
    optimizer = OPTIMIZERS["sgd_momentum_lr_0.1"](model.parameters())
    if prepare_or_serve(model, optimizer, servers) is None:
        return
    try:
        target = torch.zeros(4, dtype=torch.long)
        for step in range(3):
            xs = [torch.randn(4, 1, 6, 6, generator=torch.Generator().manual_seed(step * 10 + r)) + r
                  for r in range(workers)]
            F.cross_entropy(model(xs[rank]), target).backward()
            optimizer.step()
            optimizer.zero_grad()
            rank0_buffers = {}

            def loss_of_share(r, xs=xs):
                loss = F.cross_entropy(reference(xs[r]), target)
                if r == 0:  # the statistics of rank 0's micro-batch, which the workers broadcast
                    rank0_buffers.update(copy.deepcopy(dict(reference.named_buffers())))
                return loss

            one_process_backward(loss_of_share, workers)
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            for name, buffer in reference.named_buffers():
                buffer.copy_(rank0_buffers[name])
        model.eval()
        with torch.enable_grad():
            model(xs[0])  # broadcasts rank 0's buffers
        compared = 0
        for name, buffer in model.named_buffers():
            expected = dict(reference.named_buffers())[name]
            torch.testing.assert_close(buffer, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"buffer '{name}': {m}")
            compared += 1
        assert compared > 0, "BatchNormNet has buffers: none was compared"
        assert_close_parameters(model, reference)
        parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert sum(commsched.status(model).server_bytes) == parameter_bytes  # no buffer went to a server
    finally:
        finish(model)


def _misuse_clip(model, optimizer, x, y, rank):
    F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with pytest.raises(RuntimeError, match=r"gradients were modified between backward\(\) and step\(\)"):
        optimizer.step()


def _misuse_grad_scaler(model, optimizer, x, y, rank):
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)])).backward()
    with pytest.raises(RuntimeError, match=r"GradScaler steps this optimizer, but with Strategy\(backend=ParameterServer"):
        scaler.step(optimizer)


def _misuse_lr_change(model, optimizer, x, y, rank):
    F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
    optimizer.param_groups[0]["lr"] = 0.5
    with pytest.raises(RuntimeError, match=r"hyper-parameters changed between backward\(\) and step\(\)"):
        optimizer.step()


def _misuse_backward_twice(model, optimizer, x, y, rank):
    F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
    with pytest.raises(RuntimeError, match=r"backward\(\) ran twice without optimizer.step\(\)"):
        F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()


def _misuse_zero_grad_before_step(model, optimizer, x, y, rank):
    F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) ran between backward\(\) and step\(\)"):
        optimizer.step()


def _misuse_step_twice_on_gradients(model, optimizer, x, y, rank):
    F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match=r"step\(\) ran again without a backward\(\) in between"):
        optimizer.step()
    optimizer.zero_grad()
    optimizer.step()  # no gradient: nothing to do, as in torch.optim


def case_misuse_gives_clear_errors(rank, world_size, servers):
    """Each misuse on a fresh prepare (an error leaves the workers and servers out of step)."""
    workers = world_size - servers
    x, y = next(batches(workers))
    for misuse in (_misuse_clip, _misuse_grad_scaler, _misuse_lr_change, _misuse_backward_twice, _misuse_zero_grad_before_step,
                   _misuse_step_twice_on_gradients):
        model, optimizer, _, _ = fresh_pair("sgd_dampening")
        if prepare_or_serve(model, optimizer, servers) is None:
            continue
        try:
            misuse(model, optimizer, x, y, rank)
        finally:
            finish(model)
    model = fresh_pair("sgd_dampening")[0]  # every rank, servers too: the check's failure reaches them all
    with pytest.raises(ValueError, match=r"supports torch.optim.SGD, Adam and AdamW only"):
        commsched.prepare(model, torch.optim.RMSprop(model.parameters()),
                          commsched.Strategy(backend=commsched.ParameterServer(num_servers=servers)))


def case_entry_points(rank, world_size, servers):
    """serve() on a worker is refused on every rank; prepare() on a server still serves, with a
    DeprecationWarning, and ends with ServingFinished (code 0)."""
    strategy = commsched.Strategy(backend=commsched.ParameterServer(num_servers=servers))
    model, optimizer, _, _ = fresh_pair("sgd_dampening")
    with pytest.raises(ValueError, match=r"commsched.serve\(\) was called on rank 0, a worker"):
        commsched.serve(model, optimizer, strategy)
    model, optimizer, _, _ = fresh_pair("sgd_dampening")
    if not commsched.is_server_rank(servers):
        model, optimizer = commsched.prepare(model, optimizer, strategy)
        x, y = next(batches(world_size - servers))
        F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
        optimizer.step()
        finish(model)
        return
    with pytest.warns(DeprecationWarning, match=r"Call commsched.serve\(model, optimizer, strategy\) on the server ranks instead"):
        with pytest.raises(ServingFinished) as finished:
            commsched.prepare(model, optimizer, strategy)
    assert finished.value.code == 0 and finished.value.report is not None


def case_async_training_converges(rank, world_size, servers):
    """Asynchronous mode: a linear regression's loss falls below 0.05; staleness is reported."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if prepare_or_serve(model, optimizer, servers, ps_mode="async", **ONE_BLOCK_PER_TENSOR) is None:
        report = SERVER_REPORTS[-1]
        assert report.blocks >= 1, "every server must hold a block, or it checks nothing"
        assert len(report.staleness) == report.updates and report.updates > 0
        assert "staleness mean" in report.describe()
        return
    truth = torch.randn(16, 1, generator=torch.Generator().manual_seed(5))
    generator = torch.Generator().manual_seed(100 + rank)
    try:
        losses = []
        for _ in range(120):
            x = torch.randn(32, 16, generator=generator)
            loss = F.mse_loss(model(x), x @ truth + 0.5)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
        assert first > 1.0 and last < 0.05, f"loss went from {first:.3f} to {last:.4f}"
    finally:
        finish(model)


def case_async_staleness_is_bounded(rank, world_size, servers):
    """A slow worker holds the others within ps_max_staleness iterations; unbounded they run ahead.

    Workers publish their progress in the job's store, apart from the servers'
    protocol: a fast worker, once its forward pass has its new values, reads
    how far the slow worker (rank 0) has come.
    """
    store = _get_default_store()
    for bound in (None, 1):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        if prepare_or_serve(model, optimizer, servers, ps_mode="async", ps_max_staleness=bound,
                            **ONE_BLOCK_PER_TENSOR) is None:
            report = SERVER_REPORTS[-1]
            assert report.blocks >= 1, "every server must hold a block, or it checks nothing"
            assert report.max_lead > 3 if bound is None else report.max_lead <= bound, report.max_lead
            continue
        gaps = []
        try:
            for iteration in range(30):
                if rank == 0:
                    time.sleep(0.03)  # the slow worker's longer compute
                loss = F.mse_loss(model(torch.randn(8, 16)), torch.zeros(8, 1))  # waits for its pulls
                if rank != 0:
                    key = f"staleness/{bound}/0"
                    gaps.append(iteration - (int(store.get(key)) if store.check([key]) else -1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if rank == 0:
                    store.set(f"staleness/{bound}/0", str(iteration))
        finally:
            finish(model)
        if rank != 0 and bound is not None:
            # Values for iteration i need the slow worker's header of i - 1 - bound,
            # sent after its step of i - 2 - bound.
            assert max(gaps) <= bound + 2, gaps
        elif rank != 0:
            assert max(gaps) > 5, gaps  # the scenario does let fast workers run ahead


def case_trace_shows_layout_and_round_trips(rank, world_size, servers):
    """The trace holds the sharding plan and one push-to-pull span per block per iteration."""
    import json
    import tempfile

    workers = world_size - servers
    with tempfile.TemporaryDirectory(prefix="commsched-ps-trace-") as directory:
        model, optimizer, _, _ = fresh_pair("sgd_dampening")
        if prepare_or_serve(model, optimizer, servers, partition_mb=0.0005, trace_dir=directory) is None:
            return
        try:
            _train(model, optimizer, rank, workers, list(enumerate(batches(workers, iterations=5))))
            blocks = commsched.status(model).partitions
        finally:
            finish(model)  # writes the trace
        events = json.loads((Path(directory) / f"rank{rank}.json").read_text())["traceEvents"]
    notes = [e for e in events if e.get("ph") == "i" and e["name"] == "layout"]
    assert len(notes) == 1 and "most loaded / mean" in notes[0]["args"]["summary"]
    wire = [e for e in events if e.get("tid") == "wire" and e["ph"] == "X"]
    assert blocks > 0 and len(wire) == 5 * blocks, (len(wire), blocks)


def ps_grid(rank: int, world_size: int, servers: int, extended: bool) -> None:
    cases = {}
    for index, (optimizer_name, strategy_name) in enumerate(itertools.product(PARITY_OPTIMIZERS, PS_STRATEGIES)):
        set_to_none = index % 2 == 0
        cases[f"single_process/{optimizer_name}/{strategy_name}/set_to_none={set_to_none}"] = functools.partial(
            case_matches_single_process, rank, world_size, servers, optimizer_name, strategy_name, set_to_none)
    cases["checkpoint_resumes_exactly"] = functools.partial(case_checkpoint_resumes_exactly, rank, world_size, servers)
    if extended:
        for name, case in (
            ("param_groups_and_lr_schedule", case_param_groups_and_lr_schedule),
            ("no_sync_accumulation", case_no_sync_accumulation),
            ("buffers_stay_on_workers", case_buffers_stay_on_workers),
            ("misuse_gives_clear_errors", case_misuse_gives_clear_errors),
            ("entry_points", case_entry_points),
            ("async_training_converges", case_async_training_converges),
            ("async_staleness_is_bounded", case_async_staleness_is_bounded),
            ("trace_shows_layout_and_round_trips", case_trace_shows_layout_and_round_trips),
        ):
            cases[name] = functools.partial(case, rank, world_size, servers)
    run_subtests(cases)


@pytest.mark.parametrize(("workers", "servers", "extended"), [
    pytest.param(workers, servers, extended,
                 marks=in_shared_ranks(ps_grid, workers + servers, servers, extended, timeout_s=400))
    for workers, servers, extended in [(2, 1, False), (3, 1, True), (2, 2, True), (3, 2, False)]])
def test_ps_grid(shared_ranks, workers, servers, extended):
    shared_ranks.result()

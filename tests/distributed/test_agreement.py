"""Ranks that disagree on the Strategy or the optimizer get one clear error at prepare(), on every rank.

Rank 1 differs in one setting per case; ranks 0 and 2 agree, so the error must
name rank 1 alone, the setting, and both values. Only ``trace_dir`` may differ.
"""

from __future__ import annotations

import re
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _get_default_store

import commsched
from commsched import ParameterServer, Strategy
from commsched.comm.side_groups import takes_cpu_tensors
from commsched.testing import run_subtests
from commsched.testing.models import ParityNet
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

WORLD_SIZE = 3
ODD_RANK = 1
AGREEMENT_TIMEOUT_S = 1.0

STRATEGY_FIELDS = {
    # field: (Strategy on ranks 0 and 2, Strategy on rank 1, their values as the error shows them)
    "bucket_cap_mb": (Strategy(), Strategy(bucket_cap_mb=5), ("25", "5")),
    "first_bucket_mb": (Strategy(), Strategy(first_bucket_mb=0.5), ("1", "0.5")),
    "broadcast_buffers": (Strategy(), Strategy(broadcast_buffers=False), ("True", "False")),
    "priority": (Strategy(), Strategy(priority=False), ("True", "False")),
    "partition_mb": (Strategy(), Strategy(partition_mb=None), ("1", "None")),
    "credit_mb": (Strategy(), Strategy(credit_mb=2), ("4", "2")),
    "overlap_forward": (Strategy(), Strategy(overlap_forward=False), ("True", "False")),
    "fuse_optimizer": (Strategy(), Strategy(fuse_optimizer=False), ("True", "False")),
    "timeout_s": (Strategy(), Strategy(timeout_s=120), ("300", "120")),
    "backend": (Strategy(), Strategy(backend=ParameterServer()), ("'AllReduce'", "'ParameterServer'")),
    "backend.num_servers": (Strategy(backend=ParameterServer()), Strategy(backend=ParameterServer(num_servers=2)),
                            ("1", "2")),
    "backend.mode": (Strategy(backend=ParameterServer()), Strategy(backend=ParameterServer(mode="async")),
                     ("'sync'", "'async'")),
    "backend.max_staleness": (Strategy(backend=ParameterServer(mode="async")),
                              Strategy(backend=ParameterServer(mode="async", max_staleness=2)), ("None", "2")),
}


def sgd(params, **options):
    return torch.optim.SGD(params, **({"lr": 0.1} | options))


SGD_KEYS = sorted(k for k in sgd([torch.zeros(1)]).param_groups[0] if k != "params")

DIFFERING_OPTIMIZERS = {  # cases, not training settings (those are commsched.testing.OPTIMIZERS)
    # case: (optimizer on ranks 0 and 2, on rank 1, the setting named, their values as shown)
    "optimizer_class": (sgd, lambda ps: torch.optim.Adam(ps, lr=0.1), "optimizer class",
                        ("torch.optim.sgd.SGD", "torch.optim.adam.Adam")),
    "learning_rate": (sgd, lambda ps: sgd(ps, lr=0.2), "optimizer.param_groups[0]['lr']", ("0.1", "0.2")),
    "momentum": (sgd, lambda ps: sgd(ps, momentum=0.9), "optimizer.param_groups[0]['momentum']", ("0", "0.9")),
    "number_of_param_groups": (
        sgd, lambda ps: sgd([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.01}]),
        "number of optimizer param_groups", ("1", "2")),
    "parameters_of_a_group": (
        sgd, lambda ps: sgd(ps[::-1]), "optimizer.param_groups[0]['params'][0]",
        ("'gain'", "'never_used.bias'")),
    "hyper_parameter_names": (
        sgd, lambda ps: sgd([{"params": ps, "schedule": "cosine"}]),
        "hyper-parameter names of optimizer.param_groups[0]",
        (", ".join(SGD_KEYS), ", ".join(sorted([*SGD_KEYS, "schedule"])))),
    "no_optimizer_on_one_rank": (sgd, lambda ps: None, "optimizer class",
                                 ("torch.optim.sgd.SGD", "None (no optimizer passed)")),
}


def differs_message(rank: int, name: str, values: tuple[str, str]) -> str:
    others, odd = (re.escape(v) for v in values)
    return (rf"commsched.prepare\(\) got a different {re.escape(name)} on different ranks: "
            rf"{others} on rank\(s\) \[0, 2\]; {odd} on rank\(s\) \[1\] "
            rf"\(rank\(s\) \[1\] differ from rank 0; this is rank {rank}\)")


def model_and_params():
    torch.manual_seed(0)
    model = ParityNet()
    return model, list(model.parameters())


def case_strategy_differs(rank: int, field: str):
    usual, odd, values = STRATEGY_FIELDS[field]

    def case():
        model, params = model_and_params()
        with pytest.raises(ValueError, match=differs_message(rank, f"Strategy.{field}", values)) as error:
            commsched.prepare(model, sgd(params), odd if rank == ODD_RANK else usual)
        assert "Pass an equal Strategy on every rank (only trace_dir may differ)" in str(error.value)
        assert not isinstance(model, commsched.CommschedModule)

    return case


def case_optimizer_differs(rank: int, name: str):
    usual, odd, setting, values = DIFFERING_OPTIMIZERS[name]

    def case():
        model, params = model_and_params()
        optimizer = (odd if rank == ODD_RANK else usual)(params)
        with pytest.raises(ValueError, match=differs_message(rank, setting, values)) as error:
            commsched.prepare(model, optimizer)
        assert "Build the optimizer the same way on every rank" in str(error.value)

    return case


def case_equal_numbers_written_differently(rank: int):
    """1 and 1.0 are one value: an int on one rank and a float on another agree."""
    def case():
        model, params = model_and_params()
        strategy = Strategy(bucket_cap_mb=25, timeout_s=300) if rank == ODD_RANK else Strategy()
        model, optimizer = commsched.prepare(model, sgd(params, lr=1 if rank == ODD_RANK else 1.0), strategy)
        train_step(model, optimizer)
        commsched.release(model)

    return case


def case_foreign_parameter_on_one_rank(rank: int):
    """A check that fails on rank 1 alone reaches the other ranks instead of leaving them waiting."""
    def case():
        model, params = model_and_params()
        optimizer = sgd(params + [torch.nn.Parameter(torch.zeros(3))] if rank == ODD_RANK else params)
        with pytest.raises(ValueError, match=(
            rf"commsched.prepare\(\) failed on rank\(s\) \[1\] \(passed on \[0, 2\]\), so it stops on every "
            rf"rank \(this is rank {rank}\): rank\(s\) \[1\]: ValueError: optimizer param_groups\[0\]\['params'\]"
            r"\[\d+\] \(shape \(3,\)\) is not a parameter of the model being prepared")):
            commsched.prepare(model, optimizer)

    return case


def case_parameter_server_without_optimizer_on_one_rank(rank: int):
    def case():
        model, params = model_and_params()
        optimizer = None if rank == ODD_RANK else sgd(params)
        with pytest.raises(ValueError, match=(
                r"failed on rank\(s\) \[1\] \(passed on \[0, 2\]\).*: rank\(s\) \[1\]: ValueError: "
                r"Strategy\(backend=ParameterServer\(...\)\) needs the optimizer")):
            commsched.prepare(model, optimizer, Strategy(backend=ParameterServer()))

    return case


def frozen_model():
    model, params = model_and_params()
    for param in params:
        param.requires_grad_(False)
    return model, params


def case_no_trainable_parameters():
    model, params = frozen_model()
    with pytest.raises(ValueError, match=(
            r"the model \(ParityNet\) has no parameter with requires_grad=True, so there is nothing to "
            r"average or update: unfreeze the parameters.*or use the model without commsched.prepare\(\)")):
        commsched.prepare(model, sgd(params))
    with pytest.raises(ValueError, match=r"has no parameter with requires_grad=True"):
        commsched.prepare(model, None)


def case_frozen_on_one_rank(rank: int):
    """The model is compared first: a model frozen on one rank is a model that differs."""
    def case():
        model, params = frozen_model() if rank == ODD_RANK else model_and_params()
        with pytest.raises(ValueError, match=(
                r"The model differs across ranks at entry #0: rank 0 has parameter 'gain' .*requires_grad; "
                rf"rank\(s\) \[1\] differ \(this is rank {rank}")):
            commsched.prepare(model, sgd(params))

    return case


def case_trace_dir_may_differ(rank: int):
    """Each rank writes its own file, so rank 1 alone may trace, or trace elsewhere."""
    def case():
        with tempfile.TemporaryDirectory() as directory:
            model, params = model_and_params()
            strategy = Strategy(trace_dir=directory) if rank == ODD_RANK else Strategy()
            model, optimizer = commsched.prepare(model, sgd(params), strategy)
            train_step(model, optimizer)
            commsched.release(model)

    return case


def group_without_cpu_backend():
    """A real group that refuses CPU tensors, as NCCL does: gloo registered for CUDA tensors only."""
    return dist.new_group(backend="cuda:gloo")


def case_group_without_cpu_backend(rank: int):
    """prepare()'s agreement and rank 0's values reach every rank over commsched's control group."""
    def case():
        group = group_without_cpu_backend()
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.zeros(1), group=group)  # what the agreement would run into on the group itself
        model, params = model_and_params()
        want = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.add_(rank)
        model, _ = commsched.prepare(model, sgd(params), process_group=group)
        try:
            control = commsched.status(model).process_groups.control
            assert control is not group and takes_cpu_tensors(control)
            assert want
            for got, value in zip(model.parameters(), want, strict=True):
                torch.testing.assert_close(got.detach(), value, rtol=0, atol=0)
        finally:
            commsched.release(model)

    return case


def case_group_without_cpu_backend_reports_difference(rank: int):
    def case():
        group = group_without_cpu_backend()
        model, params = model_and_params()
        optimizer = sgd(params, lr=0.2 if rank == ODD_RANK else 0.1)
        with pytest.raises(ValueError, match=differs_message(rank, "optimizer.param_groups[0]['lr']", ("0.1", "0.2"))):
            commsched.prepare(model, optimizer, process_group=group)

    return case


def train_step(model, optimizer):
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def silent_rank(rank: int) -> float | None:
    """Rank 1 never calls prepare(): the others give up after Strategy.timeout_s instead of hanging."""
    store = _get_default_store()
    if rank == ODD_RANK:
        store.wait([f"rank {r} gave up" for r in range(WORLD_SIZE) if r != ODD_RANK])
        return None
    model, params = model_and_params()
    optimizer = sgd(params)
    start = time.monotonic()
    try:
        with pytest.raises(commsched.CommunicationTimeout, match=(
                rf"rank {rank}: the agreement on the model's parameters and buffers \(prepare\) failed or did not "
                rf"finish within {AGREEMENT_TIMEOUT_S:g} s")):
            commsched.prepare(model, optimizer, Strategy(timeout_s=AGREEMENT_TIMEOUT_S))
        return time.monotonic() - start
    finally:
        store.set(f"rank {rank} gave up", "1")


def agreement_grid(rank: int, world_size: int) -> float | None:
    assert world_size == WORLD_SIZE
    run_subtests({
        **{f"strategy_{field}": case_strategy_differs(rank, field) for field in STRATEGY_FIELDS},
        **{name: case_optimizer_differs(rank, name) for name in DIFFERING_OPTIMIZERS},
        "equal_numbers_written_differently": case_equal_numbers_written_differently(rank),
        "foreign_parameter_on_one_rank": case_foreign_parameter_on_one_rank(rank),
        "parameter_server_without_optimizer_on_one_rank": case_parameter_server_without_optimizer_on_one_rank(rank),
        "no_trainable_parameters": case_no_trainable_parameters,
        "frozen_on_one_rank": case_frozen_on_one_rank(rank),
        "trace_dir_may_differ": case_trace_dir_may_differ(rank),
        "group_without_cpu_backend": case_group_without_cpu_backend(rank),
        "group_without_cpu_backend_reports_difference": case_group_without_cpu_backend_reports_difference(rank),
    })
    return silent_rank(rank)  # last: it leaves the group's collectives unmatched


@in_shared_ranks(agreement_grid, WORLD_SIZE, timeout_s=240, last=True)
def test_disagreeing_ranks_get_one_clear_error_on_every_rank(shared_ranks):
    elapsed = shared_ranks.result()
    for rank in (0, 2):
        assert AGREEMENT_TIMEOUT_S * 0.9 <= elapsed[rank] < AGREEMENT_TIMEOUT_S + 5.0, (
            f"rank {rank} gave up after {elapsed[rank]:.1f} s, expected about {AGREEMENT_TIMEOUT_S:g} s")

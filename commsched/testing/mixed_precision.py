"""Mixed-precision cases: ``torch.amp.GradScaler``, bf16 autocast and ``Strategy(reduce_dtype=...)``
against one process (tests/distributed/test_mixed_precision.py says what each checks).

The CPU suite runs them on gloo, tests/gpu on CUDA; the sharded, reduce-scattered and
``check_finite`` suites run `case` with their own strategies.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.engine.overlap import ONE_REPLICA_REASON
from commsched.testing.models import ParityNet
from commsched.testing.parity import batches, rank_slice, uses_aux
from commsched.testing.reference import OPTIMIZERS, assert_same_parameters, one_process_loss, reference_copy
from commsched.testing.subtests import run_subtests
from commsched.update.fused import FUSED_DTYPES
from commsched.update.grad_scaling import GRAD_SCALER_REASON


PER_RANK = 4


ITERATIONS = 10
"""Past warm-up (3 iterations) and the plan, so every later phase is exercised."""


INF_AT = (0, 4, 7)
"""Iterations whose batch holds an inf: the scaler skips them and halves its scale."""


SLOW_RANK_S = 0.05
"""How long rank 0 waits before a batch with an inf: rank 1's step of such a batch then begins
while its reductions are still in flight (its own forward and backward take a few milliseconds)."""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.hidden = nn.Sequential(nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(self.first(x)))


STRATEGIES = {
    "default": commsched.Strategy(),
    "no overlap": commsched.Strategy(overlap_forward=False),
    "no priority": commsched.Strategy(priority=False),
    "unfused, no overlap": commsched.Strategy(fuse_optimizer=False, overlap_forward=False),
    "small partitions": commsched.Strategy(partition_mb=0.001, credit_mb=0.002, adaptive=False),
}


def train(model, optimizer, world_size, rank, loop, scaler=None, device="cpu"):
    """``ITERATIONS`` steps on rank ``rank``'s slice of each batch, or (None) on the whole batch.

    Returns the parameters and the scale after each step.
    """
    generator = torch.Generator().manual_seed(11)
    scales = []
    for iteration in range(ITERATIONS):
        x = torch.randn(world_size * PER_RANK, 8, generator=generator)
        y = torch.randn(world_size * PER_RANK, 4, generator=generator)
        x, y = x.to(device), y.to(device)
        if scaler is not None and iteration in INF_AT:
            x[1, 3] = float("inf")  # rank 0's sample: only rank 0 produces the inf
            if rank == 0:
                # A slow rank 0: rank 1's reductions are still in flight when it reaches step(),
                # so a scaler that checked rank 1's own gradients would find no inf there.
                time.sleep(SLOW_RANK_S)

        def loss_of_share(r: int, x=x, y=y) -> torch.Tensor:
            return F.mse_loss(model(x[r * PER_RANK:(r + 1) * PER_RANK]), y[r * PER_RANK:(r + 1) * PER_RANK])

        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=loop == "bf16 autocast"):
            loss = one_process_loss(loss_of_share, world_size) if rank is None else loss_of_share(rank)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            if loop == "unscale and clip":
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        optimizer.zero_grad()
    if hasattr(optimizer, "synchronize"):
        optimizer.synchronize()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, scales


def new_scaler(device: str = "cpu") -> torch.amp.GradScaler:
    return torch.amp.GradScaler(torch.device(device).type, init_scale=2.0**16, growth_interval=2)


def case(world_size, rank, strategy, optimizer_name, loop, device="cpu"):
    def run() -> None:
        torch.manual_seed(0)
        model = Net().to(device)
        reference, reference_optimizer = reference_copy(model, OPTIMIZERS[optimizer_name])
        scaled = loop != "bf16 autocast"
        model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), strategy)
        got, got_scales = train(model, optimizer, world_size, rank, loop, new_scaler(device) if scaled else None,
                                device)
        status = commsched.status(model)
        commsched.release(model)
        want, want_scales = train(reference, reference_optimizer, world_size, None, loop,
                                  new_scaler(device) if scaled else None, device)
        assert got_scales == want_scales  # the same steps skipped, on every rank
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if scaled else {"rtol": 2e-2, "atol": 2e-3}
        assert want.keys() == got.keys() and want, "nothing to compare"
        for name, value in want.items():
            assert torch.isfinite(got[name]).all(), name
            torch.testing.assert_close(got[name], value, **tolerance, msg=lambda m, n=name: f"{n}: {m}")
        if strategy.overlap_forward and optimizer_name != "rmsprop" and world_size == 1:
            assert status.overlap_off_reason == ONE_REPLICA_REASON
        elif scaled and strategy.overlap_forward and optimizer_name != "rmsprop":
            assert status.overlap_off_reason == GRAD_SCALER_REASON

    return run


def scaler_first_seen_after_warmup(rank: int, world_size: int, device: str = "cpu") -> None:
    """With reductions in flight, the scaler's inf check read gradients not yet averaged: refused."""
    import pytest

    torch.manual_seed(0)
    model = Net().to(device)
    model, optimizer = commsched.prepare(model, OPTIMIZERS["sgd_momentum"](model.parameters()), commsched.Strategy())
    x, y = torch.randn(PER_RANK, 8, device=device), torch.randn(PER_RANK, 4, device=device)
    try:
        for _ in range(5):
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert commsched.status(model).overlapping
        scaler = new_scaler(device)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        with pytest.raises(RuntimeError, match=r"GradScaler stepped this optimizer for the first time after warm-up"):
            scaler.step(optimizer)
        assert not hasattr(optimizer, "found_inf")  # a plain step() afterwards is not taken for a scaled one
    finally:
        commsched.release(model)


ONE_RANK_STRATEGIES = ("default", "unfused, no overlap")
"""On one CPU rank nothing is in flight (overlap, priority and partitions do not apply): the
strategies that still differ, the fused update and the plain one."""


def mixed_precision_cases(rank: int, world_size: int, device: str = "cpu") -> None:
    cases = {}
    labels = ONE_RANK_STRATEGIES if world_size == 1 and device == "cpu" else tuple(STRATEGIES)
    for label, strategy in ((label, STRATEGIES[label]) for label in labels):
        for optimizer_name in ("sgd_momentum", "adam_no_decay"):
            cases[f"{label} {optimizer_name} scaler"] = case(
                world_size, rank, strategy, optimizer_name, "plain", device)
        cases[f"{label} sgd_momentum unscale and clip"] = case(
            world_size, rank, strategy, "sgd_momentum", "unscale and clip", device)
    for optimizer_name in ("adamw_fused", "rmsprop"):
        for label in ("default", "unfused, no overlap"):
            cases[f"{label} {optimizer_name} scaler"] = case(
                world_size, rank, STRATEGIES[label], optimizer_name, "plain", device)
    for label in ("default", "no overlap"):
        cases[f"{label} sgd_momentum bf16 autocast"] = case(
            world_size, rank, STRATEGIES[label], "sgd_momentum", "bf16 autocast", device)
    if world_size > 1:  # one rank has nothing in flight
        cases["scaler first seen after warm-up"] = lambda: scaler_first_seen_after_warmup(rank, world_size, device)
    run_subtests(cases)


REDUCE_ITERATIONS = WARMUP_ITERATIONS + 3
"""Past warm-up and the plan: forward overlap is on where it may be."""


SUMMED_IN_FLOAT32 = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


SENT_AS_BFLOAT16 = {torch.float32: torch.bfloat16}
"""Per parameter dtype, the dtype ``Strategy(reduce_dtype=...)`` sums it in (float64 keeps its own)."""


REDUCE_STRATEGIES = {
    "default": {},
    "no overlap": {"overlap_forward": False},
    "unfused, no overlap": {"fuse_optimizer": False, "overlap_forward": False},
    "small partitions, no priority": {"partition_mb": 0.0005, "credit_mb": 0.001, "adaptive": False,
                                      "priority": False},
    "small partitions": {"partition_mb": 0.0005, "credit_mb": 0.001, "adaptive": False},
}
"""Small partitions cut each bucket into several all-reduces, each copied back on its own."""


BFLOAT16_WIRE_ERROR = 2e-2
"""Largest parameter error of bfloat16 on the wire against one float32 process after
`REDUCE_ITERATIONS` steps, relative to how far training moved the parameter."""


def parity_net(dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """`ParityNet` (a float64 parameter, one unused on some ranks or all, one never used) on
    ``device``, with its float32 parameters in ``dtype``."""
    torch.manual_seed(0)
    model = ParityNet().to(device)
    for param in model.parameters():
        if param.dtype == torch.float32:
            param.data = param.data.to(dtype)
    return model


def backward_of_share(model, x, y, iteration, r, micro_batches=1, scaler=None):
    """Rank ``r``'s backward on its slice, in ``micro_batches`` pieces (all but the last under
    ``no_sync()`` where the model has it), routed as rank ``r`` routes it."""
    dtype = model.embed.weight.dtype
    xs, ys = x[rank_slice(r)].to(dtype).chunk(micro_batches), y[rank_slice(r)].chunk(micro_batches)
    for index, (xm, ym) in enumerate(zip(xs, ys, strict=True)):
        last = index == micro_batches - 1
        with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            loss = F.mse_loss(model(xm, use_aux=uses_aux(iteration, r)), ym) / micro_batches
            (loss if scaler is None else scaler.scale(loss)).backward()


def reduce_like_strategy(model, backward, world_size, wire):
    """One process: each share's gradient summed as `Strategy.reduce_dtype` sums it on two ranks.

    ``backward(r)``: share ``r``'s backward. ``wire``: per parameter dtype, the dtype it is summed
    in (absent: its own). Each share is divided by ``world_size`` in the wider of the two dtypes
    and cast once (a missing gradient counts as zeros), the shares are added in the wire's dtype
    (for bfloat16, torch and gloo add in float32 and round), and the sum is rounded once to the
    parameter's dtype. A parameter no share has a gradient for keeps ``grad=None``.
    """
    params = list(model.parameters())
    shares = []
    for r in range(world_size):
        model.zero_grad(set_to_none=True)
        backward(r)
        shares.append([p.grad for p in params])
    for index, param in enumerate(params):
        grads = [share[index] for share in shares]
        if all(g is None for g in grads):
            param.grad = None
            continue
        to = wire.get(param.dtype, param.dtype)
        widen = torch.finfo(to).bits > torch.finfo(param.dtype).bits
        parts = [g.to(to) / world_size if widen else (g / world_size).to(to)
                 for g in (torch.zeros_like(param) if g is None else g for g in grads)]
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        param.grad = total.to(param.dtype)


def assert_same_update(actual: torch.Tensor, expected: torch.Tensor, what: str, fused_on_gpu: bool) -> None:
    """Bit for bit; to float tolerance where ``fused_on_gpu`` and torch's fused kernel made
    ``actual`` (float32 and float64, see `FUSED_DTYPES`): on CUDA torch.optim runs its foreach
    kernel, which rounds otherwise (on the CPU the two agree here)."""
    actual = actual.to(expected.device)  # a fused Adam keeps its step count on the GPU, foreach on the host
    if fused_on_gpu and actual.dtype in FUSED_DTYPES:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, expected), f"{what} differs by up to {(actual - expected).abs().max().item():.3g}"


def parameter_error(model: nn.Module, reference: nn.Module, initial: dict[str, torch.Tensor]) -> float:
    """The largest difference from ``reference``, per parameter relative to how far training moved it."""
    model.state_dict()  # waits for pending updates
    errors = []
    for (name, a), (_, e) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        moved = (e.double() - initial[name].double()).abs().max().item()
        if moved > 0:
            errors.append((a.double() - e.double()).abs().max().item() / moved)
    assert errors, "training moved no parameter"
    return max(errors)


def case_reduced_in(rank, world_size, dtype, reduce_dtype, optimizer_name, label, micro_batches=1, scaled=False,
                    device="cpu"):
    """``Strategy(reduce_dtype=...)`` against one process whose gradients are summed the same way.

    Summed in float32 (16-bit parameters): bit for bit, parameters and optimizer state, since
    the update is torch.optim's on the same gradient. Sent as bfloat16 (float32 parameters): to
    float tolerance where the update is torch's fused kernel (bit for bit without it), and within
    `BFLOAT16_WIRE_ERROR` of one float32 process. The first iteration's gradients are the
    emulation's bit for bit. Sent as bfloat16, the emulation differs from a reduction in float32,
    so a reduction left in the parameters' dtype fails the case; summing two bfloat16 halves in
    float32 changes no value, so there the dtype and the bytes on the wire (`commsched.status`)
    tell, and `float32_sum_on_three_ranks` the values. One replica sums nothing, in no dtype: its
    gradients and parameters are those of one process reducing nothing.
    """
    summed = world_size > 1
    wire = {} if not summed else SUMMED_IN_FLOAT32 if reduce_dtype == torch.float32 else SENT_AS_BFLOAT16

    def run() -> None:
        model = parity_net(dtype, device)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        make = OPTIMIZERS[optimizer_name]
        emulated, emulated_optimizer = reference_copy(model, make)
        exact, exact_optimizer = reference_copy(model, make)
        unchanged = copy.deepcopy(model)  # its gradients reduced in the parameters' own dtype
        strategy = commsched.Strategy(reduce_dtype=reduce_dtype, **REDUCE_STRATEGIES[label])
        model, optimizer = commsched.prepare(model, make(model.parameters()), strategy)
        scaler, emulated_scaler = (new_scaler(device), new_scaler(device)) if scaled else (None, None)
        for iteration, (x, y) in enumerate(batches(world_size, REDUCE_ITERATIONS)):
            x, y = x.to(device), y.to(device)
            if scaled and iteration in INF_AT:
                x[1, 3] = float("inf")  # rank 0's sample: both skip this step
            backward_of_share(model, x, y, iteration, rank, micro_batches, scaler)
            reduce_like_strategy(emulated, lambda r: backward_of_share(
                emulated, x, y, iteration, r, micro_batches, emulated_scaler), world_size, wire)
            if iteration == 0:  # warm-up: the gradients are final when backward returns
                reduce_like_strategy(unchanged, lambda r: backward_of_share(
                    unchanged, x, y, iteration, r, micro_batches, emulated_scaler), world_size, {})
                changed = 0
                for (name, p), e, u in zip(model.named_parameters(), emulated.parameters(), unchanged.parameters(),
                                           strict=True):
                    assert (p.grad is None) == (e.grad is None), name
                    if p.grad is not None:
                        torch.testing.assert_close(p.grad, e.grad, rtol=0, atol=0, equal_nan=True,
                                                   msg=lambda m, n=name: f"'{n}': not the gradient summed in {wire}")
                        finite = e.grad.isfinite() & u.grad.isfinite()
                        changed += bool((e.grad[finite] != u.grad[finite]).any())
                assert changed > 0 or reduce_dtype == torch.float32 or not summed, (
                    "bfloat16 on the wire changed no gradient here: the case proves nothing")
            if scaled:
                scaler.step(optimizer)
                scaler.update()
                emulated_scaler.step(emulated_optimizer)
                emulated_scaler.update()
                assert scaler.get_scale() == emulated_scaler.get_scale()
            else:
                optimizer.step()
                emulated_optimizer.step()
            optimizer.zero_grad()
            emulated_optimizer.zero_grad()
            if reduce_dtype == torch.bfloat16 and not scaled:
                reduce_like_strategy(exact, lambda r: backward_of_share(
                    exact, x, y, iteration, r, micro_batches), world_size, {})
                exact_optimizer.step()
                exact_optimizer.zero_grad()
        status = commsched.status(model)
        figures = status.current_iteration
        commsched.release(model)
        overlapping = strategy.overlap_forward and not scaled and summed
        assert status.lifecycle is (commsched.Lifecycle.OVERLAPPING if overlapping else commsched.Lifecycle.SYNCHRONOUS)
        for bucket in status.buckets:  # float64 keeps its own dtype
            on_wire = wire.get(getattr(torch, bucket.dtype), getattr(torch, bucket.dtype))
            assert bucket.reduce_dtype == str(on_wire).removeprefix("torch."), bucket
            assert bucket.wire_nbytes * getattr(torch, bucket.dtype).itemsize == bucket.nbytes * on_wire.itemsize
        assert figures.bytes_issued == sum(b.wire_nbytes for b in status.buckets)
        assert (f"gradients summed in {str(reduce_dtype).removeprefix('torch.')}" in status.describe()) == summed
        if reduce_dtype == torch.float32 or not strategy.fuse_optimizer:
            fused_on_gpu = strategy.fuse_optimizer and torch.device(device).type != "cpu"
            for (name, a), e in zip(model.named_parameters(), emulated.parameters(), strict=True):
                assert_same_update(a, e, f"'{name}'", fused_on_gpu)
            state, emulated_state = optimizer.state_dict()["state"], emulated_optimizer.state_dict()["state"]
            assert state.keys() == emulated_state.keys() and state
            for index, entries in emulated_state.items():
                for key, value in entries.items():
                    assert_same_update(state[index][key], value, f"state[{index}][{key!r}]", fused_on_gpu)
        else:
            assert_same_parameters(model, emulated, rtol=1e-5, atol=1e-6)
        if reduce_dtype == torch.bfloat16 and not scaled and summed:
            error = parameter_error(model, exact, initial)
            assert parameter_error(emulated, exact, initial) > 1e-4, "bfloat16 on the wire left no trace"
            assert error < BFLOAT16_WIRE_ERROR, f"parameter error {error:.3g} against one float32 process"

    return run


def grad_scaler_unscales_bfloat16(device: str) -> bool:
    """Whether ``GradScaler`` can unscale bfloat16 gradients on ``device``: on the CPU, not on CUDA,
    whose kernel takes float16, float32 and float64 alone (torch 2.10 at least)."""
    grads = [torch.ones(1, dtype=torch.bfloat16, device=device)]
    found, one = torch.zeros(1, device=device), torch.ones(1, device=device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    except RuntimeError:  # NotImplementedError: "... not implemented for 'BFloat16'"
        return False
    return True


def case_reduce_dtype_differs(rank, device="cpu"):
    import pytest

    def run() -> None:
        model = parity_net(torch.float32, device)
        strategy = commsched.Strategy(reduce_dtype=torch.bfloat16 if rank == 1 else None)
        with pytest.raises(ValueError, match=r"different Strategy.reduce_dtype on different ranks: None on rank\(s\) "
                                             r"\[0\]; torch.bfloat16 on rank\(s\) \[1\]"):
            commsched.prepare(model, OPTIMIZERS["sgd_momentum"](model.parameters()), strategy)

    return run


def reduce_dtype_cases(rank: int, world_size: int, device: str = "cpu") -> None:
    """Every case, with the models and data on ``device``."""
    f32, bf16 = torch.float32, torch.bfloat16
    cases = {
        "summed in float32/bfloat16/sgd_momentum/default": case_reduced_in(
            rank, world_size, bf16, f32, "sgd_momentum", "default", device=device),
        "summed in float32/bfloat16/adam_eps_1e-4/small partitions": case_reduced_in(
            rank, world_size, bf16, f32, "adam_eps_1e-4", "small partitions", device=device),
        "summed in float32/float16/sgd_momentum/no overlap": case_reduced_in(
            rank, world_size, torch.float16, f32, "sgd_momentum", "no overlap", device=device),
        "summed in float32/bfloat16/adamw_eps_1e-4/no_sync": case_reduced_in(
            rank, world_size, bf16, f32, "adamw_eps_1e-4", "default", micro_batches=2, device=device),
        "summed in float32/bfloat16/sgd_momentum/GradScaler": case_reduced_in(
            rank, world_size, bf16, f32, "sgd_momentum", "default", scaled=True, device=device),
        "sent as bfloat16/sgd_momentum/default": case_reduced_in(
            rank, world_size, f32, bf16, "sgd_momentum", "default", device=device),
        "sent as bfloat16/adam/small partitions, no priority": case_reduced_in(
            rank, world_size, f32, bf16, "adam", "small partitions, no priority", device=device),
        "sent as bfloat16/adam/unfused, no overlap": case_reduced_in(
            rank, world_size, f32, bf16, "adam", "unfused, no overlap", device=device),
        "sent as bfloat16/sgd_momentum/no_sync": case_reduced_in(
            rank, world_size, f32, bf16, "sgd_momentum", "default", micro_batches=2, device=device),
        "sent as bfloat16/sgd_momentum/GradScaler": case_reduced_in(
            rank, world_size, f32, bf16, "sgd_momentum", "default", scaled=True, device=device),
    }
    if world_size > 1:  # one rank has no other to disagree with
        cases["ranks disagree"] = case_reduce_dtype_differs(rank, device)
    if not grad_scaler_unscales_bfloat16(device):  # (CUDA) torch itself cannot run this case, in one process either
        del cases["summed in float32/bfloat16/sgd_momentum/GradScaler"]
    run_subtests(cases)

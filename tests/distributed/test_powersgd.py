"""``Strategy(compression=PowerSGD(...))``: torch DDP's ``powerSGD_hook``, under the schedule.

Every case trains in float64, so that any difference of meaning shows (a missing error feedback,
a wrong scale, another bucket's ``Q``: 1e-3 or more from the first compressed step). Against a
single process commsched must agree to 1e-9. Against torch DDP with the hook each parameter must
be within 1e-6 of its tensor's largest element: the two first differ by rounding (1e-16 at the
first iteration: torch's optimizer and commsched's per-bucket update round differently), which the
power iteration and AdamW's normalisation grow to about 1e-8 of a tensor's largest element by the
50th iteration, by more or less on each CPU's kernels. Against torch DDP with the hook, the
model fits in one bucket: on gloo, DDP with the hook and two buckets or more stops with
"Received data size doesn't match expected size" (the hook issues its second and third
all-reduces from completion callbacks, on the bucket's group, in whatever order completions
come on each rank). Against the single process (`commsched.testing.powersgd`), commsched
runs its own schedule: several buckets, priority, partitions, credit window, forward overlap,
a layout changed after warm-up.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join

import commsched
from commsched.testing import OPTIMIZERS, run_subtests
from commsched.testing.powersgd import ReferencePowerSGD, bucket_slots_of, reference_step
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

BATCH = 4
AGAINST_TORCH = 1e-6
"""Against torch DDP with the hook: the tolerance, times each tensor's largest element (see above)."""


def _network() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
              torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)]
    return torch.nn.Sequential(*layers).double()


def _batches(world_size: int, iterations: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH * world_size, 16, generator=generator, dtype=torch.float64),
             torch.randn(BATCH * world_size, 4, generator=generator, dtype=torch.float64)) for _ in range(iterations)]


def _share_loss(network: torch.nn.Module, batch, rank: int) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(network(x[BATCH * rank:BATCH * (rank + 1)]), y[BATCH * rank:BATCH * (rank + 1)])


def _assert_close(actual: torch.nn.Module, expected: torch.nn.Module, of_largest: float = 0.0) -> None:
    """Equal to rtol 1e-7 and atol 1e-9, or within ``of_largest`` times each tensor's largest element."""
    actual.state_dict()  # waits for the updates still pending
    expected.state_dict()
    for (name, a), b in zip(actual.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=max(1e-9, of_largest * b.abs().max().item()),
                                   msg=lambda m, n=name: f"parameter '{n}': {m}")


# ------------------------------------------------------------------ against torch DDP
def case_same_as_ddp_hook(rank, world_size, optimizer_name, settings):
    """50 iterations, compression from the third: commsched's parameters are torch DDP's with
    ``powerSGD_hook`` and the same settings."""
    batches = _batches(world_size, 50)
    ddp = torch.nn.parallel.DistributedDataParallel(_network())
    ddp.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, **settings), powerSGD_hook.powerSGD_hook)
    ddp_optimizer = OPTIMIZERS[optimizer_name](ddp.parameters())
    for batch in batches:
        _share_loss(ddp, batch, rank).backward()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()
    model = _network()
    # DDP's layout: the first Q are drawn bucket by bucket, so the buckets must be DDP's (one here).
    strategy = commsched.Strategy(compression=commsched.PowerSGD(**settings), adaptive=False, timeout_s=60)
    model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), strategy)
    for batch in batches:
        _share_loss(model, batch, rank).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(commsched.status(model).buckets) == 1
    _assert_close(model, ddp.module, of_largest=AGAINST_TORCH)
    compression = commsched.status(model).compression
    commsched.release(model)
    assert compression.active and compression.ratio > 1.5, compression
    rank_of = settings["matrix_approximation_rank"]
    worth_it = tuple(name for name, p in ddp.module.named_parameters()
                     if p.dim() == 2 and (sum(p.shape) * min(rank_of, *p.shape) * 2 < p.numel()))
    assert compression.compressed_parameters == worth_it, (compression, worth_it)


def case_drop_in_takes_the_built_in_hooks(rank, world_size, hook_name):
    """The script's ``register_comm_hook`` line kept under `commsched.DistributedDataParallel`: the
    parameters are torch DDP's with the same hook (16-bit wires: within their rounding; torch's
    ``bf16_compress_hook`` needs CUDA, so there torch DDP without a hook is the reference)."""
    batches = _batches(world_size, 12)
    wide = hook_name != "powerSGD_hook"
    results = []
    for wrap in (torch.nn.parallel.DistributedDataParallel,
                 functools.partial(commsched.DistributedDataParallel, strategy=commsched.Strategy(adaptive=False))):
        network = _network().float() if wide else _network()
        model = wrap(network)
        if hook_name == "bf16_compress_hook" and wrap is torch.nn.parallel.DistributedDataParallel:
            pass
        elif hook_name == "powerSGD_hook":
            model.register_comm_hook(powerSGD_hook.PowerSGDState(None, start_powerSGD_iter=2, random_seed=5),
                                     powerSGD_hook.powerSGD_hook)
        elif hook_name == "builtin_fp16":
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        else:
            model.register_comm_hook(None, getattr(default_hooks, hook_name))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for x, y in batches:
            batch = (x.float(), y.float()) if wide else (x, y)
            _share_loss(model, batch, rank).backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(model)
    ddp, mine = results
    if hook_name == "powerSGD_hook":
        _assert_close(mine.module, ddp.module, of_largest=AGAINST_TORCH)
        assert commsched.status(mine.module).compression.active
    else:
        mine.module.state_dict()
        for a, b in zip(mine.module.parameters(), ddp.module.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
        wire = commsched.status(mine.module).buckets[0].reduce_dtype
        assert wire == {"allreduce_hook": "float32", "bf16_compress_hook": "bfloat16"}.get(hook_name, "float16"), wire
    with pytest.raises(RuntimeError, match=r"register_comm_hook can only be called once"):
        mine.register_comm_hook(None, default_hooks.allreduce_hook)
    commsched.release(mine.module)


def case_drop_in_refuses_other_hooks(rank, world_size):
    model = commsched.DistributedDataParallel(_network())
    with pytest.raises(ValueError, match=r"batched_powerSGD_hook compresses each DDP bucket as one square matrix"):
        model.register_comm_hook(powerSGD_hook.PowerSGDState(None), powerSGD_hook.batched_powerSGD_hook)
    with pytest.raises(ValueError, match=r"built-in comm hooks only .* got _noop: its code would run on DDP's"):
        model.register_comm_hook(None, _noop)
    commsched.release(model.module)


def _noop(state, bucket):
    raise AssertionError("never called")


# ------------------------------------------------------------------ against one process
STRATEGIES = {
    "default": dict(bucket_cap_mb=0.01, first_bucket_mb=0.005),
    "tiny_partitions_and_credit": dict(bucket_cap_mb=0.01, partition_mb=0.004, credit_mb=0.004),
    "no_overlap_no_priority": dict(bucket_cap_mb=0.01, overlap_forward=False, priority=False),
}


def case_same_as_one_process(rank, world_size, optimizer_name, label, settings, accumulate=False, iterations=16):
    """commsched's own schedule gives the single process's parameters (`ReferencePowerSGD`)."""
    batches = _batches(world_size, iterations)
    model = _network()
    reference = copy.deepcopy(model)
    reference_optimizer = OPTIMIZERS[optimizer_name](reference.parameters())
    compression = commsched.PowerSGD(**settings)
    reference_compression = ReferencePowerSGD(compression, world_size)
    strategy = commsched.Strategy(compression=compression, timeout_s=60, **STRATEGIES[label])
    model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), strategy)
    for batch in batches:
        if accumulate:  # two micro-batches, the first under no_sync(): the reference sees their sum
            with model.no_sync():
                _share_loss(model, batch, rank).backward()
        _share_loss(model, batch, rank).backward()
        optimizer.step()
        optimizer.zero_grad()
        scale = 2 if accumulate else 1
        reference_step(reference, reference_optimizer, reference_compression,
                       lambda r, batch=batch: scale * _share_loss(reference, batch, r), bucket_slots_of(model))
    assert len(commsched.status(model).buckets) > 1
    _assert_close(model, reference)
    commsched.release(model)


# ------------------------------------------------------------------ checkpoints
def case_resume_is_the_uninterrupted_run(rank, world_size):
    """Each rank saves its model and optimizer halfway; a new prepare() that loads them trains on to
    the uninterrupted run's parameters (the errors, the Q and the iteration count come back)."""
    batches = _batches(world_size, 12)
    settings = commsched.PowerSGD(start_powerSGD_iter=2, matrix_approximation_rank=2)
    strategy = commsched.Strategy(compression=settings, bucket_cap_mb=0.01, timeout_s=60)

    def trained(model, optimizer, part):
        for batch in part:
            _share_loss(model, batch, rank).backward()
            optimizer.step()
            optimizer.zero_grad()

    whole = _network()
    whole, whole_optimizer = commsched.prepare(whole, OPTIMIZERS["adamw"](whole.parameters()), strategy)
    trained(whole, whole_optimizer, batches)
    first = _network()
    first, first_optimizer = commsched.prepare(first, OPTIMIZERS["adamw"](first.parameters()), strategy)
    trained(first, first_optimizer, batches[:6])
    saved = copy.deepcopy((first.state_dict(), first_optimizer.state_dict()))
    assert saved[1]["commsched_powersgd"]["iterations"] == 6
    commsched.release(first)
    resumed = _network()
    resumed.load_state_dict(saved[0])
    resumed, resumed_optimizer = commsched.prepare(resumed, OPTIMIZERS["adamw"](resumed.parameters()), strategy)
    resumed_optimizer.load_state_dict(saved[1])
    trained(resumed, resumed_optimizer, batches[6:])
    _assert_close(resumed, whole)
    plain = torch.optim.AdamW(_network().parameters())
    plain.load_state_dict(saved[1])  # torch.optim ignores the compression's entry
    for model in (resumed, whole):
        commsched.release(model)


# ------------------------------------------------------------------ refusals
def case_refusals(rank, world_size):
    """What compression cannot do is refused at once, naming the fix."""
    model = _network()
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                         commsched.Strategy(compression=commsched.PowerSGD(start_powerSGD_iter=0),
                                                            timeout_s=60))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_share_loss(model, _batches(world_size, 1)[0], rank)).backward()
    with pytest.raises(ValueError, match=r"GradScaler steps this optimizer, but with Strategy\(compression=.*bf16"):
        scaler.step(optimizer)
    optimizer.step()
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=r"Join \(uneven inputs\) is not supported with Strategy\(compression="):
        with Join([model]):
            pass
    commsched.release(model)


def powersgd_grid(rank: int, world_size: int) -> None:
    cases = {}
    for optimizer_name in ("sgd_momentum", "adamw"):
        for approximation_rank in (1, 3):
            settings = dict(start_powerSGD_iter=3, matrix_approximation_rank=approximation_rank)
            cases[f"same_as_ddp_hook/{optimizer_name}/rank={approximation_rank}"] = functools.partial(
                case_same_as_ddp_hook, rank, world_size, optimizer_name, settings)
    for label in STRATEGIES:
        cases[f"same_as_one_process/{label}"] = functools.partial(
            case_same_as_one_process, rank, world_size, "adamw", label, dict(start_powerSGD_iter=0))
    variants = {
        "from_iteration_5": dict(start_powerSGD_iter=5, matrix_approximation_rank=2),
        "no_warm_start": dict(start_powerSGD_iter=0, warm_start=False),
        "no_error_feedback": dict(start_powerSGD_iter=0, use_error_feedback=False),
        "batched_draws_rank_4": dict(start_powerSGD_iter=1, matrix_approximation_rank=4,
                                     batch_tensors_with_same_shape=True, random_seed=11),
        "epsilon": dict(start_powerSGD_iter=0, orthogonalization_epsilon=1e-8),
    }
    for name, settings in variants.items():
        cases[f"same_as_one_process/{name}"] = functools.partial(
            case_same_as_one_process, rank, world_size, "sgd_momentum", "default", settings)
    cases["same_as_one_process/no_sync"] = functools.partial(
        case_same_as_one_process, rank, world_size, "sgd_momentum", "default", dict(start_powerSGD_iter=0), True)
    cases["resume_is_the_uninterrupted_run"] = functools.partial(case_resume_is_the_uninterrupted_run, rank,
                                                                  world_size)
    cases["refusals"] = functools.partial(case_refusals, rank, world_size)
    cases["buckets_capped_at_the_partition_size"] = functools.partial(case_buckets_capped_at_the_partition_size,
                                                                      rank, world_size)
    for hook_name in ("allreduce_hook", "bf16_compress_hook", "fp16_compress_hook", "builtin_fp16", "powerSGD_hook"):
        cases[f"drop_in_takes/{hook_name}"] = functools.partial(case_drop_in_takes_the_built_in_hooks, rank,
                                                                world_size, hook_name)
    cases["drop_in_refuses_other_hooks"] = functools.partial(case_drop_in_refuses_other_hooks, rank, world_size)
    run_subtests(cases)


def case_buckets_capped_at_the_partition_size(rank, world_size):
    """Compressed, buckets stay capped at the partition size, so that several buckets' compressed
    all-reduces hide behind the backward pass, and are never cut (a matrix's ``P`` and ``Q`` need
    all of it); ``partition_mb=None`` gives buckets of ``bucket_cap_mb``. The same with a comm hook
    registered on the drop-in (docs/records/2026-12-07-powersgd-and-the-arithmetic.md)."""
    partition_mb, cap_mb = 0.01, 0.05  # the network's 43 KiB of float64 gradients: 1 bucket under the cap

    def buckets(strategy, hook=None):
        if hook is None:
            network = _network()
            model, optimizer = commsched.prepare(network, OPTIMIZERS["sgd_momentum"](network.parameters()), strategy)
        else:
            model = commsched.DistributedDataParallel(_network(), strategy=strategy)
            model.register_comm_hook(powerSGD_hook.PowerSGDState(None, start_powerSGD_iter=2), hook)
            optimizer = OPTIMIZERS["sgd_momentum"](model.parameters())
        for batch in _batches(world_size, 6):
            _share_loss(model, batch, rank).backward()
            optimizer.step()
            optimizer.zero_grad()
        found = commsched.status(model).buckets
        commsched.release(model)
        return found

    layout = dict(bucket_cap_mb=cap_mb, first_bucket_mb=cap_mb)
    plain = buckets(commsched.Strategy(partition_mb=partition_mb, adaptive=False, **layout))
    compression = commsched.PowerSGD(start_powerSGD_iter=0)
    for label, found in (
            ("compressed", buckets(commsched.Strategy(compression=compression, partition_mb=partition_mb,
                                                      adaptive=False, **layout))),
            ("hook on the drop-in", buckets(commsched.Strategy(partition_mb=partition_mb, adaptive=False, **layout),
                                            powerSGD_hook.powerSGD_hook))):
        assert len(found) == len(plain) > 1, (label, found, plain)
        assert all(bucket.partitions == 1 for bucket in found), (label, found)
    whole = buckets(commsched.Strategy(compression=compression, partition_mb=None, adaptive=False, **layout))
    assert len(whole) == 1, whole


@pytest.mark.parametrize("world_size", [
    pytest.param(world_size, marks=in_shared_ranks(powersgd_grid, world_size, timeout_s=300)) for world_size in (2, 3)])
def test_powersgd(shared_ranks, world_size):
    shared_ranks.result()

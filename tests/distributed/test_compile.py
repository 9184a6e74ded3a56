"""torch.compile: a compiled model trains as one process would, and as torch DDP trains the same compiled model.

commsched's warm-up records its first iterations with a torch-function mode, which
dynamo must not trace: those forward passes run eagerly, and the model is compiled
from the first one after warm-up (see [Note: recording and torch.compile] in
commsched/watch/parameter_use.py), each graph cut where its buckets change and each
piece waiting for its own, without a graph break (see [Note: gates in compiled graphs]
in commsched/layout/gated_graphs.py).
``prepare(torch.compile(model))`` trains; a model compiled whole (``model.compile()``)
or compiled after ``prepare()`` is refused.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch._dynamo
import torch._inductor.config
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.parallel import DistributedDataParallel

import commsched
from commsched.testing import OPTIMIZERS, one_process_step, reference_copy, run_subtests
from commsched.testing.models import TinyGPT, TinyResNet
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

PER_RANK = 4
IMAGE = (1, 8, 8)
ITERATIONS = 8
"""Past warm-up (3 iterations, and the 4th's forward pass, which it still watches): forward overlap is exercised."""
RECORDED = 4
"""Iterations whose forward passes warm-up records, eagerly."""
OPTIMIZER = "sgd_momentum"


def batches(world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    n = world_size * PER_RANK
    return [(torch.randn(n, *IMAGE, generator=generator), torch.randint(0, 3, (n,), generator=generator))
            for _ in range(ITERATIONS)]


def share_loss(model, x, y, penalty=None):
    """``loss_of_share(r)``: rank ``r``'s loss on its slice, plus ``penalty()`` computed before the forward pass."""
    def loss_of_share(r: int) -> torch.Tensor:
        extra = penalty() if penalty is not None else 0.0
        mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
        return F.cross_entropy(model(x[mine]), y[mine]) + extra

    return loss_of_share


def train_ddp(base: torch.nn.Module, backend: str, data, rank: int) -> torch.nn.Module:
    """torch DDP on a copy of ``base`` compiled the same way; returns the trained module."""
    ddp_model = DistributedDataParallel(torch.compile(copy.deepcopy(base), backend=backend))
    optimizer = OPTIMIZERS[OPTIMIZER](ddp_model.parameters())
    for x, y in data:
        share_loss(ddp_model, x, y)(rank).backward()
        optimizer.step()
        optimizer.zero_grad()
    return ddp_model.module._orig_mod


def case_trains_as_one_process(rank: int, world_size: int, backend: str, against_ddp: bool,
                               overlap_forward: bool = True) -> None:
    """``prepare(torch.compile(model))``: eager while warm-up records, then compiled once and never again;
    the parameters are one process's and (``against_ddp``) torch DDP's on the same compiled model, buffers too.

    Without forward overlap only the first forward pass is recorded, and the model is one graph."""
    recorded = RECORDED if overlap_forward else 1
    torch.manual_seed(0)
    base = TinyResNet()
    reference, reference_optimizer = reference_copy(base, OPTIMIZERS[OPTIMIZER])
    data = batches(world_size)
    ddp_module = None
    if against_ddp:
        torch._dynamo.reset()
        # Apart from commsched's loop: compiled code there during warm-up counts as reading every parameter.
        ddp_module = train_ddp(base, backend, data, rank)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    model, optimizer = commsched.prepare(torch.compile(base, backend=counter),
                                         OPTIMIZERS[OPTIMIZER](base.parameters()),
                                         commsched.Strategy(overlap_forward=overlap_forward))
    graphs = []
    for x, y in data:
        share_loss(model, x, y)(rank).backward()
        optimizer.step()
        optimizer.zero_grad()
        graphs.append(counter.frame_count)
        one_process_step(reference_optimizer, share_loss(reference, x, y), world_size)
    assert graphs[:recorded] == [0] * recorded, f"graphs compiled by the end of each iteration: {graphs}"
    assert graphs[recorded] > 0 and graphs[recorded:] == [graphs[recorded]] * (ITERATIONS - recorded), (
        f"compiled once after warm-up, never again: {graphs}")
    assert commsched.status(model).lifecycle is (
        commsched.Lifecycle.OVERLAPPING if overlap_forward else commsched.Lifecycle.SYNCHRONOUS)
    # The original module's own state_dict(), first: it waits for the updates still pending under forward overlap.
    original = {key: value.clone() for key, value in base.state_dict().items()}
    assert list(model.state_dict()) == ["_orig_mod." + key for key in reference.state_dict()]
    compared = 0
    for (name, _), want in zip(base.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(original[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        compared += 1
    if ddp_module is not None:
        for (name, got), ddp in zip(base.state_dict().items(), ddp_module.state_dict().values(), strict=True):
            torch.testing.assert_close(got, ddp, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n} (DDP): {m}")
            compared += 1
    assert compared >= (50 if against_ddp else 20), compared
    commsched.release(model)


def case_compiled_submodule(rank: int, world_size: int) -> None:
    """A compiled submodule (``model.blocks.compile()``): eager while warm-up records, compiled after, and
    one process's parameters."""
    torch.manual_seed(0)
    base = TinyResNet()
    reference, reference_optimizer = reference_copy(base, OPTIMIZERS[OPTIMIZER])
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    base.blocks.compile(backend=counter)
    model, optimizer = commsched.prepare(base, OPTIMIZERS[OPTIMIZER](base.parameters()))
    graphs = []
    for x, y in batches(world_size):
        share_loss(model, x, y)(rank).backward()
        optimizer.step()
        optimizer.zero_grad()
        graphs.append(counter.frame_count)
        one_process_step(reference_optimizer, share_loss(reference, x, y), world_size)
    assert graphs[:RECORDED] == [0] * RECORDED and graphs[RECORDED] > 0, graphs
    assert commsched.status(model).lifecycle is commsched.Lifecycle.OVERLAPPING
    assert list(model.state_dict()) == list(reference.state_dict())
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    commsched.release(model)


GPT_ITERATIONS = 10
SMALL_BUCKETS = dict(bucket_cap_mb=0.01, first_bucket_mb=0.01, adaptive=False)
"""Several buckets in TinyGPT (about 13 kB a block), the same from the first iteration on: each graph is
cut at them once."""


def gpt_batches(world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    n = world_size * PER_RANK
    return [(torch.randint(0, 32, (n, 8), generator=generator), torch.randint(0, 32, (n, 8), generator=generator))
            for _ in range(GPT_ITERATIONS)]


def gpt_loss(model, x, y):
    def loss_of_share(r: int) -> torch.Tensor:
        mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
        return F.cross_entropy(model(x[mine]).reshape(-1, 32), y[mine].reshape(-1))

    return loss_of_share


def compiled_gpt(how: str, backend) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(model given to prepare(), module whose parameters train)`` for TinyGPT compiled ``how``:
    whole (nanoGPT's ``torch.compile(model)``), per block as torchtitan does (each block a
    ``torch.compile(block, fullgraph=True)``), or per block in place (``block.compile()``, with
    ``fullgraph=True`` or not)."""
    torch.manual_seed(0)
    base = TinyGPT()
    if how == "whole":
        return torch.compile(base, backend=backend), base
    for i, block in enumerate(base.blocks):
        if how == "per block":
            base.blocks[i] = torch.compile(block, backend=backend, fullgraph=True)
        else:
            block.compile(backend=backend, fullgraph=how.endswith("fullgraph"))
    return base, base


def case_gpt_compiled(rank: int, world_size: int, how: str, backend: str = "aot_eager") -> None:
    """TinyGPT compiled ``how``, several buckets, forward overlap: dynamo compiles one graph (the model's,
    or one for all blocks alike) at the first compiled iteration and never again, with no graph break and
    no recompile, its pieces waiting for their buckets; the parameters are one process's (and, compiled
    whole, torch DDP's on the same compiled model, compiled first in the same process). Two iterations
    under ``set_stance("force_eager")`` run the module gates eagerly instead, as exactly."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    data = gpt_batches(world_size)
    ddp_module = None
    if how == "whole":
        torch.manual_seed(0)
        ddp_module = DistributedDataParallel(torch.compile(TinyGPT(), backend=backend))
        ddp_optimizer = OPTIMIZERS[OPTIMIZER](ddp_module.parameters())
        for x, y in data:
            gpt_loss(ddp_module, x, y)(rank).backward()
            ddp_optimizer.step()
            ddp_optimizer.zero_grad()
        # No reset: dynamo must not run the graphs it compiled for DDP's copy, which wait for nothing, for
        # commsched's ([Note: dynamo and module hooks] in commsched/layout/compiled_gates.py).
        counters.clear()
    prepared, base = compiled_gpt(how, backend)
    torch.manual_seed(0)
    reference, reference_optimizer = reference_copy(TinyGPT(), OPTIMIZERS[OPTIMIZER])
    model, optimizer = commsched.prepare(prepared, OPTIMIZERS[OPTIMIZER](base.parameters()),
                                         commsched.Strategy(**SMALL_BUCKETS))
    graphs, eager = [], (GPT_ITERATIONS - 2, GPT_ITERATIONS - 1)
    for iteration, (x, y) in enumerate(data):
        stance = torch.compiler.set_stance("force_eager" if iteration in eager else "default")
        with stance:
            gpt_loss(model, x, y)(rank).backward()
        optimizer.step()
        optimizer.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
        one_process_step(reference_optimizer, gpt_loss(reference, x, y), world_size)
    assert commsched.status(model).lifecycle is commsched.Lifecycle.OVERLAPPING
    status = commsched.status(model)
    assert len(status.buckets) >= 3, status.buckets
    # Compiled whole, the model's graph is cut at every bucket; per block, the blocks' graph (TinyGPT's
    # 10 kB buckets hold about one block each) at least once.
    assert len(status.compiled_pieces) == 1 and status.compiled_pieces[0] >= (
        len(status.buckets) if how == "whole" else 2), status.compiled_pieces
    assert graphs[:RECORDED] == [0] * RECORDED and graphs[RECORDED:] == [1] * (GPT_ITERATIONS - RECORDED), (
        f"graphs compiled by the end of each iteration: {graphs}; one, at the first compiled iteration")
    assert not [k for k in counters["frames"] if "limit" in k], dict(counters["frames"])
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    optimizer.synchronize()
    for (name, got), want in zip(base.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    if ddp_module is not None:
        for (name, got), ddp in zip(base.named_parameters(), ddp_module.module._orig_mod.parameters(), strict=True):
            torch.testing.assert_close(got, ddp, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n} (DDP): {m}")
    commsched.release(model)


def norm_penalty(model: torch.nn.Module) -> torch.Tensor:
    """Not linear in the parameters, so stale values change the gradients (BatchNorm's biases start at zero)."""
    return 0.01 * sum(((p**2).sum() + 0.01).sqrt() for p in model.parameters())


def unseen_backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """A dynamo backend whose compiled code no torch-function mode sees, as compiled kernels are not seen
    (aot_eager's and inductor's wrappers happen to touch their inputs eagerly)."""
    def run(*args: torch.Tensor):
        with torch._C.DisableTorchFunction():
            return graph(*args)

    return run


def case_compiled_penalty_before_forward(rank: int, world_size: int) -> None:
    """A compiled penalty reads the parameters before the forward pass: warm-up cannot see what compiled
    code reads, so every bucket is updated at ``step()``, and training stays one process's."""
    torch.manual_seed(0)
    base = TinyResNet()
    reference, reference_optimizer = reference_copy(base, OPTIMIZERS[OPTIMIZER])
    torch._dynamo.reset()
    model, optimizer = commsched.prepare(base, OPTIMIZERS[OPTIMIZER](base.parameters()))
    penalty = torch.compile(functools.partial(norm_penalty, model), backend=unseen_backend)
    for x, y in batches(world_size):
        share_loss(model, x, y, penalty)(rank).backward()
        optimizer.step()
        optimizer.zero_grad()
        one_process_step(reference_optimizer, share_loss(reference, x, y, lambda: norm_penalty(reference)),
                         world_size)
    assert commsched.status(model).lifecycle is commsched.Lifecycle.OVERLAPPING
    optimizer.synchronize()
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    commsched.release(model)


def case_compiled_whole_is_refused(rank: int, world_size: int) -> None:
    """``model.compile()`` compiles the model's whole call, commsched's hooks on it included: ``prepare()``
    refuses it, naming the fix."""
    torch.manual_seed(0)
    model = TinyResNet()
    model.compile(backend="eager")
    with pytest.raises(RuntimeError, match=r"model\.compile\(\).*commsched\.prepare\(torch\.compile\(model\)"):
        commsched.prepare(model, OPTIMIZERS[OPTIMIZER](model.parameters()))
    assert not isinstance(model, commsched.CommschedModule)


def case_compiled_after_prepare_is_refused(rank: int, world_size: int, how: str) -> None:
    """Compiling the prepared model would compile commsched's hooks and the warm-up's recording: its first
    forward pass refuses it, naming the fix."""
    torch.manual_seed(0)
    base = TinyResNet()
    model, _ = commsched.prepare(base, OPTIMIZERS[OPTIMIZER](base.parameters()))
    if how == "torch.compile":
        model = torch.compile(model, backend="eager")
    else:
        model.compile(backend="eager")
    x, _ = batches(world_size)[0]
    with pytest.raises(RuntimeError, match=r"compiled after commsched\.prepare\(\).*prepare\(torch\.compile"):
        model(x[:PER_RANK])
    commsched.release(base)


def compile_grid(rank: int, world_size: int) -> None:
    cases = {
        "torch.compile then prepare, aot_eager": functools.partial(
            case_trains_as_one_process, rank, world_size, "aot_eager", True),
        # Inductor compiles each graph for seconds here: one case, one graph (no gates between
        # modules without forward overlap), against one process only.
        "torch.compile then prepare, inductor": functools.partial(
            case_trains_as_one_process, rank, world_size, "inductor", False, False),
        "compiled submodule": functools.partial(case_compiled_submodule, rank, world_size),
        "TinyGPT compiled whole": functools.partial(case_gpt_compiled, rank, world_size, "whole"),
        "TinyGPT compiled whole, inductor": functools.partial(case_gpt_compiled, rank, world_size, "whole",
                                                              "inductor"),
        "TinyGPT compiled per block": functools.partial(case_gpt_compiled, rank, world_size, "per block"),
        "TinyGPT compiled per block in place": functools.partial(
            case_gpt_compiled, rank, world_size, "per block in place"),
        "TinyGPT compiled per block in place, fullgraph": functools.partial(
            case_gpt_compiled, rank, world_size, "per block in place, fullgraph"),
        "compiled penalty before the forward pass": functools.partial(
            case_compiled_penalty_before_forward, rank, world_size),
        "Module.compile then prepare: refused": functools.partial(case_compiled_whole_is_refused, rank, world_size),
    }
    for how in ("torch.compile", "Module.compile"):
        cases[f"prepare then {how}: refused"] = functools.partial(
            case_compiled_after_prepare_is_refused, rank, world_size, how)
    # Inductor lays convolutions out channels-last; torch's CPU convolution backward in that layout
    # corrupts the heap at one thread on some CPUs (AVX2 AMD EPYC, torch 2.13.0), in eager mode too
    # and without commsched. The model's own layout keeps what these cases check.
    try:
        with torch._inductor.config.patch(layout_optimization=False):
            run_subtests(cases)
    finally:
        torch._dynamo.reset()


@in_shared_ranks(compile_grid, 2, timeout_s=300)
def test_compiled_models(shared_ranks):
    shared_ranks.result()

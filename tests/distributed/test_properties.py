"""Property tests: random models and strategies train as one process does, or fail clearly.

Hypothesis draws a small model (Linear, Conv1d, Embedding and LayerNorm layers
of random sizes; float32 and float64 parameters; frozen parameters; weights tied
between two modules; a branch used only on some ranks and iterations, and a
module never called), a `Strategy` (sharded optimizer state or not) and an optimizer (a tensor learning rate, an
LR scheduler), and trains a few iterations. Every rank must end with the
parameters of single-process training on the concatenated batch (also as read
right after the last ``step()`` through one submodule's ``state_dict()``), or
every rank must raise a clear error. A Strategy
with a value out of range must raise a ValueError naming the field.

Spawning processes costs seconds, so hypothesis runs inside the spawned ranks:
with ``derandomize=True`` and the same settings every rank draws the same
examples in the same order. After each example the ranks exchange their
outcomes and fail together, so they never part ways. Shrinking is off (a
failing example is printed whole, and rerunning it costs one spawn).
"""

from __future__ import annotations

import collections
import functools
import math
import traceback
from dataclasses import asdict, dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim.lr_scheduler import ExponentialLR

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.strategy import MAX_SIZE_MB, MIN_BUCKET_MB, MIN_PARTITION_MB
from commsched.testing import assert_equal_on_all_ranks, assert_same_parameters, one_process_backward, reference_copy
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

ITERATIONS = WARMUP_ITERATIONS + 3
"""Past warm-up and the plan: forward overlap runs where the strategy allows it."""

TIMEOUT_S = 30.0
"""A rank that stops early makes the others raise instead of hang."""

RTOL, ATOL = 1e-4, 1e-5
"""As the parity tests: Adam divides by the gradient's own size, so rounding in a gradient near
zero (summed in another order across ranks) moves a parameter by more than float32's epsilon."""


# ---------------------------------------------------------------- what is drawn


@dataclass(frozen=True)
class Layer:
    kind: str
    """``"linear"`` (then tanh), ``"conv1d"`` (one input channel, then tanh, averaged
    over its output channels) or ``"layernorm"``."""
    width: int
    """Output width of a linear layer, output channels of a conv1d."""
    kernel: int
    bias: bool
    float64: bool
    frozen: str
    """``"no"``, ``"all"`` (every parameter of the layer) or ``"weight"``."""


@dataclass(frozen=True)
class ModelSpec:
    in_features: int
    width: int
    vocabulary: int
    layers: tuple[Layer, ...]
    head_bias: bool
    tie_head_to_embedding: bool
    """``head.weight = embed.weight``: one parameter in two modules."""
    tie_unused_to_aux: bool
    """``never_used.weight = aux.weight``: a module never called shares the weight
    of one called only on some ranks and iterations."""
    frozen: tuple[str, ...]
    """Top-level modules frozen before prepare: among proj, embed, aux, head. The
    output ``gain`` stays trainable, so every rank's loss has a gradient."""
    freeze_everything: bool
    """No trainable parameter at all: prepare() must refuse the model on every rank."""
    aux_used: tuple[tuple[bool, ...], ...]
    """Per iteration, per rank: whether that rank's forward pass calls ``aux``."""
    per_rank_batch: int


@dataclass(frozen=True)
class LoopSpec:
    set_to_none: bool
    """``zero_grad(set_to_none=...)``."""
    clip_norm: float | None
    """``clip_grad_norm_`` between backward() and step(): gradients changed in place."""
    read_submodule: str | None
    """Right after the last ``step()``, this submodule's ``state_dict()`` (a backbone or a head
    saved alone) must hold the parameters that step made."""


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    lr: float
    weight_decay: float
    trainable_only: bool
    """Build the optimizer from trainable parameters only (else from all of them)."""
    tensor_lr: bool
    """``lr=torch.tensor(...)``, which the LR scheduler below changes in place after each ``step()``."""
    scheduled: bool
    """An ``ExponentialLR`` stepped after each ``step()``."""


@dataclass(frozen=True)
class Case:
    model: ModelSpec
    strategy: dict
    invalid: str | None
    """The field given a value out of range, if any: Strategy must refuse it, naming it."""
    optimizer: OptimizerSpec
    loop: LoopSpec
    seed: int


@st.composite
def layers(draw):
    kind = draw(st.sampled_from(["linear", "conv1d", "layernorm"]))
    return Layer(
        kind=kind,
        width=draw(st.integers(1, 12)),
        kernel=draw(st.sampled_from([1, 3, 5])),
        bias=draw(st.booleans()),
        float64=draw(st.booleans()),
        frozen=draw(st.sampled_from(["no", "no", "all", "weight"])),
    )


@st.composite
def model_specs(draw, world_size):
    return ModelSpec(
        in_features=draw(st.integers(1, 6)),
        width=draw(st.integers(2, 10)),
        vocabulary=draw(st.integers(2, 7)),
        layers=tuple(draw(st.lists(layers(), min_size=0, max_size=4))),
        head_bias=draw(st.booleans()),
        tie_head_to_embedding=draw(st.booleans()),
        tie_unused_to_aux=draw(st.booleans()),
        frozen=tuple(draw(st.lists(st.sampled_from(["proj", "embed", "aux", "head"]), unique=True, max_size=4))),
        freeze_everything=draw(st.integers(0, 14)) == 14,
        aux_used=tuple(tuple(draw(st.lists(st.booleans(), min_size=world_size, max_size=world_size)))
                       for _ in range(ITERATIONS)),
        per_rank_batch=draw(st.integers(1, 3)),
    )


def sizes(low, small, defaults):
    """A size in MiB: small ones (several buckets or partitions for these tiny models) or a usual one."""
    return st.one_of(st.floats(low, small), st.sampled_from([*defaults, MAX_SIZE_MB]))


@st.composite
def valid_strategies(draw):
    return {
        "bucket_cap_mb": draw(sizes(MIN_BUCKET_MB, 0.004, [25.0])),
        "first_bucket_mb": draw(sizes(MIN_BUCKET_MB, 0.002, [1.0])),
        "partition_mb": draw(st.none() | sizes(MIN_PARTITION_MB, 0.004, [1.0])),
        "credit_mb": draw(st.none() | sizes(MIN_PARTITION_MB, 0.008, [4.0])),
        "priority": draw(st.booleans()),
        "overlap_forward": draw(st.booleans()),
        "fuse_optimizer": draw(st.booleans()),
        "broadcast_buffers": draw(st.booleans()),
        "check_finite": draw(st.sampled_from([None, "skip", "raise"])),
        "backend": draw(st.sampled_from([commsched.AllReduce(), commsched.AllReduce(shard_optimizer=True)])),
    }


INVALID = {
    "bucket_cap_mb": [0, -1.0, math.nan, math.inf, "25", True, MIN_BUCKET_MB / 2, MAX_SIZE_MB * 2],
    "first_bucket_mb": [0.0, -0.5, math.nan, None],
    "partition_mb": [0, -1.0, math.inf, "1", MIN_PARTITION_MB / 2, MAX_SIZE_MB * 2],
    "credit_mb": [0, -4.0, math.nan, MIN_PARTITION_MB / 2],
    "timeout_s": [0, -1.0, math.inf, 0.5],
    "priority": [1, "yes", None],
    "overlap_forward": [0, "no"],
    "fuse_optimizer": [1.0, None],
    "check_finite": [True, "warn"],
}


@st.composite
def cases(draw, world_size):
    strategy, invalid = draw(valid_strategies()), None
    if draw(st.integers(0, 9)) == 9:  # now and then one field out of range
        invalid = draw(st.sampled_from(sorted(INVALID)))
        strategy[invalid] = draw(st.sampled_from(INVALID[invalid]))
    optimizer = OptimizerSpec(
        name=draw(st.sampled_from(["sgd", "sgd_momentum", "sgd_nesterov", "adam", "adamw"])),
        lr=draw(st.sampled_from([1e-3, 1e-2, 5e-2])),
        weight_decay=draw(st.sampled_from([0.0, 1e-2])),
        trainable_only=draw(st.booleans()),
        tensor_lr=draw(st.booleans()),
        scheduled=draw(st.booleans()),
    )
    loop = LoopSpec(set_to_none=draw(st.booleans()), clip_norm=draw(st.sampled_from([None, None, 0.5])),
                    read_submodule=draw(st.sampled_from([None, "blocks", "head", "aux"])))
    return Case(model=draw(model_specs(world_size)), strategy=strategy, invalid=invalid, optimizer=optimizer,
                loop=loop, seed=draw(st.integers(0, 2**16)))


# ------------------------------------------------------------------- the model


class Block(nn.Module):
    """One drawn layer, in its own dtype; activations enter and leave as float32."""

    def __init__(self, layer: Layer, width: int):
        super().__init__()
        self.kind = layer.kind
        if layer.kind == "linear":
            self.inner = nn.Linear(width, layer.width, bias=layer.bias)
            self.out_width = layer.width
        elif layer.kind == "conv1d":
            self.inner = nn.Conv1d(1, layer.width, layer.kernel, padding=layer.kernel // 2, bias=layer.bias)
            self.out_width = width
        else:
            self.inner = nn.LayerNorm(width, bias=layer.bias)
            self.out_width = width
        self.dtype = torch.float64 if layer.float64 else torch.float32
        self.inner.to(self.dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h.to(self.dtype)
        if self.kind == "linear":
            h = torch.tanh(self.inner(h))
        elif self.kind == "conv1d":
            # tanh: a bias averaged over channels is a uniform shift, which a LayerNorm
            # after it removes; its gradient would be rounding noise, which Adam amplifies.
            h = torch.tanh(self.inner(h.unsqueeze(1))).mean(dim=1)
        else:
            h = self.inner(h)
        return h.float()


class RandomNet(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.proj = nn.Linear(spec.in_features, spec.width)
        self.embed = nn.Embedding(spec.vocabulary, spec.width)
        nn.init.normal_(self.embed.weight, std=0.3)  # tied to the head too: keep training tame
        blocks, width = [], spec.width
        for layer in spec.layers:
            blocks.append(Block(layer, width))
            width = blocks[-1].out_width
        self.blocks = nn.ModuleList(blocks)
        self.aux = nn.Linear(width, width)
        self.never_used = nn.Linear(width, width)
        # The head maps back to the embedding's width when tied, as language models do.
        self.head = nn.Linear(spec.width if spec.tie_head_to_embedding else width, spec.vocabulary,
                              bias=spec.head_bias)
        self.to_head = nn.Linear(width, spec.width) if spec.tie_head_to_embedding else nn.Identity()
        if spec.tie_head_to_embedding:
            self.head.weight = self.embed.weight
        if spec.tie_unused_to_aux:
            self.never_used.weight = self.aux.weight
        self.gain = nn.Parameter(torch.zeros(spec.vocabulary))
        for layer, block in zip(spec.layers, self.blocks):
            params = list(block.parameters())
            for param in params if layer.frozen == "all" else params[:1] if layer.frozen == "weight" else []:
                param.requires_grad_(False)
        for name in spec.frozen:
            getattr(self, name).requires_grad_(False)
        if spec.freeze_everything:
            self.requires_grad_(False)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = self.proj(x) + self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        if use_aux:
            h = h + torch.tanh(self.aux(h))
        return self.head(self.to_head(h)) + self.gain


def make_optimizer(spec: OptimizerSpec, parameters) -> torch.optim.Optimizer:
    """The drawn optimizer over ``parameters`` (a model's), or over those that train."""
    parameters = list(parameters)
    params = [p for p in parameters if p.requires_grad or not spec.trainable_only] or parameters
    lr = torch.tensor(spec.lr) if spec.tensor_lr else spec.lr
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=spec.weight_decay)
    if spec.name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=spec.weight_decay)
    momentum = 0.0 if spec.name == "sgd" else 0.9
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=spec.name == "sgd_nesterov",
                           weight_decay=spec.weight_decay)


def make_scheduler(spec: OptimizerSpec, optimizer: torch.optim.Optimizer) -> ExponentialLR | None:
    return ExponentialLR(optimizer, 0.7) if spec.scheduled else None


def data(spec: ModelSpec, seed: int, world_size: int):
    generator = torch.Generator().manual_seed(seed)
    n = spec.per_rank_batch * world_size
    for _ in range(ITERATIONS):
        yield (torch.randn(n, spec.in_features, generator=generator),
               torch.randint(0, spec.vocabulary, (n,), generator=generator),
               torch.randn(n, spec.vocabulary, generator=generator))


# ------------------------------------------------------------------ one example


def check_case(rank: int, world_size: int, case: Case) -> str:
    """Train ``case`` here and single-process on the concatenated batch; compare.

    Returns which path the example took, so the test can check that each was taken.
    """
    arguments = {"timeout_s": TIMEOUT_S, **case.strategy}
    if case.invalid is not None:
        with pytest.raises(ValueError, match=rf"Strategy\.{case.invalid} "):
            commsched.Strategy(**arguments)
        return "refused strategy"
    strategy = commsched.Strategy(**arguments)
    spec = case.model
    torch.manual_seed(case.seed)
    model = RandomNet(spec)
    reference, reference_optimizer = reference_copy(model, functools.partial(make_optimizer, case.optimizer))
    optimizer = make_optimizer(case.optimizer, model.parameters())
    if not any(p.requires_grad for p in model.parameters()):
        with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
            commsched.prepare(model, optimizer, strategy)
        return "nothing to train"
    model, optimizer = commsched.prepare(model, optimizer, strategy)
    scheduler = make_scheduler(case.optimizer, optimizer)
    reference_scheduler = make_scheduler(case.optimizer, reference_optimizer)
    mine = slice(rank * spec.per_rank_batch, (rank + 1) * spec.per_rank_batch)
    for iteration, (x, tokens, y) in enumerate(data(spec, case.seed, world_size)):
        used = spec.aux_used[iteration]
        F.mse_loss(model(x[mine], tokens[mine], used[rank]), y[mine]).backward()
        clip(model, case.loop)
        optimizer.step()
        optimizer.zero_grad(set_to_none=case.loop.set_to_none)
        if scheduler is not None:
            scheduler.step()

        def loss_of_share(r, x=x, tokens=tokens, y=y, used=used):
            share = slice(r * spec.per_rank_batch, (r + 1) * spec.per_rank_batch)
            return F.mse_loss(reference(x[share], tokens[share], used[r]), y[share])

        one_process_backward(loss_of_share, world_size)
        clip(reference, case.loop)
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=case.loop.set_to_none)
        if reference_scheduler is not None:
            reference_scheduler.step()
    assert all(p.isfinite().all() for p in reference.parameters()), "the drawn example diverges on one process"
    name = case.loop.read_submodule
    read = None if name is None else {k: v.clone() for k, v in getattr(model, name).state_dict().items()}
    assert_equal_on_all_ranks(model)  # collective: before any check that fails on one rank alone
    assert_same_parameters(model, reference, rtol=RTOL, atol=ATOL)
    if read is not None:
        expected = getattr(reference, name).state_dict()
        assert read.keys() == expected.keys(), (list(read), list(expected))
        for key, value in expected.items():
            torch.testing.assert_close(read[key], value, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{name}.{k}: {m}")
    lifecycle = commsched.status(model).lifecycle
    commsched.release(model)
    return f"trained, {lifecycle.name.lower()}" + (", sharded" if strategy.shards_optimizer else "")


def clip(model: nn.Module, loop: LoopSpec) -> None:
    if loop.clip_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], loop.clip_norm)


def together(rank: int, world_size: int, group: dist.ProcessGroup, case: Case) -> str:
    """Run one example; if it failed on any rank, fail on every rank with every rank's error."""
    failure = None
    try:
        path = check_case(rank, world_size, case)
    except (Exception, pytest.fail.Exception):  # noqa: BLE001 - every rank must hear of it
        failure = traceback.format_exc()
    failures: list[str | None] = [None] * world_size
    dist.all_gather_object(failures, failure, group=group)
    if any(failures):
        report = "\n".join(f"----- rank {r} -----\n{text}" for r, text in enumerate(failures) if text)
        raise AssertionError(f"{describe(case)}\n{report}")
    return path


def describe(case: Case) -> str:
    return "\n".join(f"{name}: {value}" for name, value in asdict(case).items())


SETTINGS = settings(
    max_examples=30,
    derandomize=True,
    database=None,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)


def properties(rank: int, world_size: int, max_examples: int) -> list[str]:
    """Run the property; return the path each example took on this rank.

    Rank 0 alone draws the examples and sends each to the others: Hypothesis
    on every rank would draw the same ones only as long as every rank's engine
    decides alike, and its decisions may depend on how long examples take
    (once, in CI, two ranks drew different examples and met in mismatched
    collectives)."""
    group = dist.new_group(backend="gloo")
    paths: list[str] = []
    if rank != 0:
        failure: AssertionError | None = None
        while (case := _next_case(None, group)) is not None:
            try:
                paths.append(together(rank, world_size, group, case))
            except AssertionError as error:  # rank 0 reports it; Hypothesis replays the failing example
                failure = failure or error
        if failure is not None:
            raise failure
        return paths

    @settings(SETTINGS, max_examples=max_examples)
    @given(case=cases(world_size))
    def each(case: Case) -> None:
        _next_case(case, group)
        paths.append(together(rank, world_size, group, case))

    try:
        each()
    finally:
        _next_case(None, group)  # the end: the other ranks return
    return paths


def _next_case(case: Case | None, group: dist.ProcessGroup) -> Case | None:
    """Rank 0's next example (None: there are no more) on every rank. Collective."""
    message = [case]
    dist.broadcast_object_list(message, group=group, group_src=0)
    return message[0]


@pytest.mark.parametrize("world_size, max_examples", [
    pytest.param(world_size, max_examples, marks=in_shared_ranks(properties, world_size, max_examples, timeout_s=300))
    for world_size, max_examples in [(2, 30), (3, 12)]])
def test_random_models_and_strategies(shared_ranks, world_size, max_examples):
    paths = shared_ranks.result()
    assert all(p == paths[0] for p in paths), f"the ranks took different paths: {paths}"
    taken = collections.Counter(paths[0])
    assert taken["trained, overlapping"] and taken["trained, synchronous"], f"paths taken: {taken}"
    assert taken["trained, overlapping, sharded"] or taken["trained, synchronous, sharded"], f"paths taken: {taken}"

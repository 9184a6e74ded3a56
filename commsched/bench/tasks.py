"""Training tasks for the benchmarks that compare how systems train, not only how fast: a model,
its data, its loss and its optimizer, the same stream of batches for every system; and what those
benchmarks share to train systems side by side and draw their loss curves.

The bench models (`commsched.bench.models`) with SGD and momentum, and a small GPT (next-token
prediction on sequences of a fixed random Markov chain) and nanoGPT's model with AdamW.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

BATCH = {"resnet-like": 32, "vgg-like": 64, "transformer-like": 16, "mlp": 32, "gpt": 16, "nanogpt": 8, "vit-like": 16}
"""Per rank, as `commsched bench`; the GPT's in sequences of `GPT_SEQUENCE` tokens."""
GPT_VOCAB, GPT_SEQUENCE = 512, 64


class SmallGPT(nn.Module):
    """A causal Transformer language model: 4 layers of width 128, 0.9M parameters."""

    def __init__(self, vocab: int = GPT_VOCAB, width: int = 128, layers: int = 4, heads: int = 4,
                 sequence: int = GPT_SEQUENCE):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(sequence, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(sequence), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.tokens(tokens) + self.position[:length]
        h = self.blocks(h, mask=self.mask[:length, :length].to(h.dtype), is_causal=True)
        return self.head(self.norm(h))


def nanogpt() -> nn.Module:
    """nanoGPT's model at 4 layers of width 192 (its own blocks, ``F.scaled_dot_product_attention``,
    a head tied to the token embedding), on this module's vocabulary and sequence length."""
    from commsched.testing.models import TinyGPT

    return TinyGPT(vocab=GPT_VOCAB, width=192, layers=4, heads=4, length=GPT_SEQUENCE)


@dataclass(frozen=True)
class Task:
    """A model, its data and its loss."""

    name: str
    build: Callable[[], nn.Module]
    batches: Callable[[int, int], Iterator[tuple[torch.Tensor, torch.Tensor]]]
    """(batch size, seed) -> an endless stream of (inputs, targets), identical for identical seeds."""
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dtype = next(model.parameters()).dtype
        if x.is_floating_point():
            x = x.to(dtype)
        out = model(x).float()
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def markov_batches(batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of a fixed random Markov chain (each token has 8 likely successors): learnable."""
    table_generator = torch.Generator().manual_seed(7)
    logits = torch.randn(GPT_VOCAB, GPT_VOCAB, generator=table_generator)
    likely = logits.topk(8, dim=1).indices
    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.empty(batch_size, GPT_SEQUENCE + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(GPT_VOCAB, (batch_size,), generator=generator)
        for t in range(GPT_SEQUENCE):
            pick = torch.randint(8, (batch_size,), generator=generator)
            tokens[:, t + 1] = likely[tokens[:, t], pick]
        yield tokens[:, :-1], tokens[:, 1:]


def task(name: str) -> Task:
    from commsched.bench.models import WORKLOADS

    if name in ("gpt", "nanogpt"):
        return Task(name, SmallGPT if name == "gpt" else nanogpt, markov_batches,
                    lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
    workload = WORKLOADS[name]
    return Task(name, workload.build, lambda batch, seed: workload.batches(batch, seed=seed),
                lambda model: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))


# --------------------------------------------------------------- training side by side
def release(model: nn.Module) -> None:
    """`commsched.release` for a prepared model; nothing for torch's systems."""
    import commsched

    if isinstance(model, commsched.CommschedModule):
        commsched.release(model)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """Every parameter of ``model`` (or of the module it wraps), in float64, once pending updates are done."""
    model.state_dict()  # waits for pending updates
    module = getattr(model, "module", model)
    return torch.cat([p.detach().double().reshape(-1) for p in module.parameters()])


def interleaved_rounds(runs: list[tuple[str, nn.Module, torch.optim.Optimizer, Iterator]], t: Task,
                       mine: slice, warmups: dict[str, int], rounds: int, iterations: int) -> dict[str, list[float]]:
    """Each system's measured iteration times, side by side: each trains its ``warmups[name]``
    iterations unmeasured, then in ``rounds`` rounds (every other one in reverse order) a lead-in
    and ``iterations`` measured ones, what is in flight finished outside the timed span (see
    [Note: steady-state rounds] in `commsched.bench.compare`). Collective: every rank runs it."""
    import torch.distributed as dist

    def step(model, optimizer, stream) -> float:
        x, y = next(stream)
        started = time.perf_counter()
        t.loss(model, x[mine], y[mine]).backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - started

    def drain(optimizer) -> None:
        if hasattr(optimizer, "synchronize"):
            optimizer.synchronize()

    for name, model, optimizer, stream in runs:
        dist.barrier()
        for _ in range(warmups[name]):
            step(model, optimizer, stream)
        drain(optimizer)
    times: dict[str, list[float]] = {name: [] for name, *_ in runs}
    for round_index in range(rounds):
        for name, model, optimizer, stream in (runs if round_index % 2 == 0 else runs[::-1]):
            dist.barrier()
            step(model, optimizer, stream)  # the lead-in
            times[name] += [step(model, optimizer, stream) for _ in range(iterations)]
            drain(optimizer)
    return times


def smoothed(losses: list[float], window: int = 10) -> list[float]:
    return [statistics.fmean(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]


def plot_losses(curves: dict[str, dict[str, list[float]]], path: Path) -> None:
    """Per model, each system's loss curve (smoothed over 10 steps; torch's systems dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4.6 * len(curves), 3.4), squeeze=False)
    for ax, (name, systems) in zip(axes[0], curves.items(), strict=True):
        for system, losses in systems.items():
            ax.plot(smoothed(losses), label=system, linewidth=1.2, linestyle="--" if "DDP" in system else "-")
        ax.set_title(name)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("training loss (smoothed over 10 steps)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


@dataclass(frozen=True)
class Host:
    """One emulated host of a side-by-side benchmark, its process group joined: the task, the same
    starting weights on every rank, and this rank's share of each batch."""

    task: Task
    base: nn.Module
    batch: int
    rank: int
    world_size: int

    @classmethod
    def join(cls, model: str, batch: int) -> Host:
        """Join the job's gloo group (one thread of computation per host) and build ``model``."""
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        t = task(model)
        torch.manual_seed(0)
        return cls(t, t.build(), batch, dist.get_rank(), dist.get_world_size())

    @property
    def mine(self) -> slice:
        return slice(self.rank * self.batch, (self.rank + 1) * self.batch)

    def stream(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The job's batches, the same on every rank (each takes `mine` of them)."""
        return self.task.batches(self.batch * self.world_size, 1)

"""Training tasks for the benchmarks that compare how systems train, not only how fast: a model,
its data, its loss and its optimizer, the same stream of batches for every system.

The bench models (`commsched.bench.models`) with SGD and momentum, and a small GPT (next-token
prediction on sequences of a fixed random Markov chain) with AdamW.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BATCH = {"resnet-like": 32, "vgg-like": 64, "transformer-like": 16, "mlp": 32, "gpt": 16}
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

    if name == "gpt":
        return Task("gpt", SmallGPT, markov_batches,
                    lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
    workload = WORKLOADS[name]
    return Task(name, workload.build, lambda batch, seed: workload.batches(batch, seed=seed),
                lambda model: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

"""Small models that exercise the awkward corners of gradient reduction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn


class ParityNet(nn.Module):
    """An MLP with the shapes that break naive data parallelism.

    - ``gain`` is a parameter registered directly on a module that has children;
    - ``offset64`` is a float64 parameter, so buckets of two dtypes coexist;
    - ``aux`` is used only when the caller asks (``use_aux``), so it can be unused
      on some ranks or on all of them in a given iteration;
    - ``never_used`` never receives a gradient.
    """

    def __init__(self, in_features: int = 8, hidden: int = 16, out_features: int = 4):
        super().__init__()
        self.embed = nn.Linear(in_features, hidden)
        self.gain = nn.Parameter(torch.ones(hidden))
        self.blocks = nn.Sequential(
            nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh()
        )
        self.aux = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, out_features)
        self.offset64 = nn.Parameter(torch.zeros(out_features, dtype=torch.float64))
        self.never_used = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor, use_aux: bool = True) -> torch.Tensor:
        h = self.blocks(self.embed(x) * self.gain)
        if use_aux:
            h = h + torch.tanh(self.aux(h))
        return (self.head(h).double() + self.offset64).float()


class BatchNormNet(nn.Module):
    """A small CNN with BatchNorm buffers, to check buffer synchronisation."""

    def __init__(self, channels: int = 4, classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class ResidualBlock(nn.Module):
    """Convolution, BatchNorm, ReLU, convolution, BatchNorm, plus the input; then ReLU.

    A block that changes the shape (``stride`` or channels) adds the input through a
    strided 1x1 convolution and BatchNorm, as ResNet's downsampling blocks do.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class TinyResNet(nn.Module):
    """A ResNet in miniature: a stem, a residual block, a downsampling one, global pooling, a head.

    What ``torch.compile`` meets in real vision models (convolutions, BatchNorm buffers,
    residual adds, several blocks), small enough to compile in seconds on a CPU.
    Inputs: ``(batch, 1, H, W)``.
    """

    def __init__(self, channels: int = 4, classes: int = 3):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.blocks = nn.Sequential(ResidualBlock(channels, channels), ResidualBlock(channels, 2 * channels, stride=2))
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


class GPTBlock(nn.Module):
    """A pre-norm Transformer block as nanoGPT writes it: causal self-attention, then an MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TinyGPT(nn.Module):
    """nanoGPT in miniature: token and position embeddings, a stack of blocks, a final norm, a head
    tied to the token embedding. What compiling a Transformer meets, small enough for a CPU.
    Inputs: ``(batch, length)`` token ids below ``vocab``."""

    def __init__(self, vocab: int = 32, width: int = 16, layers: int = 3, heads: int = 2, length: int = 8):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        for module in self.modules():  # nanoGPT's initialisation: the tied head starts near uniform
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class CheckpointedNet(nn.Module):
    """An MLP whose blocks may run under ``torch.utils.checkpoint``.

    ``checkpointed``: which blocks recompute in backward ("middle": the two
    hidden blocks; "last": the head too, so with reentrant checkpointing the
    first gradients of each iteration come from a nested backward pass).
    ``unused`` never gets a gradient, so the end of backward must be found.
    """

    def __init__(self, reentrant: bool | None = None, checkpointed: str = "middle"):
        super().__init__()
        self.reentrant, self.checkpointed = reentrant, checkpointed
        self.embed = nn.Linear(8, 16)
        self.b1 = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.b2 = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)
        self.unused = nn.Linear(4, 4)

    def _run(self, block: nn.Module, h: torch.Tensor, checkpointed: bool) -> torch.Tensor:
        if self.reentrant is None or not checkpointed:
            return block(h)
        return checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self._run(self.b1, h, True)
        h = self._run(self.b2, h, self.checkpointed == "middle")
        return self._run(self.head, h, self.checkpointed == "last")


class ReadsLateEarlyLater(nn.Module):
    """Once ``read_late_first`` is set, the root reads ``late``'s bias before ``early`` and ``late``
    run: in the first forward pass, no gate but ``late``'s own waits for it."""

    def __init__(self):
        super().__init__()
        self.early = nn.Linear(8, 8)
        self.late = nn.Linear(8, 4)
        self.read_late_first = False

    def forward(self, x):
        if self.read_late_first:
            x = x + self.late.bias.mean()
        return self.late(torch.relu(self.early(x)))

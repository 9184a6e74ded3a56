"""Small models that exercise the awkward corners of gradient reduction."""

from __future__ import annotations

import torch
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

"""Models and synthetic data for the demo and the benchmarks.

The shapes matter more than the task: the ResNet-like has many small tensors
(per-tensor overheads dominate), the VGG-like has huge late fully connected
layers (bytes dominate), the Transformer-like has uniform blocks and a large
embedding that the forward pass uses first. Data is synthetic and labelled by a fixed random
teacher, so the loss really falls and no download is needed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from commsched.bench.emulated import EMULATED_WORKLOADS, INPUT_WIDTH


class DemoNet(nn.Module):
    """A small MLP classifier for the demo."""

    def __init__(self, in_features: int = 64, hidden: int = 512, classes: int = 10):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_features, hidden), nn.LayerNorm(hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class _BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetLike(nn.Module):
    """A CIFAR-style ResNet-34 layout at reduced width: 110 parameter tensors."""

    def __init__(self, width: int = 16, blocks: tuple[int, ...] = (3, 4, 6, 3), classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages, channels = [], width
        for stage, count in enumerate(blocks):
            out_channels = width * 2**stage
            for block in range(count):
                stride = 2 if stage > 0 and block == 0 else 1
                stages.append(_BasicBlock(channels, out_channels, stride))
                channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


class VGGLike(nn.Module):
    """Three stages of two 3x3 convolutions, then large fully connected layers.

    About 13.7 MB of gradients, three quarters in the two first linear layers,
    which the forward pass needs last; at batch 64 its compute on one core is
    about as long as one all-reduce of its gradients at 250 Mbit/s.
    """

    def __init__(self, classes: int = 10, widths: tuple[int, ...] = (48, 96, 192), hidden: int = 768):
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width in widths:
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(),
                       nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            channels = width
        self.features = nn.Sequential(*layers, nn.Flatten())
        side = 32 // 2 ** len(widths)
        self.classifier = nn.Sequential(
            nn.Linear(channels * side * side, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class TransformerLike(nn.Module):
    """A Transformer encoder classifier whose large token embedding is used first.

    The embedding (8000 x 256, 8 MB) is the first layer the forward pass needs
    and the last gradient the backward pass produces: the case where sending in
    the order gradients become ready is most wrong.
    """

    def __init__(self, vocab: int = 8000, width: int = 256, layers: int = 4, heads: int = 4,
                 sequence: int = 64, classes: int = 10):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(sequence, width))
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.encoder(h).mean(dim=1))


class ViTLike(nn.Module):
    """A Vision Transformer at small size: 4x4 patches of a 32x32 image, a class token, six
    pre-norm encoder blocks of width 192, a head on the class token (ViT-B/16's layout, scaled down)."""

    def __init__(self, width: int = 192, layers: int = 6, heads: int = 3, patch: int = 4, image: int = 32,
                 classes: int = 10):
        super().__init__()
        self.patches = nn.Conv2d(3, width, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.position = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(len(x), -1, -1), tokens], dim=1) + self.position
        return self.head(self.norm(self.encoder(tokens))[:, 0])


@dataclass(frozen=True)
class Workload:
    """A model and the synthetic classification task it trains on."""

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    classes: int = 10
    vocab: int | None = None
    """Token inputs drawn from this vocabulary, instead of Gaussian inputs."""

    def teacher(self, seed: int = 7) -> Callable[[torch.Tensor], torch.Tensor]:
        """A fixed random linear map from inputs to labels: a learnable task."""
        generator = torch.Generator().manual_seed(seed)
        if self.vocab is not None:
            table = torch.randn(self.vocab, self.classes, generator=generator)
            return lambda tokens: table[tokens].sum(dim=1).argmax(dim=1)
        numel = 1
        for size in self.input_shape:
            numel *= size
        projection = torch.randn(numel, self.classes, generator=generator)
        return lambda x: (x.reshape(len(x), -1) @ projection).argmax(dim=1)

    def batches(self, batch_size: int, seed: int = 0):
        """An endless stream of (inputs, labels), identical for identical seeds."""
        generator = torch.Generator().manual_seed(seed)
        label = self.teacher()
        while True:
            if self.vocab is not None:
                x = torch.randint(self.vocab, (batch_size, *self.input_shape), generator=generator)
            else:
                x = torch.randn(batch_size, *self.input_shape, generator=generator)
            yield x, label(x)


@functools.cache
def input_layer_share(workload_name: str) -> float:
    """The share of the gradient bytes held by the first layer the forward pass runs.

    That layer's gradient is the last the backward pass produces and the first
    the next forward pass needs: its reduction can hide behind no computation
    (but the optimizer's step), whatever the schedule. A lower bound on an
    iteration is then compute plus this share of an all-reduce of every gradient.
    """
    workload = WORKLOADS[workload_name]
    model = workload.build()
    first: list[nn.Module] = []

    def note(module: nn.Module, args: object) -> None:
        if not first and module is not model and any(p.requires_grad for p in module.parameters(recurse=False)):
            first.append(module)

    handles = [module.register_forward_pre_hook(note) for module in model.modules()]
    try:
        with torch.no_grad():
            model(next(workload.batches(2))[0])
    finally:
        for handle in handles:
            handle.remove()

    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params if p.requires_grad)

    return nbytes(first[0].parameters(recurse=False)) / nbytes(model.parameters()) if first else 0.0


def wide_mlp() -> DemoNet:
    """The demo MLP widened to 2.9M parameters (768 inputs, 1024 hidden): big enough that its
    gradients (11 MB) take a few buckets, small enough that one iteration takes milliseconds."""
    return DemoNet(in_features=768, hidden=1024)


def large_mlp() -> DemoNet:
    """The demo MLP at 22M parameters (1024 inputs, 3072 hidden): at a small batch its optimizer
    step (SGD with momentum about 40 ms on one core, Adam about 150) is as long as its forward and
    backward passes, and its optimizer state (88 or 177 MB) is worth sharding
    (``benchmarks/sharded.py``)."""
    return DemoNet(in_features=1024, hidden=3072)


WORKLOADS: dict[str, Workload] = {
    "demo-mlp": Workload("demo-mlp", DemoNet, (64,)),
    "mlp": Workload("mlp", wide_mlp, (768,)),
    "mlp-22m": Workload("mlp-22m", large_mlp, (1024,)),
    "resnet-like": Workload("resnet-like", ResNetLike, (3, 32, 32)),
    "vgg-like": Workload("vgg-like", VGGLike, (3, 32, 32)),
    "transformer-like": Workload("transformer-like", TransformerLike, (64,), vocab=8000),
    "vit-like": Workload("vit-like", ViTLike, (3, 32, 32)),
    # Computation charged as sleep, sized for the emulated links (`commsched.bench.emulated`).
    **{name: Workload(name, emulated.build, (INPUT_WIDTH,)) for name, emulated in EMULATED_WORKLOADS.items()},
}

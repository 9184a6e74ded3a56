"""Benchmark models whose computation leaves the host's cores idle, as an accelerator's does.

Why: on an accelerator host the cores mostly wait while the device runs the
forward and backward passes, so the links and the host-side work of the
communication are what a schedule competes for. The bench emulates 8-16 such
hosts on one small machine (a process each, on 2 cores, linked by shaped veth
links). Had each process computed for real, the hosts would share the 2 cores:
the cores, not the links, would set the pace, and every schedule would look
alike.

So an `EmulatedNet` charges each layer's computation as `time.sleep` (which
gives up the GIL and the core) of the time a real profile gives it, around a
small *real* operation on real parameters: the gradients are real, depend on
the data and are deterministic, so training stays checkable against one
process, while their sizes, their order and the times they become ready follow
the profile's (scaled, see `EMULATED_WORKLOADS`).

[Note: the emulated clock] A layer does not sleep for its time after the host's
own work (the real operation, Python, the hooks of the system under test):
that would add the host's overhead to every layer, 10-15% of an iteration for
a hundred layers and more on a loaded machine. It sleeps until the time the
device would finish it, ``deadline + time``, the way an accelerator runs the
queue of work the host launched ahead. Where the host comes later than
`HOST_SLACK_S` past the deadline (it waited for a parameter, or was not
scheduled), the layer starts when the host comes, as a device waiting for
its input would. Sleeps shorter than `MIN_SLEEP_S` are put off to the next
layer's, as each wake costs the host.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from commsched.profiling.model import scaled_compute
from commsched.profiling.profile import ModuleProfile, ParameterProfile, Profile

INPUT_WIDTH = 32
"""Features of the real input each layer transforms (per example)."""

HOST_SLACK_S = 0.002
"""How late past the emulated device's deadline the host may reach a layer and still have
that lateness hidden; see [Note: the emulated clock]."""

MIN_SLEEP_S = 0.001
"""The shortest sleep: a layer whose time is shorter lets it add up to the next one's, so a
gradient may become ready up to this much early."""

INIT_STD = 1.0
"""Standard deviation of the parameters at initialisation."""

GPT2_SMALL_TFLOPS = 40.0
"""Default sustained throughput of `gpt2_small_profile`: an accelerator of about 100 TFLOP/s
(dense, half precision) at about 40% model FLOPs utilisation."""

GPT2_UPDATE_BYTES_PER_S = 1.5e12
"""Memory bandwidth `gpt2_small_profile` charges the optimizer step at (it is memory-bound:
an Adam step reads and writes 28 bytes per parameter)."""


@dataclass(frozen=True)
class EmulatedWorkload:
    """A profile and the factors that size it for the emulated links.

    ``size_scale`` multiplies every gradient's bytes (each keeps at least one
    element), ``time_scale`` every time of the profile.
    """

    name: str
    profile_name: str
    """``"vgg16"`` or ``"resnet50"`` (committed profiles, measured) or ``"gpt2-small"`` (derived)."""
    size_scale: float
    time_scale: float

    def profile(self) -> Profile:
        return load_profile(self.profile_name)

    def as_emulated(self) -> Profile:
        """The profile as the emulated net runs it (its gradients' sizes and every time scaled, each
        parameter float32): what the simulator is given to time the bench's cells."""
        profile = self.profile()
        parameters = tuple(
            dataclasses.replace(p, numel=numel, element_size=4)
            for p, numel in zip(profile.parameters, _scaled_numels(profile, self.size_scale), strict=True)
        )
        return scaled_compute(dataclasses.replace(profile, parameters=parameters), self.time_scale)

    def build(self) -> EmulatedNet:
        """A fresh net (the global generator draws its parameters, as ``nn.Linear``'s do)."""
        return EmulatedNet(self.profile(), self.size_scale, self.time_scale)

    @property
    def gradient_bytes(self) -> int:
        """Bytes of gradients per iteration, as built (rounding each parameter included)."""
        return sum(numel * 4 for numel in _scaled_numels(self.profile(), self.size_scale))

    @property
    def compute_s(self) -> float:
        """Forward and backward time of one iteration, as emulated."""
        profile = self.profile()
        return (profile.forward_s + profile.backward_s) * self.time_scale


EMULATED_WORKLOADS: dict[str, EmulatedWorkload] = {
    workload.name: workload for workload in (
        EmulatedWorkload("vgg16-emulated", "vgg16", size_scale=0.014, time_scale=0.15),
        EmulatedWorkload("resnet50-emulated", "resnet50", size_scale=0.075, time_scale=0.4),
        EmulatedWorkload("gpt2-emulated", "gpt2-small", size_scale=0.0125, time_scale=1.0),
    )
}
"""The registered emulated workloads and their factors.

Each is sized so that its computation takes about 200 ms per iteration and a
ring all-reduce of its gradients among 8 hosts (each sends ``2(N-1)/N = 1.75``
times the bytes) takes as long at 0.5 Gbit/s: computation and communication
are then within 2x of each other from 0.25 to 1 Gbit/s, where a schedule's
overlap matters most.

- ``vgg16-emulated``: torchvision VGG16 measured on CPU at batch 4 (553 MB of
  gradients, 1.42 s of computation); x0.014 bytes, x0.15 time: 7.7 MB,
  214 ms. Three quarters of the bytes sit in the first fully connected layer,
  which the forward pass needs late.
- ``resnet50-emulated``: torchvision ResNet-50 measured on CPU at batch 4
  (102 MB, 0.52 s, 161 tensors, many tiny); x0.075 bytes, x0.4 time: 7.7 MB,
  209 ms.
- ``gpt2-emulated``: `gpt2_small_profile` at its defaults (498 MB, 176 ms:
  batch 8 of 1024 tokens at 40 TFLOP/s); x0.0125 bytes, time as derived:
  6.2 MB, 176 ms. The tied token embedding, a third of the bytes, is the first
  layer the forward pass needs and the last gradient the backward pass
  produces.
"""


@functools.cache
def load_profile(name: str) -> Profile:
    """A committed profile shipped with the package (``"vgg16"``, ``"resnet50"``) or ``"gpt2-small"``."""
    if name == "gpt2-small":
        return gpt2_small_profile()
    source = resources.files("commsched.bench").joinpath("profiles", f"{name}.json")
    if not source.is_file():
        raise ValueError(f"no committed profile {name!r}; there are vgg16, resnet50 and gpt2-small")
    return Profile.from_dict(json.loads(source.read_text()))


def gpt2_small_profile(batch_size: int = 8, sequence: int = 1024, tflops: float = GPT2_SMALL_TFLOPS) -> Profile:
    """GPT-2 small (124M parameters, head tied to the token embedding) on an accelerator, from its FLOPs.

    Nothing to download or measure: each layer's forward pass costs
    ``2 * parameters * tokens`` FLOPs (attention adds ``4 * sequence * 768 *
    tokens`` per block, counted in ``attn.c_attn``'s time, which runs until
    ``attn.c_proj`` starts), at ``tflops`` TFLOP/s sustained (see
    `GPT2_SMALL_TFLOPS`); its backward pass twice that. Layer norms and
    embedding lookups are memory-bound and a few percent of the time: they
    count none. The tied head's product (``2 * 50257 * 768 * tokens``) ends
    the forward pass and starts the backward pass.
    """
    if not (batch_size >= 1 and 1 <= sequence <= 1024 and tflops > 0):
        raise ValueError(f"gpt2_small_profile needs batch_size >= 1, 1 <= sequence <= 1024 and tflops > 0, got "
                         f"{batch_size}, {sequence}, {tflops}")
    width, vocab, tokens, rate = 768, 50257, batch_size * sequence, tflops * 1e12

    def linear(name: str, inputs: int, outputs: int, extra_flops: float = 0.0) -> tuple:
        params = inputs * outputs + outputs
        return name, (("weight", inputs * outputs), ("bias", outputs)), (2 * params * tokens + extra_flops) / rate

    def norm(name: str) -> tuple:
        return name, (("weight", width), ("bias", width)), 0.0

    stages: list[tuple[str, tuple[tuple[str, int], ...], float]] = [
        ("transformer.wte", (("weight", vocab * width),), 0.0),
        ("transformer.wpe", (("weight", 1024 * width),), 0.0),
    ]
    for block in range(12):
        prefix = f"transformer.h.{block}"
        stages += [
            norm(f"{prefix}.ln_1"),
            linear(f"{prefix}.attn.c_attn", width, 3 * width, 4 * sequence * width * tokens),
            linear(f"{prefix}.attn.c_proj", width, width),
            norm(f"{prefix}.ln_2"),
            linear(f"{prefix}.mlp.c_fc", width, 4 * width),
            linear(f"{prefix}.mlp.c_proj", 4 * width, width),
        ]
    stages += [norm("transformer.ln_f"), ("lm_head", (), 2 * vocab * width * tokens / rate)]

    starts, clock = [], 0.0
    for _, _, forward_s in stages:
        starts.append(clock)
        clock += forward_s
    forward_total = clock
    readies, clock = [0.0] * len(stages), 0.0
    for index in reversed(range(len(stages))):
        clock += 2 * stages[index][2]
        readies[index] = clock
    parameters = tuple(ParameterProfile(f"{module}.{name}", numel, 4, starts[index], readies[index])
                       for index, (module, params, _) in enumerate(stages) for name, numel in params)
    numel = sum(p.numel for p in parameters)
    return Profile(
        model=f"gpt2-small (tied head, batch {batch_size} x {sequence} tokens)",
        device=f"derived from FLOPs at {tflops:g} TFLOP/s sustained, not measured",
        batch_size=batch_size, forward_s=forward_total, backward_s=clock,
        update_s=28 * numel / GPT2_UPDATE_BYTES_PER_S, parameters=parameters,
        modules=tuple(ModuleProfile(module, forward_s, 2 * forward_s) for module, _, forward_s in stages),
    )


class _Clock:
    """The emulated device's timeline, shared by a net's layers; see [Note: the emulated clock]."""

    def __init__(self) -> None:
        self.deadline = 0.0

    def start(self) -> None:
        self.deadline = time.perf_counter()

    def run(self, seconds: float) -> None:
        """Let ``seconds`` of device time pass, from the deadline if the host is not too late.

        Sleeps only once the deadline is `MIN_SLEEP_S` ahead: a process that wakes
        pays for it (tens of microseconds of cold caches on a shared machine), and
        ResNet-50's hundred layers would wake it 200 times an iteration.
        """
        now = time.perf_counter()
        begin = self.deadline if now - self.deadline <= HOST_SLACK_S else now
        self.deadline = begin + seconds
        if self.deadline - now >= MIN_SLEEP_S:
            time.sleep(self.deadline - now)


class _Layer(torch.autograd.Function):
    """A layer's real operation and its emulated time, in one node of the autograd graph.

    ``out = h + gain * sin(v) * tanh(h)``, ``v`` the sum over the layer's
    parameters of ``|p|^2 / (2 sqrt(numel))``. The gradient of element ``i`` of
    ``p`` is ``dL/dv * p[i] / sqrt(numel)``: every element gets its own,
    data-dependent value (a reduction that misplaces elements shows), at one
    pass over ``p`` each way. Everything else is bounded, so no optimizer drives
    the net to infinities, and ``sin`` never saturates to zero gradients as
    ``tanh`` would. Written out by hand rather than composed of torch's
    operations: one node instead of eight keeps the host's work per layer small.

    The backward pass sleeps the layer's backward time before it returns the
    gradients, so they become ready once that time has passed.
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, layer: EmulatedLayer, *params: torch.Tensor) -> torch.Tensor:
        v = 0.0
        for p in params:
            v += float(torch.dot(p, p)) / (2 * math.sqrt(p.numel()))
        sin_v, cos_v = math.sin(v), math.cos(v)
        mixed = torch.tanh(h)
        out = torch.add(h, mixed, alpha=layer._gain * sin_v)
        layer._clock.run(layer._forward_s)
        ctx.save_for_backward(mixed, *params)
        ctx.layer, ctx.sin_v, ctx.cos_v = layer, sin_v, cos_v
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        layer: EmulatedLayer = ctx.layer
        if layer._starts_backward:
            layer._clock.start()
        layer._clock.run(layer._backward_s)
        mixed, *params = ctx.saved_tensors
        grad_v = layer._gain * ctx.cos_v * float(torch.dot(grad.reshape(-1), mixed.reshape(-1)))
        grad_h = torch.addcmul(grad, grad, 1 - mixed * mixed, value=layer._gain * ctx.sin_v)
        return (grad_h, None, *(p * (grad_v / math.sqrt(p.numel())) for p in params))


def _calls(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    for path in module._call_order:
        h = module.get_submodule(path)(h)
    return h


class EmulatedLayer(nn.Module):
    """One profiled module: its parameters (1-D, scaled), a cheap real operation on them (`_Layer`)
    and its times."""

    def __init__(self, numels: Sequence[tuple[str, int]], clock: _Clock, forward_s: float, backward_s: float,
                 gain: float):
        super().__init__()
        for name, numel in numels:
            self.register_parameter(name, nn.Parameter(torch.randn(numel) * INIT_STD))
        self._clock = clock
        self._forward_s = float(forward_s)
        self._backward_s = float(backward_s)
        self._gain = float(gain)
        self._starts_backward = False
        """The forward pass's last layer: its backward starts the backward pass's clock."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _Layer.apply(h, self, *self._parameters.values())

    def extra_repr(self) -> str:
        return f"forward_s={self._forward_s:.6f}, backward_s={self._backward_s:.6f}"


class _Block(nn.Module):
    """A profiled module that holds others: calls them in forward order, as the real one did."""

    def __init__(self) -> None:
        super().__init__()
        self._call_order: list[str] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _calls(self, h)


class _Stage(nn.ModuleList):
    """A block whose children are numbered (an ``nn.Sequential`` or ``nn.ModuleList`` in the real
    model): kept a ``ModuleList`` so that whoever shards per element (FSDP2) finds the same blocks."""

    def __init__(self) -> None:
        super().__init__()
        self._call_order: list[str] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _calls(self, h)


class EmulatedNet(nn.Module):
    """A classifier that stands for ``profile``'s model: real parameters and gradients, emulated time.

    One `EmulatedLayer` per profiled module that holds parameters (its
    parameters' names less the last part), under the profile's names. The
    forward pass runs them in the order it first used them; each sleeps the
    time from its first use to the next layer's (the last: to the end of the
    forward pass), and in the backward pass the time from the previous
    gradient's readiness to its own, so its gradients become ready at
    ``ready_s`` (times ``time_scale``). The parameter timeline is what places
    them: a module's own time (``profile.modules``) leaves out the modules
    without parameters between (activations, pooling), so it is used only
    where every parameter has the same time (a profile without a timeline).

    Input ``(batch, INPUT_WIDTH)`` features; output ``classes`` logits, the
    features pooled into ``classes`` bins (no parameters: every gradient byte
    is the profile's). The times stand for the profile's batch whatever the
    real input's: its batch only sizes the real operations, a few microseconds.
    """

    def __init__(self, profile: Profile, size_scale: float = 1.0, time_scale: float = 1.0, classes: int = 10,
                 width: int = INPUT_WIDTH):
        super().__init__()
        if not (size_scale > 0 and time_scale >= 0 and math.isfinite(size_scale) and math.isfinite(time_scale)):
            raise ValueError(f"EmulatedNet needs size_scale > 0 and time_scale >= 0, got {size_scale}, {time_scale}")
        if not 1 <= classes <= width:
            raise ValueError(f"EmulatedNet pools {width} features into its logits: classes must be 1..{width}")
        self._classes = classes
        self._clock = _Clock()
        groups = _groups(profile)
        forward_times, backward_times, lead_s = _timeline(profile, groups)
        self._lead_s = lead_s * time_scale
        numels = _scaled_numels(profile, size_scale)
        gain = 1.0 / math.sqrt(len(groups))

        layers: dict[str, EmulatedLayer] = {}
        for group, forward_s, backward_s in zip(groups, forward_times, backward_times):
            layers[group.path] = EmulatedLayer(
                [(profile.parameters[i].name.rsplit(".", 1)[-1], numels[i]) for i in group.indices],
                self._clock, forward_s * time_scale, backward_s * time_scale, gain)
        layers[groups[-1].path]._starts_backward = True
        self._call_order = _build_tree(self, profile, groups, layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._clock.start()
        self._clock.run(self._lead_s)
        h = _calls(self, x)
        # Pooled as (channels, length); cloned, as pooling returns a view (FSDP2 warns of one).
        return F.adaptive_avg_pool1d(h, self._classes).clone()


@dataclass(frozen=True)
class _Group:
    path: str
    """The module's name; ``_ROOT`` for parameters of the model itself."""
    indices: tuple[int, ...]
    first_use_s: float
    ready_s: float


_ROOT = "params"
"""Where a layer for the model's own parameters (names without a module) goes."""


def _groups(profile: Profile) -> list[_Group]:
    """The profile's parameters by module, in forward order."""
    members: dict[str, list[int]] = {}
    for index, parameter in enumerate(profile.parameters):
        path = parameter.name.rsplit(".", 1)[0] if "." in parameter.name else _ROOT
        members.setdefault(path, []).append(index)
    groups = [_Group(path, tuple(indices), min(profile.parameters[i].first_use_s for i in indices),
                     max(profile.parameters[i].ready_s for i in indices)) for path, indices in members.items()]
    return sorted(groups, key=lambda g: (g.first_use_s, g.indices[0]))


def _timeline(profile: Profile, groups: Sequence[_Group]) -> tuple[list[float], list[float], float]:
    """Per layer, in forward order: its forward time, its backward time; and the time before the first."""
    own = {m.name: m for m in profile.modules}
    first = [g.first_use_s for g in groups]
    if len(groups) == 1 or max(first) > min(first):
        lead_s = first[0]
        forward = [b - a for a, b in zip(first, first[1:])] + [max(profile.forward_s - first[-1], 0.0)]
    else:
        lead_s = 0.0
        forward = _spread(profile.forward_s, [own[g.path].forward_s if g.path in own else 0.0 for g in groups])
    ready = [g.ready_s for g in groups]
    if len(groups) == 1 or max(ready) > min(ready):
        backward, done = [0.0] * len(groups), 0.0
        for index in reversed(range(len(groups))):
            later = max(done, ready[index])
            backward[index], done = later - done, later
    else:
        backward = _spread(profile.backward_s, [own[g.path].backward_s if g.path in own else 0.0 for g in groups])
    return forward, backward, lead_s


def _spread(total: float, own: Sequence[float]) -> list[float]:
    """``total`` shared in proportion to the modules' own times (evenly where none has one)."""
    known = sum(own)
    return [total * t / known for t in own] if known > 0 else [total / len(own)] * len(own)


def _scaled_numels(profile: Profile, size_scale: float) -> list[int]:
    """Per parameter: float32 elements for its bytes times ``size_scale``, at least one."""
    return [max(1, round(p.nbytes * size_scale / 4)) for p in profile.parameters]


def _build_tree(net: EmulatedNet, profile: Profile, groups: Sequence[_Group],
                layers: dict[str, EmulatedLayer]) -> list[str]:
    """Register ``layers`` under their names, with blocks between, in the profile's order; each
    block calls its children in forward order. Returns what the net itself calls.

    A block runs its children together, so it must hold a contiguous run of
    the forward order and no layer may hold others; otherwise the net calls
    every layer itself (and the blocks are plain, never called).
    """
    position = {group.path: index for index, group in enumerate(groups)}
    children: dict[str, list[str]] = {"": []}
    for parameter in profile.parameters:
        path = parameter.name.rsplit(".", 1)[0] if "." in parameter.name else _ROOT
        parts = path.split(".")
        for depth in range(len(parts)):
            parent, node = ".".join(parts[:depth]), ".".join(parts[: depth + 1])
            if node not in children:
                children[node] = []
                children[parent].append(node)
    spans: dict[str, list[int]] = {}
    for path in layers:
        parts = path.split(".")
        for depth in range(len(parts) + 1):
            spans.setdefault(".".join(parts[:depth]), []).append(position[path])
    nested = any(children[path] for path in layers)
    contiguous = all(max(s) - min(s) + 1 == len(s) for s in spans.values())
    tree = contiguous and not nested

    modules: dict[str, nn.Module] = {"": net}
    for node in children:
        if not node:
            continue
        parent, _, name = node.rpartition(".")
        if node in layers:
            module: nn.Module = layers[node]
        elif tree:
            module = _Stage() if all(c.rpartition(".")[2].isdigit() for c in children[node]) else _Block()
        else:
            module = nn.Module()
        modules[parent].add_module(name, module)
        modules[node] = module
    if not tree:
        return sorted(layers, key=position.__getitem__)
    for node, kids in children.items():
        if node and node not in layers:
            ordered = sorted(kids, key=lambda kid: min(spans[kid]))
            modules[node]._call_order = [kid.rpartition(".")[2] for kid in ordered]
    return [kid for kid in sorted(children[""], key=lambda kid: min(spans[kid]))]

"""A model's and a link's measured costs: what the simulator and the auto-tuner start from.

Pure data, no torch: a `Profile` is measured once (`commsched.profiling.model`, or
from a prepared model's warm-up) and saved as JSON, so a profile taken on one
machine (a GPU host) can be replayed on another (a laptop) by `commsched plan`.

[Note: the profile] Per parameter, in registration order, it holds what a
schedule depends on: its size, when the forward pass first reads it (from the
start of the forward pass), and when its gradient is ready (from the start of
the backward pass). Per module, its forward and backward times, for people
reading it. Per link (optional: a profile taken in one process has none), the
all-reduce times measured at a few sizes among ``world_size`` replicas, a fit
``latency_s + n / bytes_per_s``, and how much an all-reduce running beside
computation slows that computation down on this host (``compute_slowdown``: 0.1
means 10% longer), and the computation the all-reduce (``collective_slowdown``). The format is versioned; a file of another version is
refused with the fix rather than misread.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1
"""Bump on any change of meaning or shape; `Profile.from_dict` refuses other versions."""


@dataclass(frozen=True)
class ParameterProfile:
    """One trainable parameter, in the order ``model.named_parameters()`` gives them."""

    name: str
    numel: int
    element_size: int
    """Bytes per element of its gradient (4 for float32)."""
    first_use_s: float
    """When the forward pass first reads it, from the start of the forward pass."""
    ready_s: float
    """When its gradient is ready, from the start of the backward pass."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class ModuleProfile:
    """One leaf module's own time per iteration (for reading; the schedule uses the parameters')."""

    name: str
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class LinkSample:
    nbytes: int
    seconds: float
    """Median time of one all-reduce of ``nbytes`` among the replicas."""


@dataclass(frozen=True)
class LinkProfile:
    """The all-reduce among ``world_size`` replicas of the run that measured it."""

    world_size: int
    samples: tuple[LinkSample, ...]
    latency_s: float
    """Fitted fixed cost of one all-reduce (the link's latency and the host's work)."""
    bytes_per_s: float
    """Fitted all-reduce throughput: bytes reduced per second beyond the fixed cost."""
    compute_slowdown: float = 0.0
    """Computation with an all-reduce beside it takes ``1 + compute_slowdown`` times as long."""
    collective_slowdown: float = 0.0
    """An all-reduce with computation beside it takes ``1 + collective_slowdown`` times as long
    (where the transport needs the host's cores, as gloo over TCP does, computation slows it)."""
    in_flight: int = 1
    """Collectives the transport runs at once: gloo 2 (one per worker thread of its process group),
    NCCL 1 (one stream); see [Note: two collectives at once] in `commsched.planning.wire`."""

    def duration_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Profile:
    """One iteration of one model on one device, at one batch size per replica; see [Note: the profile]."""

    model: str
    device: str
    batch_size: int
    forward_s: float
    """Median forward pass, from its start to the start of the backward pass."""
    backward_s: float
    """Median backward pass, to its last gradient."""
    update_s: float
    """Median optimizer step over every parameter."""
    parameters: tuple[ParameterProfile, ...]
    modules: tuple[ModuleProfile, ...] = ()
    link: LinkProfile | None = None
    version: int = field(default=PROFILE_VERSION)

    def __post_init__(self) -> None:
        if not self.parameters:
            raise ValueError("a profile needs at least one trainable parameter")
        for name in ("forward_s", "backward_s", "update_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Profile.{name} must be a finite number of seconds >= 0, got {value!r}")

    @property
    def gradient_bytes(self) -> int:
        return sum(p.nbytes for p in self.parameters)

    @property
    def forward_order(self) -> list[int]:
        """Parameter indices in the order the forward pass first reads them."""
        return sorted(range(len(self.parameters)), key=lambda i: (self.parameters[i].first_use_s, i))

    def with_link(self, link: LinkProfile | None) -> Profile:
        return Profile(self.model, self.device, self.batch_size, self.forward_s, self.backward_s, self.update_s,
                       self.parameters, self.modules, link, self.version)

    # ------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(
                f"this profile has format version {version!r}, but commsched {_package_version()} reads "
                f"version {PROFILE_VERSION}; profile the model again with this version (`commsched plan MODEL "
                "--save-profile FILE`)"
            )
        try:
            link = data.get("link")
            return cls(
                model=data["model"], device=data["device"], batch_size=int(data["batch_size"]),
                forward_s=float(data["forward_s"]), backward_s=float(data["backward_s"]),
                update_s=float(data["update_s"]),
                parameters=tuple(ParameterProfile(**p) for p in data["parameters"]),
                modules=tuple(ModuleProfile(**m) for m in data.get("modules", ())),
                link=None if link is None else LinkProfile(
                    world_size=int(link["world_size"]),
                    samples=tuple(LinkSample(**s) for s in link["samples"]),
                    latency_s=float(link["latency_s"]), bytes_per_s=float(link["bytes_per_s"]),
                    compute_slowdown=float(link.get("compute_slowdown", 0.0)),
                    collective_slowdown=float(link.get("collective_slowdown", 0.0)),
                    in_flight=int(link.get("in_flight", 1)),
                ),
                version=version,
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a commsched profile: {error!r} is missing or malformed") from error

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not a commsched profile (not JSON: {error})") from error
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a commsched profile (not a JSON object)")
        return cls.from_dict(data)


def fit_link(sizes: Sequence[int], seconds: Sequence[float], floor_s: float = 0.0) -> tuple[float, float]:
    """``(latency_s, bytes_per_s)`` of the least-squares line ``seconds = latency_s + size / bytes_per_s``.

    The latency is at least ``floor_s`` (a one-element all-reduce's time,
    taken no longer than the quickest sample: it is noisy too) and positive.
    A line that does not rise (noise, at sizes too close together) says
    nothing about either: then the latency is that floor and the bandwidth
    that of the largest size beyond it.
    """
    floor_s = min(floor_s, *seconds)
    mean_n, mean_s = statistics.fmean(sizes), statistics.fmean(seconds)
    spread = sum((n - mean_n) ** 2 for n in sizes)
    slope = sum((n - mean_n) * (s - mean_s) for n, s in zip(sizes, seconds)) / spread if spread else 0.0
    if slope > 0 and math.isfinite(slope):
        return max(mean_s - slope * mean_n, floor_s, 1e-9), 1.0 / slope
    latency_s = max(floor_s, 1e-9)
    largest = max(range(len(sizes)), key=lambda i: sizes[i])
    beyond = seconds[largest] - latency_s
    return latency_s, sizes[largest] / (beyond if beyond > 0 else seconds[largest])


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("commsched")
    except Exception:  # noqa: BLE001 - only for the message
        return "(this version)"

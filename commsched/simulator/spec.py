"""What the simulator is asked and what it answers: a profile as its model (`model_of`), `DDPConfig`
(torch DDP as simulated; a `Strategy` is the other kind of system it takes) and `SimResult`."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from commsched.profiling.profile import Profile
from commsched.strategy import MIB


@dataclass(frozen=True)
class DDPConfig:
    """torch DDP: buckets of at most ``bucket_cap_mb`` (the first one ``first_bucket_mb``), all-reduced
    first in, first out as they fill; the optimizer steps once every reduction is done.

    torch DDP given an explicit ``bucket_cap_mb`` uses it for the first bucket too: see `like_torch`.
    """

    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0

    def __post_init__(self) -> None:
        for name in ("bucket_cap_mb", "first_bucket_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value * MIB >= 1
            ):
                raise ValueError(f"DDPConfig.{name} must be a finite size of at least one byte, in MiB, "
                                 f"got {value!r}")

    @classmethod
    def like_torch(cls, bucket_cap_mb: float | None = None) -> DDPConfig:
        """What ``DistributedDataParallel(bucket_cap_mb=...)`` does: a 1 MiB first bucket only at the default."""
        return cls() if bucket_cap_mb is None else cls(bucket_cap_mb, bucket_cap_mb)

    @property
    def bucket_size_limits_bytes(self) -> list[int]:
        return [int(self.first_bucket_mb * MIB), int(self.bucket_cap_mb * MIB)]

    def describe(self) -> str:
        return f"torch DDP (buckets of {self.bucket_cap_mb:g} MiB, the first {self.first_bucket_mb:g} MiB)"


@dataclass(frozen=True)
class SimResult:
    """One steady-state iteration of one system: where its time goes."""

    iteration_s: float
    """From one forward pass's start to the next one's."""
    compute_s: float
    """Forward, backward and update on the worker, stretched where communication ran beside them."""
    link_busy_s: float
    """Wire time of this iteration's collectives on the busiest link (with servers: the busiest server's)."""
    exposed_s: float
    """``iteration_s - compute_s``: the worker waiting for communication."""
    collectives: int
    """All-reduces (or parameter-server push/pulls) per iteration."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    update_s: float = 0.0
    """The worker's share of ``compute_s`` in each phase (the update is on the servers with them)."""
    contention_s: float = 0.0
    """How much of ``compute_s`` is the stretch by communication running beside it."""
    system: str = ""

    def describe(self) -> str:
        ms = 1e3
        return (
            f"{self.system}: {self.iteration_s * ms:.2f} ms per iteration = compute {self.compute_s * ms:.2f} ms "
            f"(forward {self.forward_s * ms:.2f}, backward {self.backward_s * ms:.2f}, update "
            f"{self.update_s * ms:.2f}; {self.contention_s * ms:.2f} of it slowed by communication) + "
            f"{self.exposed_s * ms:.2f} ms waiting for communication; link busy {self.link_busy_s * ms:.2f} ms "
            f"in {self.collectives} collectives"
        )


_DTYPES = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64, 16: torch.complex128}


@dataclass(frozen=True, eq=False)
class SimModel:
    """A profile in the form the layout functions take (meta tensors: sizes without memory)."""

    tensors: tuple[torch.Tensor, ...]
    forward_order: tuple[int, ...]
    nbytes: tuple[int, ...]
    ready_s: tuple[float, ...]
    first_use_s: tuple[float, ...]
    forward_s: float
    backward_end_s: float
    update_s: float
    total_bytes: int


def meta_parameters(profile: Profile) -> tuple[torch.Tensor, ...]:
    """The profile's parameters as meta tensors (sizes and dtypes, no memory), for the layout
    functions and the cost model."""
    return model_of(profile).tensors


@functools.lru_cache(maxsize=8)
def model_of(profile: Profile) -> SimModel:
    """The profile as the simulator's model (cached: a search simulates one profile many times)."""
    tensors = []
    for p in profile.parameters:
        dtype = _DTYPES.get(p.element_size)
        if dtype is None:
            raise ValueError(f"parameter {p.name!r} has element_size {p.element_size}; the simulator knows "
                             f"{sorted(_DTYPES)} bytes per element")
        tensors.append(torch.empty((p.numel,), dtype=dtype, device="meta"))
    ready = tuple(max(0.0, p.ready_s) for p in profile.parameters)
    forward_s = profile.forward_s
    return SimModel(
        tensors=tuple(tensors), forward_order=tuple(profile.forward_order),
        nbytes=tuple(p.nbytes for p in profile.parameters), ready_s=ready,
        first_use_s=tuple(min(forward_s, max(0.0, p.first_use_s)) for p in profile.parameters),
        forward_s=forward_s, backward_end_s=max(profile.backward_s, max(ready)), update_s=profile.update_s,
        total_bytes=profile.gradient_bytes,
    )

"""The systems a comparison trains side by side, as typed values.

A system's ``name`` is how results, JSON and tables show it; code that needs
to know what a system is looks at its type and fields, never at its name.
`encode` and `decode` carry systems as JSON to the processes of a run.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

from commsched.strategy import AllReduce, ParameterServer, Strategy


@dataclass(frozen=True)
class ComputeOnly:
    """Every rank trains on its own, no communication: the compute part of the bound."""

    @property
    def name(self) -> str:
        return "compute only"


@dataclass(frozen=True)
class TorchDDP:
    """torch's ``DistributedDataParallel``."""

    bucket_cap_mb: float | None = None
    """None: DDP's own default."""
    static_graph: bool = False
    """DDP's ``static_graph``: the graph is recorded once, so later iterations skip the
    search for unused parameters and may reorder buckets."""
    gradient_as_bucket_view: bool = False
    """DDP's ``gradient_as_bucket_view``: gradients are views into the buckets, saving
    one copy (and its memory) per iteration."""

    @property
    def name(self) -> str:
        parts = ["torch DDP"]
        if self.bucket_cap_mb is not None:
            parts.append(f"bucket_cap_mb={self.bucket_cap_mb:g}")
        if self.static_graph:
            parts.append("static graph")
        if self.gradient_as_bucket_view:
            parts.append("grad views")
        return ", ".join(parts)


@dataclass(frozen=True)
class TorchFSDP2:
    """torch's FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters sharded across ranks.

    `commsched.bench.compare` shards each block (`fsdp2_units`) and then the
    root. With ``reshard_after_forward=False`` the gathered parameters stay
    between the forward and the backward pass (ZeRO-2-like: gradients and
    optimizer state sharded, one all-gather per block per iteration); the
    closest FSDP2 comes to data parallelism.
    """

    reshard_after_forward: bool = False

    @property
    def name(self) -> str:
        return "torch FSDP2, reshard after forward" if self.reshard_after_forward else "torch FSDP2"


@dataclass(frozen=True)
class Commsched:
    """commsched with ``strategy``; ``label`` tells apart systems that share a backend."""

    strategy: Strategy
    label: str = ""

    @property
    def num_servers(self) -> int:
        """Ranks this system needs as parameter servers (0 with all-reduce)."""
        backend = self.strategy.backend
        return backend.num_servers if isinstance(backend, ParameterServer) else 0

    @property
    def name(self) -> str:
        name = "commsched"
        if self.num_servers:
            name += f" PS, {self.num_servers} server{'s' if self.num_servers > 1 else ''}"
        return f"{name}, {self.label}" if self.label else name


System = ComputeOnly | TorchDDP | TorchFSDP2 | Commsched

UNSCHEDULED = Strategy(
    priority=False, partition_mb=None, credit_mb=None, overlap_forward=False, fuse_optimizer=False
)
"""commsched with every scheduling feature off: the DDP-like core."""


def scheduling_off(strategy: Strategy) -> bool:
    """Whether every scheduling feature of ``strategy`` is off, as in `UNSCHEDULED`.

    The other fields (bucket sizes, trace directory, backend) may differ.
    """
    return all(getattr(strategy, name) == getattr(UNSCHEDULED, name)
               for name in ("priority", "partition_mb", "credit_mb", "overlap_forward", "fuse_optimizer"))


_TYPES = {cls.__name__: cls
          for cls in (ComputeOnly, TorchDDP, TorchFSDP2, Commsched, Strategy, AllReduce, ParameterServer)}


def encode(value: object) -> object:
    """``value`` as JSON-ready data, dataclasses (nested ones too) tagged with their type."""
    if is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__,
                **{f.name: encode(getattr(value, f.name)) for f in fields(value) if f.init}}
    return value


def decode(data: object) -> object:
    """The inverse of `encode`."""
    if isinstance(data, dict) and "type" in data:
        cls = _TYPES[data["type"]]
        return cls(**{key: decode(value) for key, value in data.items() if key != "type"})
    return data

"""`Cluster`: how long one collective takes among N workers, from a few numbers per link.

See [Note: the simulator] in `commsched.simulator` for the formulas and why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from commsched.profiling.profile import LinkProfile, LinkSample

ALGORITHMS = ("ring", "tree")

DEFAULT_LATENCY_S = 25e-6
"""Per-hop latency where none is given: a switched data-centre network, one hop."""

LINK_SAMPLE_BYTES = (2**16, 2**20, 2**22, 2**24)
"""Sizes `Cluster.link_profile` reports a time for, as a link measurement would."""


@dataclass(frozen=True)
class Cluster:
    """N symmetric workers on a network; with ``servers``, that many parameter-server links besides.

    Validated at construction: a bad value raises ``ValueError`` naming the field and the allowed range.
    """

    workers: int
    gbit_s: float
    """Each host's link rate, in Gbit/s (``math.inf``: communication costs only its latencies)."""
    latency_s: float = DEFAULT_LATENCY_S
    """One hop's latency (alpha): a ring all-reduce pays it 2 (N - 1) times."""
    algorithm: str = "ring"
    """``"ring"`` or ``"tree"`` (NCCL's double binary tree) for an all-reduce."""
    servers: int = 0
    """With > 0, parameter-server collectives go through this many server links."""
    host_overhead_s: float = 0.0
    """Fixed host cost of each collective (Python, the gloo/NCCL launch), added to its time."""
    compute_slowdown: float = 0.0
    """Computation beside a running collective takes ``1 + compute_slowdown`` times as long."""
    collective_slowdown: float = 0.0
    """A collective issued while the worker computes takes ``1 + collective_slowdown`` times as
    long on the wire (a transport that needs the host's cores, as gloo over TCP does)."""
    in_flight: int = 1
    """All-reduces the transport runs at once, taking turns step by step (gloo 2, NCCL 1);
    see [Note: two collectives at once] in `commsched.planning.wire`."""
    all_to_all: bool = False
    """The transport can all-reduce in two all-to-alls (gloo, on host memory, among 3 or more workers):
    a `Strategy` whose ``AllReduce.all_to_all_mb`` asks for it sends those partitions so (`two_step_s`;
    [Note: an all-reduce in two steps] in `commsched.comm.two_step`)."""

    def __post_init__(self) -> None:
        _check_count("workers", self.workers, 1)
        _check_count("servers", self.servers, 0)
        if isinstance(self.gbit_s, bool) or not isinstance(self.gbit_s, (int, float)) or not self.gbit_s > 0:
            raise ValueError(f"Cluster.gbit_s must be a link rate > 0 Gbit/s (math.inf allowed), got {self.gbit_s!r}")
        for name in ("latency_s", "host_overhead_s", "compute_slowdown", "collective_slowdown"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value >= 0
            ):
                raise ValueError(f"Cluster.{name} must be a finite number >= 0, got {value!r}")
        _check_count("in_flight", self.in_flight, 1)
        if not isinstance(self.all_to_all, bool):
            raise ValueError(f"Cluster.all_to_all must be True or False, got {self.all_to_all!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"Cluster.algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, "
                             f"got {self.algorithm!r}")

    @property
    def bytes_per_s(self) -> float:
        """One host's link rate in bytes per second."""
        return self.gbit_s * 1e9 / 8

    def allreduce_s(self, nbytes: int) -> float:
        """One all-reduce of ``nbytes`` among ``workers``; see [Note: the simulator]."""
        n, alpha, rate = self.workers, self.latency_s, self.bytes_per_s
        if n == 1:
            return self.host_overhead_s
        if self.algorithm == "ring":
            return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / rate + self.host_overhead_s
        return 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / rate + self.host_overhead_s

    def two_step_s(self, nbytes: int) -> float:
        """One all-reduce of ``nbytes`` in two all-to-alls: each worker sends a ring's bytes, to every
        other worker at once, so a hop's latency per step, and the host's cost of two collectives."""
        n = self.workers
        if n == 1:
            return self.host_overhead_s
        return 2 * self.latency_s + 2 * (n - 1) / n * nbytes / self.bytes_per_s + 2 * self.host_overhead_s

    def push_pull_s(self, nbytes: int) -> float:
        """One block's push and pull through its server's link (every worker's copy in and out)."""
        if self.servers < 1:
            raise ValueError("Cluster.push_pull_s needs parameter servers; build the cluster with servers=1 or more")
        return self.workers * nbytes / self.bytes_per_s + 2 * self.latency_s + self.host_overhead_s

    # ------------------------------------------------------ measured links
    @classmethod
    def from_link(
        cls,
        link: LinkProfile,
        workers: int,
        gbit_s: float | None = None,
        algorithm: str = "ring",
        *,
        latency_s: float = DEFAULT_LATENCY_S,
    ) -> Cluster:
        """The cluster whose ring all-reduce among ``link.world_size`` replicas takes what ``link`` measured,
        scaled to ``workers``; ``gbit_s`` overrides the link rate.

        A fixed cost measured at one world size cannot tell the network's per-hop
        latency from the host's per-collective work: up to ``latency_s`` per hop
        is taken as latency (it grows with the world), the rest as host overhead
        (it does not).
        """
        world = link.world_size
        if world < 2:
            raise ValueError(
                f"the link was measured among {world} replica(s): there is no all-reduce cost to derive a cluster "
                "from; measure the link with at least 2 replicas"
            )
        if not (link.bytes_per_s > 0 and math.isfinite(link.latency_s) and link.latency_s >= 0):
            raise ValueError(f"the link's fit is not usable (latency_s={link.latency_s!r}, "
                             f"bytes_per_s={link.bytes_per_s!r}); measure the link again")
        hops = 2 * (world - 1)
        alpha = min(latency_s, link.latency_s / hops)
        rate_gbit = link.bytes_per_s * hops / world * 8 / 1e9
        return cls(
            workers=workers, gbit_s=rate_gbit if gbit_s is None else gbit_s, latency_s=alpha, algorithm=algorithm,
            host_overhead_s=max(0.0, link.latency_s - hops * alpha), compute_slowdown=link.compute_slowdown,
            collective_slowdown=link.collective_slowdown, in_flight=link.in_flight,
        )

    def link_profile(self, sizes: Sequence[int] = LINK_SAMPLE_BYTES) -> LinkProfile:
        """What measuring this cluster's all-reduce would record (the inverse of `from_link` for a ring)."""
        if self.workers < 2:
            raise ValueError("a link profile needs at least 2 workers; one worker has no all-reduce to measure")
        n = self.workers
        per_byte = (2 * (n - 1) / n if self.algorithm == "ring" else 2) / self.bytes_per_s
        return LinkProfile(
            world_size=self.workers,
            samples=tuple(LinkSample(int(n), self.allreduce_s(int(n))) for n in sizes),
            latency_s=self.allreduce_s(0),
            bytes_per_s=math.inf if per_byte <= 0 else 1 / per_byte,
            compute_slowdown=self.compute_slowdown,
            collective_slowdown=self.collective_slowdown,
            in_flight=self.in_flight,
        )

    def describe(self) -> str:
        servers = f", {self.servers} server(s)" if self.servers else ""
        pairs = "" if self.in_flight == 1 else f", {self.in_flight} at once"
        pairs += ", all-to-alls" if self.all_to_all else ""
        return (f"{self.workers} workers at {self.gbit_s:g} Gbit/s ({self.algorithm}{servers}, "
                f"{self.latency_s * 1e6:g} us per hop, {self.host_overhead_s * 1e6:g} us per collective{pairs})")


def _check_count(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Cluster.{name} must be an integer >= {low}, got {value!r}")

"""Which `Strategy` to run: the candidates, and the one the simulator finds fastest."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from commsched.profiling.profile import Profile
from commsched.simulator.cluster import Cluster
from commsched.simulator.engine import simulate
from commsched.simulator.spec import SimResult
from commsched.strategy import ParameterServer, Strategy

PARTITION_MB = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, None)
CREDIT_FACTORS = (1, 2, 4, 8)
"""Credit windows tried: these multiples of the partition, and no window."""
BUCKET_CAP_MB = (5.0, 25.0, 100.0)
FIRST_BUCKET_MB = (1.0, 4.0)
TIE_S = 1e-6
"""Iteration times closer than this are a tie: fewer collectives are the safer bet on a real link."""


def strategy_space(base: Strategy = Strategy()) -> list[Strategy]:
    """The candidates the tuner and ``commsched plan`` consider: ``base`` with every combination of
    partition, credit window, bucket caps and forward overlap, priority on, ``adaptive=False`` (taken
    literally), each behaviour once.

    Two strategies behave alike when they lay out, cut and issue the same bytes:
    buckets are capped at the partition size, so e.g. 1 MiB partitions give the
    same buckets under every ``bucket_cap_mb`` of 1 MiB or more; the first such
    strategy stands for all.
    """
    found: dict[tuple, Strategy] = {}
    for partition in PARTITION_MB:
        credits = [None] if partition is None else [*(partition * f for f in CREDIT_FACTORS), None]
        for credit in credits:
            for cap in BUCKET_CAP_MB:
                for first in FIRST_BUCKET_MB:
                    for overlap in (True, False):
                        candidate = dataclasses.replace(
                            base, partition_mb=partition, credit_mb=credit, bucket_cap_mb=cap,
                            first_bucket_mb=first, overlap_forward=overlap, priority=True, adaptive=False,
                        )
                        found.setdefault(_behaviour(candidate), candidate)
    return list(found.values())


def _behaviour(strategy: Strategy) -> tuple:
    return (tuple(strategy.bucket_size_limits_bytes), strategy.partition_bytes, strategy.credit_bytes,
            strategy.ps_block_bytes if strategy.parameter_server else None, strategy.overlap_forward,
            strategy.priority, strategy.backend)


def best_strategy(
    profile: Profile, cluster: Cluster, space: Iterable[Strategy] | None = None
) -> tuple[Strategy, SimResult]:
    """The fastest strategy of ``space`` on ``cluster`` by simulated iteration time. A tie (within
    `TIE_S`) goes to fewer collectives, then to the earlier one. Without ``space``: `strategy_space`, and
    on a cluster with servers the same space on `ParameterServer` too."""
    if space is None:
        # block_mb=None: each candidate's partitions are its blocks, so every partition size is tried as a block size
        servers = [ParameterServer(num_servers=cluster.servers, block_mb=None)] if cluster.servers else []
        space = [*strategy_space(), *(s for backend in servers for s in strategy_space(Strategy(backend=backend)))]
    results = [(strategy, simulate(profile, cluster, strategy)) for strategy in space]
    if not results:
        raise ValueError("best_strategy got an empty space of strategies; pass at least one, or None for "
                         "strategy_space()")
    fastest = min(result.iteration_s for _, result in results)
    return min((pair for pair in results if pair[1].iteration_s <= fastest + TIE_S),
               key=lambda pair: pair[1].collectives)

"""What communication costs the computation on the cell's own cores: the bound with contention.

[Note: the bound with contention] The plain bound, max(compute alone, one
all-reduce of all gradients), assumes that communication costs the computation
nothing. On the emulated cluster it does not: gloo's threads, the kernel's TCP
path, the bridge and the shaper share the machine's cores with the training
threads, so a schedule that hides every byte still pays for moving them.

`contention_on_rank` measures that price: after a barrier, every worker starts
one all-reduce of a buffer as large as all gradients and, at once, one
compute-only iteration (forward, backward, update); the time until both have
ended is what an iteration costs on these cores with all of its communication
overlapped, from the very start (earlier than any real schedule, whose
gradients appear during the backward pass). Each such pair is timed next to
one compute-only iteration alone, order alternating, so that the ratio

    together / max(compute alone, all-reduce alone)

does not depend on how the machine's speed drifts over the cell; the results
(`commsched.bench.results`) scale the plain bound by the median ratio. A
commsched iteration above that bound lost time to its schedule, to dispatch or
to noise; the part of the plain bound's gap below it is the cores'.

Every time is the slowest worker's: a data-parallel iteration ends when its
last rank does. The cores' price falls unevenly: at 1 Gbit/s one rank's
backward pass often ran 20 to 45 ms longer than the other's, which rank
alternating between iterations, under torch DDP as under commsched
(docs/records/2026-11-24-one-gbit-cells-and-the-cores.md). Rank 0's own times
missed it whenever rank 0 was the faster one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from commsched.bench.compare import ComparisonConfig, gradient_elements, slowest_s, start_run, worker_group
from commsched.bench.models import WORKLOADS
from commsched.bench.systems import ComputeOnly
from commsched.errors import wait_work

PAIRS = 6
"""Pairs (alone, together) measured per cell, after one untimed pair."""
WAIT_S = 600.0
"""The longest wait for one all-reduce beside the computation: a lost host fails the cell."""


@dataclass
class ContentionResult:
    """Rank 0's record of the slowest worker's timings, pair by pair (plain data, so it travels as JSON)."""

    compute_alone_s: list[float] = field(default_factory=list)
    together_s: list[float] = field(default_factory=list)
    """Compute-only iteration and one all-reduce of all gradients started together, until both ended."""
    allreduce_s: list[float] = field(default_factory=list)
    """The same all-reduce alone, timed right after each pair."""


def contention_on_rank(rank: int, world_size: int, config: ComparisonConfig,
                       pairs: int = PAIRS) -> ContentionResult | None:
    """Measure the bound with contention (see the module's note) on the workers.

    Collective over the world (server ranks only help build the workers' group);
    rank 0 returns the slowest worker's timings, other ranks None.
    """
    workers = worker_group(world_size, config.num_servers)
    num_workers = world_size - config.num_servers
    if rank >= num_workers:
        return None
    torch.manual_seed(0)
    run = start_run(ComputeOnly(), WORKLOADS[config.workload].build(), workers, config, rank, num_workers)
    buffer = torch.zeros(gradient_elements(config.workload))

    def slowest(seconds: float) -> float:
        return slowest_s(seconds, workers)

    def alone() -> float:
        dist.barrier(group=workers)
        return slowest(run.step())

    def together() -> float:
        dist.barrier(group=workers)
        start = time.perf_counter()
        work = dist.all_reduce(buffer, group=workers, async_op=True)
        run.step()
        wait_work(work, WAIT_S)
        return slowest(time.perf_counter() - start)

    def allreduce() -> float:
        dist.barrier(group=workers)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=workers)
        return slowest(time.perf_counter() - start)

    result = ContentionResult()
    together(), alone()  # untimed: the first of each may set up buffers
    for index in range(pairs):
        if index % 2:
            result.together_s.append(together())
            result.compute_alone_s.append(alone())
        else:
            result.compute_alone_s.append(alone())
            result.together_s.append(together())
        result.allreduce_s.append(allreduce())
    return result if rank == 0 else None

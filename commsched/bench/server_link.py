"""The parameter servers' links, measured: the communication part of their bound.

[Note: the measured server link] The all-reduce system's bound is one all-reduce,
timed; the parameter servers' is timed too, not priced at the link's rate. The
rate leaves out what every byte costs on a real link: the TCP/IP headers of each
frame (about 4.5% at an MTU of 1500) and the flows of several workers sharing one
server's shaped queue. Every worker sends each server an even share of all the
gradients and receives as much back, everything posted at once as one message
each way, with no computation and none of commsched's protocol: no
parameter-server system moves those bytes in less time. `commsched.bench.results`
scales the time from the even share to the busiest server's bytes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from commsched.bench.compare import ComparisonConfig, SystemResult, gradient_elements, slowest_s


def server_link_on_rank(rank: int, world_size: int, config: ComparisonConfig) -> SystemResult | None:
    """Time one exchange of all gradients between the workers and the servers (the last
    ``config.num_servers`` ranks). Every rank takes part; rank 0 returns, per repeat, the
    time until the last rank finished (None elsewhere, and when there are no servers)."""
    servers = config.num_servers
    if servers == 0:
        return None
    share = -(-gradient_elements(config.workload) // servers)
    first_server = world_size - servers
    peers = range(first_server) if rank >= first_server else range(first_server, world_size)
    outgoing = {peer: torch.ones(share) for peer in peers}
    incoming = {peer: torch.empty(share) for peer in peers}
    result = SystemResult()
    for _ in range(max(5, config.rounds)):  # several flows share a shaped queue: it varies more than an all-reduce
        dist.barrier()
        start = time.perf_counter()
        works = [dist.irecv(incoming[peer], src=peer) for peer in peers]
        works += [dist.isend(outgoing[peer], dst=peer) for peer in peers]
        for work in works:
            work.wait()
        result.iteration_times_s.append(slowest_s(time.perf_counter() - start))
    return result if rank == 0 else None

"""A model's profile taken where it trains: on the cell's hosts, all of them computing at once.

The simulator is only as good as the compute times it is given. On the emulated
cluster the hosts share the machine's cores, so a profile taken by one process
alone would be faster than any host is during training; taken on every host at
once, it sees the same sharing the systems see. The link is measured on the
same hosts right after (`commsched.profiling.link.measure_link`), with one training
iteration as the computation it slows down.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from commsched.bench.compare import ComparisonConfig, worker_group
from commsched.bench.models import WORKLOADS
from commsched.profiling.link import measure_link
from commsched.profiling.model import profile_model


def profile_on_rank(rank: int, world_size: int, config: ComparisonConfig, iterations: int = 9) -> dict | None:
    """Collective over the world: every worker profiles the model at once, then the link is measured
    among the workers. Rank 0 returns its `commsched.profiling.profile.Profile` (with the link) as JSON-ready data;
    other ranks and parameter servers return None."""
    workers = worker_group(world_size, config.num_servers)
    if rank >= world_size - config.num_servers:
        return None
    workload = WORKLOADS[config.workload]
    torch.manual_seed(0)
    model = workload.build()
    stream = workload.batches(config.batch_size, seed=rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=0.9)

    def one_iteration() -> None:
        x, y = next(stream)
        F.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)

    dist.barrier(group=workers)
    profile = profile_model(model, lambda: next(stream), lambda output, y: F.cross_entropy(output, y),
                            optimizer=optimizer, iterations=iterations, name=workload.name)
    # A host done early keeps computing until every host is done, so none profiles on an emptier machine.
    everyone_done = dist.all_reduce(torch.zeros(1), group=workers, async_op=True)
    while not everyone_done.is_completed():
        one_iteration()
    everyone_done.wait()
    link = measure_link(workers, torch.device("cpu"), compute=one_iteration)
    return profile.with_link(link).to_dict() if rank == 0 else None

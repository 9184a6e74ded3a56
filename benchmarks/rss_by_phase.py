"""Where in training does each system's peak resident memory (RSS) rise? On loopback, 2 ranks.

    .venv/bin/python benchmarks/rss_by_phase.py                          # about a minute
    .venv/bin/python benchmarks/rss_by_phase.py --workload mlp-22m       # about two minutes

`benchmarks/peak_rss.py` and ``commsched bench`` give one peak per system; this
says when it was reached. Each system (torch DDP with 5 MiB buckets, commsched's
``AllReduce()``, sharded optimizer state, and sharded state with the gradients
reduce-scattered) trains alone in fresh ranks, with
glibc's mmap threshold fixed (`commsched.bench.memory.fix_mmap_threshold`: the
peak is what was alive at once), and reads its peak RSS (``ru_maxrss``) after
each forward pass, backward pass and ``step()``. Printed per system: every
iteration where the peak rose, the phase it rose in and by how much, and the
RSS after ``step()`` (the steady memory), as the max over ranks. A rise above
the steady memory is a transient: in commsched's warm-up, the link's calibration
at the end of the third backward pass, and the new layouts after it.
"""

from __future__ import annotations

import argparse
import resource

import torch
import torch.distributed as dist

import commsched
from commsched.bench.memory import fix_mmap_threshold
from commsched.bench.models import WORKLOADS
from commsched.strategy import AllReduce, Strategy
from commsched.testing import run_ranks

SYSTEMS = {
    "torch DDP, bucket_cap_mb=5": None,
    "commsched AllReduce()": Strategy(),
    "commsched AllReduce(shard_optimizer=True)": Strategy(backend=AllReduce(shard_optimizer=True)),
    "commsched AllReduce(shard_optimizer=True, reduce_scatter=True)":
        Strategy(backend=AllReduce(shard_optimizer=True, reduce_scatter=True)),
}
PHASES = ("forward", "backward", "step")
BATCH = 8


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def train(rank: int, world_size: int, system: str, workload: str, optimizer_name: str,
          iterations: int) -> list[tuple[float, float, float, float]]:
    """Per iteration: the peak RSS after the forward pass, the backward pass and ``step()``, and the RSS after it."""
    fix_mmap_threshold()
    torch.manual_seed(0)
    model = WORKLOADS[workload].build()
    if optimizer_name == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    strategy = SYSTEMS[system]
    if strategy is None:
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=5, gradient_as_bucket_view=True)
    else:
        model, optimizer = commsched.prepare(model, optimizer, strategy)
    inputs, _ = next(WORKLOADS[workload].batches(BATCH, seed=rank))
    rows = []
    for _ in range(iterations):
        output = model(inputs)
        after_forward = peak_mib()
        output.float().pow(2).mean().backward()
        after_backward = peak_mib()
        optimizer.step()
        optimizer.zero_grad()
        rows.append((after_forward, after_backward, peak_mib(), resident_mib()))
    if strategy is not None:
        optimizer.synchronize()
        commsched.release(model)
    peaks = torch.tensor(rows, dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return peaks.tolist()


def report(system: str, rows: list[list[float]]) -> None:
    print(f"\n{system}: steady RSS {rows[-1][3]:.1f} MiB, peak {rows[-1][2]:.1f} MiB")
    previous = rows[0][0]
    for iteration, row in enumerate(rows):
        for phase, peak in zip(PHASES, row[:3], strict=True):
            if peak - previous >= 0.5 and iteration > 0:
                print(f"  iteration {iteration} {phase}: peak +{peak - previous:.1f} MiB to {peak:.1f} "
                      f"(RSS after its step {row[3]:.1f})")
            previous = peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="resnet50-emulated", choices=sorted(WORKLOADS))
    parser.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    parser.add_argument("--iterations", type=int, default=12,
                        help="the first 12 hold warm-up, the new layout after it and the check's first switch")
    args = parser.parse_args()
    print(f"{args.workload}, {args.optimizer}, 2 ranks on loopback, batch {BATCH} per rank; "
          "peaks that rose by 0.5 MiB or more after the first iteration:")
    for system in SYSTEMS:
        rows = run_ranks(train, 2, system, args.workload, args.optimizer, args.iterations, timeout_s=600)[0]
        report(system, rows)


if __name__ == "__main__":
    main()

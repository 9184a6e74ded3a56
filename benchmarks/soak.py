"""Soak: a long run with scheduling and forward overlap on must not grow.

Two ranks on loopback train a small model with the default Strategy for
``--iterations`` iterations. Each rank records its resident memory, thread
count and open file descriptors at the end of warm-up and every ``--every``
iterations after it. Exits non-zero if any rank's memory grew by more than
``--max-rss-growth`` (2% by default) from the end of warm-up to the end, or its
thread or descriptor count grew at all.

    .venv/bin/python benchmarks/soak.py --iterations 2000
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.nn.functional as F

import commsched
from commsched.bench import runner
from commsched.testing import run_ranks


def resources() -> tuple[float, int, int]:
    """Resident memory (MiB), threads and open file descriptors of this process (Linux)."""
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return (resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20, len(os.listdir("/proc/self/task")),
            len(os.listdir("/proc/self/fd")))


def soak(rank: int, world_size: int, iterations: int, warmup: int, every: int) -> list[tuple[int, float, int, int]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Small partitions and buckets, so that every iteration has many in flight.
    strategy = commsched.Strategy(bucket_cap_mb=0.1, first_bucket_mb=0.05, partition_mb=0.05, credit_mb=0.1)
    model, optimizer = commsched.prepare(model, optimizer, strategy)
    assert commsched.status(model).transport.startswith("all-reduce")
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator)
    samples = []
    for iteration in range(1, iterations + 1):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if iteration >= warmup and (iteration - warmup) % every == 0 or iteration == iterations:
            optimizer.synchronize()
            gc.collect()
            samples.append((iteration, *resources()))
    assert commsched.status(model).lifecycle is commsched.Lifecycle.OVERLAPPING
    commsched.release(model)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = runner.make_parser(__doc__, summary_only=True)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200, help="iterations before the first sample")
    parser.add_argument("--every", type=int, default=300)
    parser.add_argument("--max-rss-growth", type=float, default=0.02)
    args = parser.parse_args(argv)
    runner.refuse_below_one(parser, args, "iterations", "every")
    per_rank = run_ranks(soak, 2, args.iterations, args.warmup, args.every, timeout_s=3600)
    failed = False
    for rank, samples in enumerate(per_rank):
        print(f"rank {rank}: iteration, RSS MiB, threads, fds")
        for iteration, rss, threads, fds in samples:
            print(f"  {iteration:6d}  {rss:8.1f}  {threads:3d}  {fds:4d}")
        (_, rss0, threads0, fds0), (_, rss1, threads1, fds1) = samples[0], samples[-1]
        growth = rss1 / rss0 - 1
        verdict = []
        if growth > args.max_rss_growth:
            verdict.append(f"RSS grew {growth:+.1%} (limit {args.max_rss_growth:.0%})")
        if threads1 > threads0:
            verdict.append(f"threads grew {threads0} -> {threads1}")
        if fds1 > fds0:
            verdict.append(f"file descriptors grew {fds0} -> {fds1}")
        failed |= bool(verdict)
        print(f"  RSS {growth:+.2%} from iteration {samples[0][0]} to {samples[-1][0]}; "
              + ("; ".join(verdict) if verdict else "flat"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

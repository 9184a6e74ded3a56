"""How much host CPU an iteration takes per rank, by system, on the emulated workloads (loopback).

    .venv/bin/python benchmarks/host_cpu.py                   # about 4 minutes on 2 cores
    .venv/bin/python benchmarks/host_cpu.py --workloads resnet50-emulated --world-size 2

Why: the emulated workloads (`commsched.bench.emulated`) charge their
computation as sleep so that the cores stay free, but each rank still spends
host CPU on the real operations, the autograd graph, its wake-ups and the
system under test. Once the ranks of a cell need more CPU per iteration than
the machine's cores give in that time, the cores set the pace and the cell says
nothing about the schedules. This measures that CPU (``time.process_time``:
every thread of the process, gloo's included) per iteration:

- in one process without communication, with the workload's times as emulated
  and with every time zero (the operations alone: the difference is what the
  sleeps and wake-ups cost);
- per rank of ``--world-size`` ranks on loopback, for the model without a
  wrapper, torch DDP (``bucket_cap_mb`` 1 and 25), commsched's default and
  commsched with every scheduling feature off, in interleaved rounds (the order
  alternates), after warm-up; medians over rounds and ranks.

From these: the host count at which a cell's ranks need all the cores,
``cores * iteration time / CPU per rank``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time

from commsched.testing import run_ranks

SYSTEMS = ("no wrapper", "DDP, 1 MiB", "DDP, 25 MiB", "commsched", "commsched, scheduling off")


def alone(workload_name: str, time_scale: float | None, iterations: int) -> tuple[float, float]:
    """CPU and wall seconds per iteration in this process, without communication (``time_scale``
    None: the workload's own; else every time multiplied by it)."""
    import torch
    import torch.nn.functional as F

    from commsched.bench.emulated import EMULATED_WORKLOADS
    from commsched.bench.models import WORKLOADS

    torch.set_num_threads(1)  # as each rank runs (`run_ranks`): idle intra-op threads would spin on the cores
    emulated = EMULATED_WORKLOADS[workload_name]
    if time_scale is not None:
        emulated = dataclasses.replace(emulated, time_scale=emulated.time_scale * time_scale)
    torch.manual_seed(0)
    net = emulated.build()
    batches = WORKLOADS[workload_name].batches(8)

    def iteration() -> None:
        x, y = next(batches)
        F.cross_entropy(net(x), y).backward()
        net.zero_grad()

    for _ in range(5):
        iteration()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(iterations):
        iteration()
    return (time.process_time() - cpu) / iterations, (time.perf_counter() - wall) / iterations


def per_rank(rank: int, world_size: int, workload_name: str, rounds: int, iterations: int) -> dict[str, list]:
    """Per system of `SYSTEMS`, this rank's (CPU, wall) seconds per iteration of each round."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import commsched
    from commsched.bench.models import WORKLOADS
    from commsched.bench.systems import UNSCHEDULED

    workload = WORKLOADS[workload_name]
    torch.manual_seed(0)
    base = workload.build()
    runs = {}
    for name in SYSTEMS:
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if name.startswith("DDP"):
            model = DistributedDataParallel(model, bucket_cap_mb=1 if "1 MiB" in name else 25)
        elif name.startswith("commsched"):
            model, optimizer = commsched.prepare(model, optimizer, UNSCHEDULED if "off" in name else None)
        runs[name] = (model, optimizer)
    batches = workload.batches(8, seed=rank)

    def iteration(name: str) -> None:
        model, optimizer = runs[name]
        x, y = next(batches)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    for name in SYSTEMS:
        for _ in range(12):  # warm-up, and commsched's check of its choice
            iteration(name)
    measured: dict[str, list] = {name: [] for name in SYSTEMS}
    for round_index in range(rounds):
        for name in (SYSTEMS if round_index % 2 == 0 else SYSTEMS[::-1]):
            torch.distributed.barrier()
            iteration(name)  # the lead-in
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(iterations):
                iteration(name)
            measured[name].append(((time.process_time() - cpu) / iterations, (time.perf_counter() - wall) / iterations))
    for name, (model, _) in runs.items():
        if name.startswith("commsched"):
            commsched.release(model)
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["vgg16-emulated", "resnet50-emulated", "gpt2-emulated"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.rounds < 1 or args.iterations < 1:
        parser.error("--world-size must be >= 2, --rounds and --iterations >= 1")
    cores = len(os.sched_getaffinity(0))
    report = {}
    for workload in args.workloads:
        own_cpu, own_wall = alone(workload, None, 20)
        ops_cpu, _ = alone(workload, 0.0, 20)
        measured = run_ranks(per_rank, args.world_size, workload, args.rounds, args.iterations, timeout_s=1800)
        rows = {}
        for name in SYSTEMS:
            samples = [sample for rank_result in measured for sample in rank_result[name]]
            cpu = statistics.median(c for c, _ in samples)
            wall = statistics.median(w for _, w in samples)
            rows[name] = {"cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3, "hosts_to_fill_cores": cores * wall / cpu}
        report[workload] = {"alone": {"cpu_ms": own_cpu * 1e3, "wall_ms": own_wall * 1e3,
                                      "operations_only_cpu_ms": ops_cpu * 1e3}, "per_rank": rows}
        print(f"\n{workload}: alone {own_cpu * 1e3:.1f} ms CPU per iteration of {own_wall * 1e3:.0f} ms "
              f"({ops_cpu * 1e3:.1f} ms with every time zero); {args.world_size} ranks on loopback, "
              f"{args.rounds} rounds x {args.iterations} iterations, medians over rounds and ranks:")
        print(f"  {'system':28} {'CPU ms/iter':>12} {'wall ms/iter':>13} {f'hosts that fill {cores} cores':>26}")
        for name, row in rows.items():
            print(f"  {name:28} {row['cpu_ms']:>12.1f} {row['wall_ms']:>13.1f} {row['hosts_to_fill_cores']:>26.1f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

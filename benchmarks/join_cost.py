"""What training inside torch's ``Join`` costs with sharded optimizer state, on loopback.

    .venv/bin/python benchmarks/join_cost.py --world-sizes 2 4     # about 5 minutes on 2 cores

Under an enabled ``Join`` every synchronised iteration of a sharded model ends in
one small all-reduce on the all-gathers' group, the record a rank out of
batches updates its chunks from ([Note: a joined rank's shard] in
`commsched.update.step_records`); ``Join`` itself adds its count of the ranks
still training to every forward pass. Both run on every iteration whether or
not a rank has run out, so this measures them with even inputs: per rank, four
copies of the same model, sharded or not (`LOOPS`), each trained plainly or
inside ``Join``, in interleaved rounds (the order alternates), after warm-up.
Reported per world size: each loop's median iteration time, and for each
backend the median over rounds of the ratio of its two loops in that round.
The exit of ``Join`` (a count and a broadcast of the parameters from the rank
that trained longest) happens once per epoch and is not timed.

The workload's computation is charged as sleep (``resnet50-emulated``, see
`commsched.bench.emulated`), so the cores stay free for what the two loops do
differently.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

from commsched.testing import run_ranks

LOOPS = ("sharded", "sharded, under Join", "AllReduce()", "AllReduce(), under Join")
"""The four loops each rank trains, interleaved: what sharded state adds under ``Join`` is the
first ratio less the second (``Join``'s own count, which DDP pays too)."""


def measure(rank: int, world_size: int, workload_name: str, batch_size: int, rounds: int,
            iterations: int) -> dict[str, list[float]] | None:
    """Per loop of `LOOPS`, the seconds of every measured iteration (rank 0 returns them)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.join import Join

    import commsched
    from commsched.bench.models import WORKLOADS

    workload = WORKLOADS[workload_name]
    torch.manual_seed(0)
    base = workload.build()
    runs = {}
    for name in LOOPS:
        model = copy.deepcopy(base)
        backend = commsched.AllReduce(shard_optimizer=name.startswith("sharded"))
        runs[name] = commsched.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                                       commsched.Strategy(backend=backend))
    batches = workload.batches(batch_size, seed=rank)

    def iteration(model, optimizer) -> None:
        x, y = next(batches)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    def loop(name: str, count: int) -> list[float]:
        model, optimizer = runs[name]
        times = []
        with Join([model], enable=name.endswith("under Join")):
            for _ in range(count):
                started = time.perf_counter()
                iteration(model, optimizer)
                times.append(time.perf_counter() - started)
            model.state_dict()  # the last updates, inside the Join
        return times

    for name in runs:
        loop(name, 8)  # warm-up (3 iterations) and the layout after it
    measured: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(rounds):
        order = list(runs) if round_index % 2 == 0 else list(runs)[::-1]
        for name in order:
            dist.barrier()
            loop(name, 1)  # the lead-in: the first iteration of a round waits for the previous loop's peers
            measured[name].append(statistics.median(loop(name, iterations)))
    for model, _ in runs.values():
        commsched.release(model)
    return measured if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--workload", default="resnet50-emulated")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    if min(args.world_sizes) < 2 or args.rounds < 1 or args.iterations < 1:
        parser.error("--world-sizes must be >= 2, --rounds and --iterations >= 1")

    report = {}
    print(f"{args.workload}, batch {args.batch_size} per rank, Adam, loopback; {args.rounds} interleaved rounds "
          f"of {args.iterations} iterations; rank 0's median over rounds of each round's median iteration, "
          "and the median of the rounds' own ratios")
    print(f"{'ranks':>5} " + " ".join(f"{name + ' ms':>25}" for name in LOOPS)
          + f" {'sharded: Join / plain':>22} {'AllReduce(): Join / plain':>26}")
    for world_size in args.world_sizes:
        measured = run_ranks(measure, world_size, args.workload, args.batch_size, args.rounds, args.iterations,
                             timeout_s=1800)[0]
        medians = {name: statistics.median(rounds) * 1e3 for name, rounds in measured.items()}
        ratios = {backend: statistics.median(joined / plain for joined, plain in
                                             zip(measured[f"{backend}, under Join"], measured[backend], strict=True))
                  for backend in ("sharded", "AllReduce()")}
        report[world_size] = {"median_ms": medians, "join_over_plain": ratios}
        print(f"{world_size:>5} " + " ".join(f"{medians[name]:>25.2f}" for name in LOOPS)
              + f" {ratios['sharded']:>22.3f} {ratios['AllReduce()']:>26.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

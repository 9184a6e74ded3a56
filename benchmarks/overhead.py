"""What scheduling itself costs, per iteration and per partition, on loopback.

    .venv/bin/python benchmarks/overhead.py --world-sizes 1 2

With one rank every reduction completes at once, so the difference to the
unscheduled core is pure bookkeeping: hooks, the plan executor, gates and
per-bucket updates. With two ranks on loopback it also includes what more,
smaller collectives cost. Every variant trains the ResNet-like model side by
side with the others (interleaved rounds); reported: median iteration time,
the difference to the unscheduled core, partitions per iteration, and the
difference divided by the number of partitions.
"""

from __future__ import annotations

import statistics
import sys

from commsched.bench import runner
from commsched.bench.compare import ComparisonConfig, compare_on_rank
from commsched.bench.systems import UNSCHEDULED, Commsched
from commsched.strategy import Strategy
from commsched.testing import run_ranks

PARTITION_SIZES_MB = (None, 4.0, 1.0, 0.25, 0.0625)


def count_partitions(rank: int, world_size: int, workload: str, partition_mb: float | None) -> int:
    import torch
    import torch.nn.functional as F

    import commsched
    from commsched.bench.models import WORKLOADS

    spec = WORKLOADS[workload]
    model = spec.build()
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                         Strategy(partition_mb=partition_mb))
    x, y = next(spec.batches(2))
    F.cross_entropy(model(x), y).backward()
    return commsched.status(model).partitions


def main(argv: list[str] | None = None) -> int:
    parser = runner.make_parser(__doc__)
    runner.add_world_sizes(parser, default=[1, 2])
    parser.add_argument("--workload", default="resnet-like")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    runner.add_json(parser, help="write every system's iteration times and partitions here")
    args = parser.parse_args(argv)
    runner.refuse_below_one(parser, args, "iterations", "rounds")

    unscheduled = Commsched(UNSCHEDULED, "unscheduled")
    partitioned = {p: Commsched(Strategy(partition_mb=p), f"partition_mb={p}") for p in PARTITION_SIZES_MB}
    partitions = {system.name: run_ranks(count_partitions, 1, args.workload, p)[0] for p, system in partitioned.items()}
    rows: list[dict] = []
    for world_size in args.world_sizes:
        config = ComparisonConfig(workload=args.workload, batch_size=args.batch_size, iterations=args.iterations,
                                  rounds=args.rounds, warmup=6, systems=(unscheduled, *partitioned.values()),
                                  show_progress=False)
        results = run_ranks(compare_on_rank, world_size, config, timeout_s=1800)[0]
        base = results[unscheduled.name].median_s
        print(f"\n{args.workload}, batch {args.batch_size}, {world_size} rank(s) on loopback, "
              f"{args.rounds} rounds x {args.iterations} iterations")
        print(f"{'system':32} {'median ms':>10} {'minus unscheduled ms':>21} {'partitions':>11} {'us/partition':>13}")
        for name, result in results.items():
            delta = (result.median_s - base) * 1e3
            count = partitions.get(name)
            rows.append({"world_size": world_size, "system": name, "partitions": count,
                         "iteration_times_s": result.iteration_times_s})
            per = f"{delta * 1e3 / count:13.1f}" if count else f"{'':>13}"
            print(f"{name:32} {result.median_s * 1e3:10.2f} {delta:21.2f} {count or '':>11} {per}")
        spread = statistics.quantiles(results[unscheduled.name].iteration_times_s, n=10)
        print(f"(unscheduled p10-p90: {spread[0] * 1e3:.1f}-{spread[-1] * 1e3:.1f} ms: differences inside it are noise)")
        runner.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

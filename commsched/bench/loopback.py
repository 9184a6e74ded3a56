"""Is commsched ever slower than torch DDP? Both on this machine's loopback, at 2 and 4 ranks.

    .venv/bin/python benchmarks/loopback.py --json results/loopback.json     # about 10 minutes on 2 cores

Loopback has no network bottleneck, so there is little communication to hide:
this measures what commsched costs where scheduling cannot help, and needs no
root (``commsched bench`` points here where it cannot build emulated hosts). For each model
and world size, five systems train side by side in interleaved rounds (see
commsched.bench.compare): torch DDP with its defaults (25 MB buckets), torch
DDP with 5 and 100 MB buckets, commsched with its defaults and commsched with
scheduling off. Every repeat is a fresh group of processes. Reported per model
and world size: the median iteration time of each system (median over repeats
of each repeat's median), *best DDP*, the fastest DDP bucket size of each
repeat, and the time ratios commsched/DDP and commsched/best DDP per repeat
and their medians (below 1.0: commsched is faster).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict

from commsched.bench import runner
from commsched.bench.compare import ComparisonConfig, SystemResult, compare_on_rank
from commsched.bench.models import WORKLOADS
from commsched.bench.repeats import Repeat, fastest_cell, ms_cell, ratio_cell
from commsched.bench.systems import UNSCHEDULED, Commsched, System, TorchDDP
from commsched.strategy import Strategy

DDP = TorchDDP()
DDP_DEFAULT_BUCKET_MB = 25.0
"""torch DDP's own ``bucket_cap_mb`` default."""
DDP_SWEEP = (TorchDDP(5.0), DDP, TorchDDP(100.0))
"""torch DDP at 5, 25 (its default) and 100 MB buckets: best DDP is the fastest of them."""
DDP_NAMES = tuple(system.name for system in DDP_SWEEP)
OURS, OFF = Commsched(Strategy()), Commsched(UNSCHEDULED, "scheduling off")
SYSTEMS: tuple[System, ...] = (*DDP_SWEEP, OFF, OURS)
BATCH = {"mlp": 32, "resnet-like": 8, "transformer-like": 4}
"""Per rank: small enough that 4 ranks sharing 2 cores finish the default run in about 10 minutes."""
COLUMNS = ("model", "ranks", "batch", "DDP ms", "best DDP ms (MB per repeat)", "sched. off ms", "commsched ms",
           "commsched/DDP median (per repeat)", "commsched/best DDP median (per repeat)")


def measure(model: str, world_size: int, batch_size: int, args: argparse.Namespace) -> list[tuple[Repeat, dict]]:
    """``args.repeats`` fresh groups of ``world_size`` ranks; each repeat's medians and raw results."""
    from commsched.testing import run_ranks

    config = ComparisonConfig(workload=model, batch_size=batch_size, iterations=args.iterations, rounds=args.rounds,
                              warmup=args.warmup, systems=SYSTEMS, show_progress=False)
    repeats = []
    for _ in range(args.repeats):
        results: dict[str, SystemResult] = run_ranks(compare_on_rank, world_size, config, timeout_s=1800)[0]
        repeats.append((Repeat({name: r.median_s for name, r in results.items()}), results))
    return repeats


def bucket_mb(name: str) -> str:
    """A DDP peer's bucket size for the table (its default spelled out)."""
    system = next(system for system in DDP_SWEEP if system.name == name)
    return f"{system.bucket_cap_mb:g}" if system.bucket_cap_mb is not None else f"{DDP_DEFAULT_BUCKET_MB:g}"


def table_row(model: str, world_size: int, batch_size: int, repeats: Sequence[Repeat]) -> list[str]:
    """One row of the table: medians over repeats, and the ratios' medians and values per repeat."""
    return [model, str(world_size), str(batch_size), ms_cell(repeats, DDP.name),
            fastest_cell(repeats, DDP_NAMES, bucket_mb), ms_cell(repeats, OFF.name), ms_cell(repeats, OURS.name),
            ratio_cell(repeats, OURS.name, DDP.name), ratio_cell(repeats, OURS.name, DDP_NAMES)]


def build_parser() -> argparse.ArgumentParser:
    parser = runner.make_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=list(BATCH), choices=sorted(WORKLOADS))
    runner.add_world_sizes(parser, default=[2, 4])
    parser.add_argument("--batch-size", type=int, help=f"per rank, every model (default {BATCH})")
    parser.add_argument("--iterations", type=int, default=5, help="per system per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=4,
                        help="unmeasured iterations per system (commsched plans its order at the 4th)")
    runner.add_repeats(parser, default=3, help="fresh process groups per model and world size")
    runner.add_json(parser, help="write every iteration time here")
    return parser


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    parser = build_parser()
    args = parser.parse_args(argv)
    runner.refuse_below_one(parser, args, "repeats", "iterations", "rounds")
    console = Console(width=max(Console().width, 160))
    table = Table(title=f"loopback, gloo, {args.rounds} interleaved rounds x {args.iterations} iterations, "
                        f"{args.repeats} repeats (times: median iteration; ratios: commsched time / DDP time)")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "model" else "right")
    runs: list[dict] = []
    for model in args.models:
        for world_size in args.world_sizes:
            batch_size = args.batch_size or BATCH.get(model, 16)
            measured = measure(model, world_size, batch_size, args)
            for index, (repeat, results) in enumerate(measured):
                best = repeat.fastest(DDP_NAMES)
                console.print(f"{model}, {world_size} ranks, repeat {index}: commsched/DDP "
                              f"{repeat.ratio(OURS.name, DDP.name):.3f}, commsched/best DDP "
                              f"{repeat.ratio(OURS.name, DDP_NAMES):.3f} ({best})")
                runs.append({"model": model, "world_size": world_size, "batch_size": batch_size, "repeat": index,
                             "best_ddp": best, "systems": {name: asdict(r) for name, r in results.items()}})
            table.add_row(*table_row(model, world_size, batch_size, [repeat for repeat, _ in measured]))
            runner.write_json(args.json, runs)
    console.print(table)
    return 0

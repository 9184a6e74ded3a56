"""Is commsched ever slower than torch DDP? Both on this machine's loopback, at 2 and 4 ranks.

    .venv/bin/python benchmarks/loopback.py --json results/loopback.json     # about 10 minutes on 2 cores

Loopback has no network bottleneck, so there is little communication to hide:
this measures what commsched costs where scheduling cannot help. For each model
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
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from commsched.bench.compare import ComparisonConfig, SystemResult, compare_on_rank
from commsched.bench.models import WORKLOADS
from commsched.bench.systems import UNSCHEDULED, Commsched, System, TorchDDP
from commsched.strategy import Strategy
from commsched.testing import run_ranks

DDP = TorchDDP()
DDP_DEFAULT_BUCKET_MB = 25.0
"""torch DDP's own ``bucket_cap_mb`` default."""
DDP_SWEEP = (TorchDDP(5.0), DDP, TorchDDP(100.0))
"""torch DDP at 5, 25 (its default) and 100 MB buckets: best DDP is the fastest of them."""
OURS, OFF = Commsched(Strategy()), Commsched(UNSCHEDULED, "scheduling off")
SYSTEMS: tuple[System, ...] = (*DDP_SWEEP, OFF, OURS)
BATCH = {"mlp": 32, "resnet-like": 8, "transformer-like": 4}
"""Per rank: small enough that 4 ranks sharing 2 cores finish the default run in about 10 minutes."""


@dataclass(frozen=True)
class Repeat:
    """One fresh group's medians (seconds) by system name."""

    medians_s: dict[str, float]

    @property
    def best_ddp(self) -> str:
        return min((system.name for system in DDP_SWEEP), key=self.medians_s.__getitem__)

    @property
    def vs_ddp(self) -> float:
        """commsched's time / DDP's (defaults)."""
        return self.medians_s[OURS.name] / self.medians_s[DDP.name]

    @property
    def vs_best_ddp(self) -> float:
        return self.medians_s[OURS.name] / self.medians_s[self.best_ddp]


def measure(model: str, world_size: int, batch_size: int, args: argparse.Namespace) -> list[tuple[Repeat, dict]]:
    """``args.repeats`` fresh groups of ``world_size`` ranks; each repeat's medians and raw results."""
    config = ComparisonConfig(workload=model, batch_size=batch_size, iterations=args.iterations, rounds=args.rounds,
                              warmup=args.warmup, systems=SYSTEMS, show_progress=False)
    repeats = []
    for _ in range(args.repeats):
        results: dict[str, SystemResult] = run_ranks(compare_on_rank, world_size, config, timeout_s=1800)[0]
        repeats.append((Repeat({name: r.median_s for name, r in results.items()}), results))
    return repeats


def _bucket_mb(name: str) -> str:
    """A DDP peer's bucket size for the table (its default spelled out)."""
    system = next(system for system in DDP_SWEEP if system.name == name)
    return f"{system.bucket_cap_mb:g}" if system.bucket_cap_mb is not None else f"{DDP_DEFAULT_BUCKET_MB:g}"


def _ratios(values: list[float]) -> str:
    """``median (each repeat)``."""
    return f"{statistics.median(values):.3f} ({' '.join(f'{v:.3f}' for v in values)})"


def table_row(model: str, world_size: int, batch_size: int, repeats: list[Repeat]) -> list[str]:
    """One row of the table: medians over repeats, and the ratios' medians and values per repeat."""
    def ms(name: str) -> str:
        return f"{statistics.median(r.medians_s[name] for r in repeats) * 1e3:.1f}"

    best = statistics.median(r.medians_s[r.best_ddp] for r in repeats) * 1e3
    return [
        model, str(world_size), str(batch_size), ms(DDP.name),
        f"{best:.1f} ({' '.join(_bucket_mb(r.best_ddp) for r in repeats)})", ms(OFF.name), ms(OURS.name),
        _ratios([r.vs_ddp for r in repeats]), _ratios([r.vs_best_ddp for r in repeats]),
    ]


COLUMNS = ("model", "ranks", "batch", "DDP ms", "best DDP ms (MB per repeat)", "sched. off ms", "commsched ms",
           "commsched/DDP median (per repeat)", "commsched/best DDP median (per repeat)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(BATCH), choices=sorted(WORKLOADS))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--batch-size", type=int, help=f"per rank, every model (default {BATCH})")
    parser.add_argument("--iterations", type=int, default=5, help="per system per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=4,
                        help="unmeasured iterations per system (commsched plans its order at the 4th)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh process groups per model and world size")
    parser.add_argument("--json", type=Path, help="write every iteration time here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(width=max(Console().width, 160))
    table = Table(title=f"loopback, gloo, {args.rounds} interleaved rounds x {args.iterations} iterations, "
                        f"{args.repeats} repeats (times: median iteration; ratios: commsched time / DDP time)")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "model" else "right")
    record: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    for model in args.models:
        for world_size in args.world_sizes:
            batch_size = args.batch_size or BATCH.get(model, 16)
            measured = measure(model, world_size, batch_size, args)
            for index, (repeat, results) in enumerate(measured):
                console.print(f"{model}, {world_size} ranks, repeat {index}: commsched/DDP {repeat.vs_ddp:.3f}, "
                              f"commsched/best DDP {repeat.vs_best_ddp:.3f} ({repeat.best_ddp})")
                record["runs"].append({"model": model, "world_size": world_size, "batch_size": batch_size,
                                       "repeat": index, "best_ddp": repeat.best_ddp,
                                       "systems": {name: asdict(r) for name, r in results.items()}})
            table.add_row(*table_row(model, world_size, batch_size, [repeat for repeat, _ in measured]))
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

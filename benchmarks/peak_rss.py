"""Where does commsched's peak resident memory (RSS) differ from torch DDP's? Repeated, on loopback.

    .venv/bin/python benchmarks/peak_rss.py --json results/peak_rss.json     # about 10 minutes on 2 cores

`commsched bench` measures each system's peak RSS once per cell, and one
measurement moves by tens of MiB between runs here. This repeats it: per model
and repeat, every system in turn (the order rotated each repeat) gets fresh
processes of its own (2 ranks, gloo on loopback), trains as the bench's peak
RSS measurement does (`commsched.bench.memory.peak_rss_on_rank`: warm-up, the
iteration that plans, one with forward overlap) and reports the max over ranks
of ``ru_maxrss``. Beside commsched's default, variants with one feature off
attribute the difference: forward overlap, fused updates, partitions (1 MiB
kept whatever the cost model's choice, or whole buckets). Reported per model:
each system's median over repeats, and its median difference from DDP's
defaults, paired per repeat.

As in ``commsched bench``, each rank first fixes glibc's mmap threshold
(`commsched.bench.memory.fix_mmap_threshold`, which says why): the peak is then
what was alive at once, within about a MiB between repeats.
``--malloc-defaults`` measures with glibc's defaults instead (tens of MiB of
noise here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from commsched.bench.compare import ComparisonConfig
from commsched.bench.grid import BATCH
from commsched.bench.memory import _load_lazy_modules, fix_mmap_threshold, peak_rss_on_rank
from commsched.bench.models import WORKLOADS
from commsched.bench.systems import UNSCHEDULED, Commsched, System, TorchDDP
from commsched.strategy import Strategy
from commsched.testing import run_ranks

DDP = TorchDDP()
SYSTEMS: tuple[System, ...] = (
    DDP,
    TorchDDP(static_graph=True, gradient_as_bucket_view=True),
    Commsched(UNSCHEDULED, "scheduling off"),
    Commsched(Strategy()),
    Commsched(Strategy(overlap_forward=False), "no forward overlap"),
    Commsched(Strategy(fuse_optimizer=False), "no fused updates"),
    Commsched(Strategy(adaptive=False), "1 MiB partitions, fixed"),
    Commsched(Strategy(partition_mb=None, credit_mb=None, adaptive=False), "whole buckets"),
)


def _peak_on_rank(rank: int, world_size: int, config: ComparisonConfig, system: System, malloc_defaults: bool) -> float:
    """Load what any system loads lazily first (as the bench's parent does), then measure."""
    if not malloc_defaults:
        fix_mmap_threshold()
    _load_lazy_modules()
    return peak_rss_on_rank(rank, world_size, config, system)


def measure(model: str, batch_size: int, repeats: int, malloc_defaults: bool) -> list[dict[str, float]]:
    """Per repeat, MiB by system name; each system in fresh processes, the order rotated per repeat."""
    config = ComparisonConfig(workload=model, batch_size=batch_size, show_progress=False)
    measured = []
    for repeat in range(repeats):
        order = SYSTEMS[repeat % len(SYSTEMS):] + SYSTEMS[:repeat % len(SYSTEMS)]
        measured.append({system.name: run_ranks(_peak_on_rank, 2, config, system, malloc_defaults, timeout_s=600)[0]
                         for system in order})
    return measured


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet-like", "transformer-like", "vgg-like"],
                        choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--malloc-defaults", action="store_true",
                        help="measure with glibc's malloc defaults (noisier), not a fixed mmap threshold")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(width=max(Console().width, 160))
    malloc = "glibc's malloc defaults" if args.malloc_defaults else "mmap threshold 128 KiB"
    table = Table(title=f"peak RSS, MiB, 2 ranks on loopback, {malloc}: median of {args.repeats} (median "
                        "difference from DDP's defaults, paired per repeat)")
    table.add_column("model")
    for system in SYSTEMS:
        table.add_column(system.name, justify="right")
    record: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    for model in args.models:
        batch_size = BATCH.get(model, 16)
        measured = measure(model, batch_size, args.repeats, args.malloc_defaults)
        record["runs"].append({"model": model, "batch_size": batch_size, "peak_rss_mib": measured})
        cells = []
        for system in SYSTEMS:
            median = statistics.median(r[system.name] for r in measured)
            excess = statistics.median(r[system.name] - r[DDP.name] for r in measured)
            cells.append(f"{median:.0f}" if system == DDP else f"{median:.0f} ({excess:+.0f})")
        table.add_row(f"{model} (batch {batch_size})", *cells)
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

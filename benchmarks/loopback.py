"""commsched against torch DDP on this machine's loopback.

    .venv/bin/python benchmarks/loopback.py --repeats 3 --json results/loopback.json

For each model, both systems train side by side in interleaved rounds (see
commsched.bench.compare); every repeat is a fresh group of processes. Reported: the
median iteration time of each system, and the ratio commsched/DDP per repeat
and its median (below 1.0 means commsched is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from commsched.bench.compare import ComparisonConfig, compare_on_rank
from commsched.bench.systems import Commsched, TorchDDP
from commsched.strategy import Strategy
from commsched.testing import run_ranks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet-like", "vgg-like"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--iterations", type=int, default=10, help="per system per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="fresh process groups per model")
    parser.add_argument("--json", type=Path, help="write every iteration time here")
    args = parser.parse_args(argv)

    console = Console(width=max(Console().width, 120))
    table = Table(title=f"loopback, {args.world_size} ranks, gloo, batch {args.batch_size} per rank")
    for column in ("model", "torch DDP median (ms)", "commsched median (ms)",
                   "commsched/DDP per repeat", "commsched/DDP median"):
        table.add_column(column, justify="left" if column == "model" else "right")
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    for model in args.models:
        ddp_system, ours_system = TorchDDP(), Commsched(Strategy())
        config = ComparisonConfig(
            workload=model, batch_size=args.batch_size, iterations=args.iterations,
            rounds=args.rounds, warmup=3, systems=(ddp_system, ours_system), show_progress=False,
        )
        ratios, ddp_medians, ours_medians = [], [], []
        for repeat in range(args.repeats):
            results = run_ranks(compare_on_rank, args.world_size, config, timeout_s=1800)[0]
            ddp, ours = results[ddp_system.name], results[ours_system.name]
            ddp_medians.append(ddp.median_s)
            ours_medians.append(ours.median_s)
            ratios.append(ours.median_s / ddp.median_s)
            record["runs"].append({"model": model, "repeat": repeat,
                                   "systems": {name: asdict(r) for name, r in results.items()}})
            console.print(f"{model} repeat {repeat}: DDP {ddp.median_s * 1e3:.1f} ms, "
                          f"commsched {ours.median_s * 1e3:.1f} ms, ratio {ratios[-1]:.3f}")
        table.add_row(
            model,
            f"{statistics.median(ddp_medians) * 1e3:.1f}",
            f"{statistics.median(ours_medians) * 1e3:.1f}",
            " ".join(f"{r:.3f}" for r in ratios),
            f"{statistics.median(ratios):.3f}",
        )
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``commsched`` command: argv in, actions out (the only place that reads argv)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from commsched import __version__
from commsched.strategy import ParameterServer, Strategy


def _demo(args: argparse.Namespace) -> int:
    from commsched.bench.compare import ComparisonConfig
    from commsched.bench.demo import render_report, run_demo
    from commsched.bench.systems import UNSCHEDULED, Commsched, TorchDDP

    unscheduled = replace(UNSCHEDULED, bucket_cap_mb=args.strategy.bucket_cap_mb)
    systems = [TorchDDP(), Commsched(unscheduled, "scheduling off"), Commsched(args.strategy)]
    if args.ps_servers:
        systems.append(Commsched(replace(args.strategy, backend=ParameterServer(num_servers=args.ps_servers))))
    config = ComparisonConfig(
        workload=args.workload,
        batch_size=args.batch_size,
        iterations=args.iterations,
        rounds=args.rounds,
        warmup=args.warmup,
        systems=tuple(systems),
        num_servers=args.ps_servers,
        show_progress=not args.no_progress,
    )
    results = run_demo(config, world_size=args.world_size + args.ps_servers)
    agree = render_report(results, config, args.world_size)
    return 0 if agree else 1


def _trace_report(args: argparse.Namespace) -> int:
    from commsched.bench.trace_report import report

    png = args.png if args.png is not None else args.directory / "gantt.png"
    try:
        print(report(args.directory, iteration=args.iteration, png=png))
    except FileNotFoundError as error:
        print(f"commsched trace-report: {error}", file=sys.stderr)
        return 2
    return 0


def _plan(args: argparse.Namespace) -> int:
    from commsched.bench.plan import PlanError, run

    try:
        return run(args)
    except PlanError as error:
        print("commsched plan: " + " ".join(str(error).split()), file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    from commsched.bench import grid
    from commsched.bench import plan as plan_module
    from commsched.bench.models import WORKLOADS

    parser = argparse.ArgumentParser(prog="commsched", description=__doc__)
    parser.add_argument("--version", action="version", version=f"commsched {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="train a small model with torch DDP and commsched side by side on loopback"
    )
    demo.add_argument("--world-size", type=int, default=2, help="local ranks to spawn (default 2)")
    demo.add_argument("--workload", choices=sorted(WORKLOADS), default="demo-mlp")
    demo.add_argument("--batch-size", type=int, default=64, help="per rank (default 64)")
    demo.add_argument("--iterations", type=int, default=40, help="per system per round (default 40)")
    demo.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    demo.add_argument("--warmup", type=int, default=3)
    demo.add_argument("--bucket-cap-mb", type=float, default=Strategy().bucket_cap_mb)
    demo.add_argument("--ps-servers", type=int, default=1,
                      help="extra ranks serving a parameter-server row (default 1; 0 leaves it out)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(action=_demo)

    trace = commands.add_parser(
        "trace-report",
        help="per iteration: time, communication exposed, overlap, backward time; the ranks' spread; a Gantt chart",
    )
    trace.add_argument("directory", type=Path, help="the Strategy(trace_dir=...) directory")
    trace.add_argument("--iteration", type=int, help="iteration to draw (default: the last full one)")
    trace.add_argument("--png", type=Path, help="where to draw it (default: DIRECTORY/gantt.png)")
    trace.set_defaults(action=_trace_report)

    bench = commands.add_parser(
        "bench", help="commsched vs torch DDP vs the bound on emulated hosts (needs root)",
        description=grid.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    grid.build_parser(bench)
    bench.set_defaults(action=grid.run_from_args)

    plan = commands.add_parser(
        "plan", help="simulate torch DDP, commsched and the best Strategy on clusters of any size, from a profile",
        description=plan_module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("model", nargs="?", metavar="MODEL",
                      help="a bench workload, a torchvision model name or package.module:factory "
                           "(optional with --profile)")
    plan.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    plan.add_argument("--input-shape", type=int, nargs="+", metavar="N",
                      help="one example's shape, for torchvision models (default 3 224 224) and import paths")
    plan.add_argument("--iterations", type=int, default=5, help="measured iterations (default 5)")
    plan.add_argument("--device", help="where to profile (default: cuda if available, else cpu)")
    plan.add_argument("--workers", type=int, nargs="+", default=list(plan_module.DEFAULT_WORKERS), metavar="N",
                      help="cluster sizes to simulate (default %(default)s)")
    plan.add_argument("--gbit", type=float, nargs="+", default=list(plan_module.DEFAULT_GBIT), metavar="RATE",
                      help="link rates in Gbit/s (default %(default)s)")
    plan.add_argument("--latency-us", type=float, default=25.0, help="per-hop latency (default 25)")
    plan.add_argument("--algorithm", choices=("ring", "tree"), default="ring", help="all-reduce (default ring)")
    plan.add_argument("--in-flight", type=int, metavar="N",
                      help="collectives the transport runs at once, taking turns step by step: 2 for "
                           "gloo, 1 for NCCL (default: the measured link's backend; 1 without a measured link)")
    plan.add_argument("--all-to-all", action="store_true",
                      help="the transport may all-reduce in two all-to-alls (gloo on host memory, 3 or more "
                           "workers): commsched's first bucket goes so where warm-up would send it so")
    plan.add_argument("--servers", type=int, default=0,
                      help="parameter servers besides the workers: their strategies are candidates too")
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--profile", type=Path, metavar="FILE", help="plan from this saved profile")
    source.add_argument("--save-profile", type=Path, metavar="FILE", help="save the measured profile here")
    plan.add_argument("--compute-scale", type=float, default=1.0, metavar="X",
                      help="multiply every compute time by X (0.02: a device 50x faster than the profiled one)")
    plan.add_argument("--plot", type=Path, metavar="PNG", help="draw the speedup over DDP against workers")
    plan.set_defaults(action=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("world_size", "batch_size", "iterations", "rounds", "repeats"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if getattr(args, "ps_servers", 0) < 0:
        parser.error("--ps-servers must be at least 0")
    if hasattr(args, "bucket_cap_mb"):
        try:
            args.strategy = Strategy(bucket_cap_mb=args.bucket_cap_mb)
        except ValueError as error:
            parser.error(str(error))
    return args.action(args)


if __name__ == "__main__":
    sys.exit(main())

"""Which commsched layout is fastest on emulated hosts, and does the default find it? Against torch DDP's sweep.

    sudo .venv/bin/python benchmarks/layouts.py --hosts 8 --repeats 3 --layout 5/1 1/1    # about 6 minutes on 2 cores

Per number of hosts, ``--repeats`` fresh `EmulatedCluster`s (the cell of
benchmarks/sharded.py: one torchrun process per host, every host's link shaped
to ``--rate-gbit``; the emulated ResNet-50 by default, SGD) train, in
interleaved rounds: torch DDP at each ``--ddp-bucket-mb``, commsched's default
`Strategy()` (its cost model's choice, checked on measured iterations against
the configured buckets sent whole), and commsched with each fixed layout of
``--layout``, with ``adaptive=False``:

- ``BUCKET/FIRST``: whole buckets of BUCKET MiB, the first (the input side's,
  which the next forward pass needs first) FIRST MiB;
- ``pPART/CREDIT``: partitions of PART MiB under a credit window of CREDIT MiB;
  ``pPART/CREDIT/BUCKET/FIRST`` also sets the buckets they cut (as
  ``commsched plan`` and the simulator's search spell a Strategy);
- ``default``: the default `Strategy()` again (to give it another all-reduce);
- any of them followed by ``,a2a=MB``: every partition up to MB MiB all-reduced
  in two all-to-alls (`commsched.AllReduce.all_to_all_mb`), or ``,ring``: none.

``--ring`` adds, for the default and each layout, the same with gloo's ring for
every partition (``AllReduce(all_to_all_mb=None)``).

The machine's cores are sampled over each cluster (`commsched.bench.cpu_guard`):
a cluster whose median busy share is at or above its threshold measured the
cores rather than the links, and is marked. Printed per cluster: each system's
median iteration, its speed against the best DDP (the best DDP's time over its
own), commsched's exposed wait per iteration, and what the default kept; then,
per system, the median over clusters of that speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import sharded  # noqa: E402 - the cell of benchmarks/sharded.py, beside this script

from commsched.bench import runner  # noqa: E402
from commsched.bench.models import WORKLOADS  # noqa: E402
from commsched.bench.repeats import Repeat, median_and_each  # noqa: E402
from commsched.bench.systems import Commsched, System  # noqa: E402
from commsched.strategy import AllReduce, Strategy  # noqa: E402

WORKLOAD = "resnet50-emulated"


def layout_system(text: str) -> Commsched:
    """``BUCKET/FIRST``, ``pPART/CREDIT`` or ``pPART/CREDIT/BUCKET/FIRST`` (MiB) as a fixed-layout
    commsched system, or ``default`` (the default `Strategy()`); any of them followed by
    ``,a2a=MB`` (every partition up to MB MiB all-reduced in two steps) or ``,ring`` (none)."""
    layout, _, way = text.partition(",")
    partitions = layout.startswith("p")
    try:
        backend = _all_reduce_way(way)
        if layout == "default":
            strategy, label = Strategy(backend=backend), "default"
        else:
            strategy, label = _fixed_layout(layout, partitions, backend)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"--layout {text!r}: give BUCKET/FIRST (whole buckets, MiB: 5/1), pPART/CREDIT (partitions and "
            f"credit window, MiB: p1/4), pPART/CREDIT/BUCKET/FIRST (p2/2/5/1) or default, optionally followed "
            f"by ,a2a=MB or ,ring (5/1,a2a=1.2); {error}") from None
    return Commsched(strategy, f"{label}, {way}" if way else label)


def _all_reduce_way(way: str) -> AllReduce:
    if not way:
        return AllReduce()
    if way == "ring":
        return AllReduce(all_to_all_mb=None)
    if way.startswith("a2a="):
        return AllReduce(all_to_all_mb=float(way.removeprefix("a2a=")))
    raise ValueError(f"unknown way {way!r}")


def _fixed_layout(layout: str, partitions: bool, backend: AllReduce) -> tuple[Strategy, str]:
    sizes = [float(part) for part in layout.removeprefix("p").split("/")]
    if len(sizes) not in ((2, 4) if partitions else (2,)):
        raise ValueError(f"{len(sizes)} sizes")
    first, second = sizes[:2]
    if partitions:
        buckets = {} if len(sizes) == 2 else {"bucket_cap_mb": sizes[2], "first_bucket_mb": sizes[3]}
        strategy = Strategy(partition_mb=first, credit_mb=second, adaptive=False, backend=backend, **buckets)
    else:
        strategy = Strategy(partition_mb=None, credit_mb=None, bucket_cap_mb=first, first_bucket_mb=second,
                            adaptive=False, backend=backend)
    return strategy, ("partitions " if partitions else "whole ") + layout.removeprefix("p")


def ring_only(system: Commsched) -> Commsched:
    """``system`` with every partition all-reduced by gloo's ring (no two-step all-reduce)."""
    backend = dataclasses.replace(system.strategy.backend, all_to_all_mb=None)
    label = f"{system.label}, ring" if system.label else "ring"
    return Commsched(dataclasses.replace(system.strategy, backend=backend), label)


def report(runs: list[dict], cpu: list[dict | None], ddp_names: list[str]) -> list[str]:
    """Lines per cluster, then the median speed against the best DDP per system (``cpu``: each
    cluster's `commsched.bench.cpu_guard.CpuUse` as data, or None)."""
    lines, speeds = [], {}
    for index, (run, use) in enumerate(zip(runs, cpu, strict=True)):
        medians = Repeat.of({name: r["iteration_times_s"] for name, r in run.items()})
        best_ddp = medians.medians_s[medians.fastest(ddp_names)] * 1e3
        marked = " (cores set the pace)" if use is not None and use["cores_set_the_pace"] else ""
        busy = "" if use is None else f", cores busy {use['median']:.2f} at the median{marked}"
        lines.append(f"cluster {index + 1}{busy}:")
        for name, seconds in medians.medians_s.items():
            ms = seconds * 1e3
            speeds.setdefault(name, []).append(best_ddp / ms)
            waits = run[name].get("exposed_wait_s") or []
            wait = f", waits {statistics.median(waits) * 1e3:.1f} ms" if waits else ""
            lines.append(f"  {name:36s} {ms:7.1f} ms  {best_ddp / ms:.3f} x best DDP{wait}")
            if run[name].get("transport"):
                lines.append(f"    {run[name]['transport']}")
        kept = run.get(sharded.ALLREDUCE.name, {}).get("partitioning")
        if kept:
            lines.append(f"  the default: {kept}")
    lines.append("median over clusters, speed against the best DDP:")
    lines += [f"  {name:36s} {median_and_each(values, sep=', ')}" for name, values in speeds.items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = runner.make_parser(__doc__)
    runner.add_hosts(parser, default=[8])
    runner.add_rate_gbit(parser, default=1.0)
    parser.add_argument("--workload", default=WORKLOAD, choices=sorted(WORKLOADS))
    parser.add_argument("--optimizer", default="sgd", choices=sorted(sharded.LEARNING_RATE))
    parser.add_argument("--batch-size", type=int, default=8, help="per host")
    parser.add_argument("--layout", nargs="*", type=layout_system, default=[], metavar="LAYOUT",
                        help="fixed commsched layouts to add: BUCKET/FIRST or pPART/CREDIT, in MiB")
    parser.add_argument("--ring", action="store_true",
                        help="also run every commsched system with gloo's ring for every partition "
                             "(AllReduce(all_to_all_mb=None)), beside the default's measured two-step limit")
    parser.add_argument("--ddp-bucket-mb", nargs="+", type=float, default=[5.0],
                        help="torch DDP's bucket_cap_mb values; best DDP is the fastest")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument("--iterations", type=int, default=3, help="measured, per system per round")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured iterations per system")
    runner.add_repeats(parser, default=3, help="fresh clusters per number of hosts")
    runner.add_timeout(parser, default=1200.0, help="per cluster")
    runner.add_json(parser)
    args = parser.parse_args(argv)
    runner.refuse_below_one(parser, args, "repeats", "rounds", "iterations")
    problem = runner.cluster_problem("layouts")
    if problem:
        return problem
    ddp = sharded.ddp_sweep(args.ddp_bucket_mb)
    systems: tuple[System, ...] = (*ddp, sharded.ALLREDUCE, *args.layout)
    if args.ring:
        systems += tuple(ring_only(system) for system in (sharded.ALLREDUCE, *args.layout))
    cells: list[dict] = []
    for hosts in args.hosts:
        outputs = [sharded.run_cell(hosts, args.rate_gbit, args.optimizer, args, systems=systems, sample_cpu=True)
                   for _ in range(args.repeats)]
        runs, cpu = [output["systems"] for output in outputs], [output["cpu"] for output in outputs]
        print(f"{args.workload}, {args.optimizer}, {hosts} hosts at {args.rate_gbit:g} Gbit/s")
        print("\n".join(report(runs, cpu, [system.name for system in ddp])), flush=True)
        cells.append({"hosts": hosts, "runs": runs, "cpu": cpu})
        runner.write_json(args.json, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""commsched against torch DDP on emulated hosts with shaped links (needs root).

    .venv/bin/python benchmarks/cluster_compare.py --model vgg-like --rate-mbit 250 --batch-size 64

Each host is a network namespace with one process (one compute thread), its
link shaped with tc (see commsched.cluster). The systems train side by side in
interleaved rounds (commsched.compare); every repeat builds a fresh cluster.
Reported per system: mean iteration time (the inverse of throughput) and
median, and the speedup over torch DDP (DDP time / system time) per repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from commsched.compare import ALLREDUCE_ONLY, COMMSCHED, DDP, LOCAL, UNSCHEDULED, ComparisonConfig
from commsched.strategy import Strategy

COMPUTE_ONLY = "compute only (bound)"
SYSTEMS = {
    COMPUTE_ONLY: LOCAL,
    DDP: None,
    "commsched, scheduling off": UNSCHEDULED,
    COMMSCHED: Strategy(),
}


def worker(config_path: Path, out_path: Path) -> None:
    import torch
    import torch.distributed as dist

    from commsched.compare import compare_on_rank

    torch.set_num_threads(1)
    spec = json.loads(config_path.read_text())
    systems = tuple((name, s if s is None or s == LOCAL else Strategy(**s)) for name, s in spec.pop("systems"))
    config = ComparisonConfig(**spec, systems=systems, show_progress=False, measure_allreduce=True)
    dist.init_process_group("gloo")
    results = compare_on_rank(dist.get_rank(), dist.get_world_size(), config)
    if dist.get_rank() == 0:
        out_path.write_text(json.dumps({name: asdict(r) for name, r in results.items()}))
    dist.destroy_process_group()


def run_once(args: argparse.Namespace, systems: dict[str, Strategy | None]) -> dict:
    from commsched.cluster import EmulatedCluster, LinkSpec

    spec = {
        "workload": args.model, "batch_size": args.batch_size, "iterations": args.iterations,
        "rounds": args.rounds, "warmup": args.warmup,
        "systems": [(name, asdict(s) if isinstance(s, Strategy) else s) for name, s in systems.items()],
    }
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(args.hosts, LinkSpec(rate_mbit=args.rate_mbit)) as cluster:
        config_path, out_path = Path(tmp) / "config.json", Path(tmp) / "out.json"
        config_path.write_text(json.dumps(spec))
        argv = [sys.executable, os.path.abspath(__file__), "--worker", str(config_path), str(out_path)]
        procs = [cluster.popen(h, argv, {**cluster.torch_env(h), "OMP_NUM_THREADS": "1"})
                 for h in range(args.hosts)]
        try:
            for proc in procs:
                if proc.wait(timeout=args.timeout_s) != 0:
                    raise RuntimeError(f"a worker exited with {proc.returncode}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        return json.loads(out_path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="vgg-like")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=250.0)
    parser.add_argument("--batch-size", type=int, default=64, help="per host")
    parser.add_argument("--iterations", type=int, default=8, help="per system per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=6,
                        help="unmeasured iterations per system (commsched plans its order at the 6th)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=1500)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help='an extra commsched system, e.g. \'p1c2={"partition_mb": 1, "credit_mb": 2}\'')
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    systems = dict(SYSTEMS)
    for variant in args.variant:
        name, _, kwargs = variant.partition("=")
        systems[name] = Strategy(**json.loads(kwargs))

    runs = []
    for repeat in range(args.repeats):
        results = run_once(args, systems)
        runs.append(results)
        ddp_mean = statistics.fmean(results[DDP]["iteration_times_s"])
        line = [f"repeat {repeat}:"]
        for name, r in results.items():
            mean = statistics.fmean(r["iteration_times_s"])
            line.append(f"{name} {mean * 1e3:.0f} ms (x{ddp_mean / mean:.2f})")
        print("  ".join(line), flush=True)

    print(f"\n{args.model}, {args.hosts} hosts at {args.rate_mbit:g} Mbit/s, batch {args.batch_size} per host, "
          f"{args.repeats} repeats x {args.rounds} rounds x {args.iterations} iterations")
    bounds = [max(statistics.fmean(r[COMPUTE_ONLY]["iteration_times_s"]),
                  statistics.median(r[ALLREDUCE_ONLY]["iteration_times_s"])) for r in runs]
    allreduce = statistics.median(statistics.median(r[ALLREDUCE_ONLY]["iteration_times_s"]) for r in runs)
    print(f"one all-reduce of all gradients: {allreduce * 1e3:.0f} ms; bound max(compute, all-reduce): "
          f"{statistics.median(bounds) * 1e3:.0f} ms")
    print(f"{'system':28} {'mean ms':>9} {'median ms':>10} {'speedup over DDP (per repeat)':>32} "
          f"{'median':>7} {'time/bound':>11}")
    for name in systems:
        means = [statistics.fmean(r[name]["iteration_times_s"]) for r in runs]
        medians = [statistics.median(r[name]["iteration_times_s"]) for r in runs]
        speedups = [statistics.fmean(r[DDP]["iteration_times_s"]) / m for r, m in zip(runs, means)]
        over_bound = statistics.median(m / b for m, b in zip(means, bounds))
        print(f"{name:28} {statistics.median(means) * 1e3:9.0f} {statistics.median(medians) * 1e3:10.0f} "
              f"{' '.join(f'{x:.3f}' for x in speedups):>32} {statistics.median(speedups):7.3f} {over_bound:11.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

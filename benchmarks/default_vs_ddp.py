"""Is commsched's default ever slower than torch DDP at its best bucket size? The simulator, 2-1024 workers.

    .venv/bin/python benchmarks/default_vs_ddp.py
    .venv/bin/python benchmarks/default_vs_ddp.py --workers 8 64 --gbit 10 --algorithm tree --json results/x.json
    .venv/bin/python benchmarks/default_vs_ddp.py --emulated    # the bench's emulated hosts, 2-16 of them

For each profile (the committed VGG16 and ResNet-50 ones, their compute scaled to
an accelerator's, and GPT-2 small from its FLOPs; `commsched.bench.emulated`),
number of workers, link rate and per-hop latency (with ``--emulated``: the bench's
emulated workloads as they run, at 2-16 hosts, 0.25-1 Gbit/s, 0.1 and 1 ms per
hop, what the emulated links' all-reduces measure, two collectives in flight as
gloo runs them), the simulator times torch DDP
at each bucket size of `DDP_BUCKETS_MB` and commsched's default `Strategy()` as
a run adopts it (`commsched.simulator.adoption.as_run`: the cost model's choice,
kept only if the simulator finds it faster than whole buckets, as a run measures).
Printed: per profile, the worst ratio of commsched's time to the best DDP's over
every cell, and the cells where it is above 1; with ``--json``, every cell.
"""

from __future__ import annotations

import itertools

from commsched.bench import runner
from commsched.bench.emulated import EMULATED_WORKLOADS, load_profile
from commsched.profiling.model import scaled_compute
from commsched.profiling.profile import Profile
from commsched.simulator import Cluster, DDPConfig, bound_s, simulate
from commsched.simulator.adoption import as_run
from commsched.strategy import Strategy

DDP_BUCKETS_MB = (None, 1.0, 5.0, 25.0, 100.0)
"""torch DDP's default (25 MiB, the first 1 MiB) and each explicit ``bucket_cap_mb``."""

PROFILES = {"vgg16": 0.0810, "resnet50": 0.1607, "gpt2-small": 1.0}
"""Profile and compute scale: the CPU profiles scaled as in docs/simulator.md (to one GPU's time at batch 4
per worker, by published throughput); GPT-2 small is already an accelerator's."""


ACCELERATOR_DEFAULTS = {"profiles": list(PROFILES), "workers": [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
                        "gbit": [1.0, 10.0, 25.0, 100.0], "latency_us": [5.0, 25.0], "in_flight": 1,
                        "all_to_all": "off"}
EMULATED_DEFAULTS = {"profiles": list(EMULATED_WORKLOADS), "workers": [2, 4, 8, 16], "gbit": [0.25, 0.5, 1.0],
                     "latency_us": [100.0, 1000.0], "in_flight": 2, "all_to_all": "on"}
"""The emulated hosts: their links' rates, per hop of the ring the fixed cost their all-reduces
measure (about 1 ms at 16 hosts on 2 cores; less where the cores are idle), gloo's two
collectives in flight, and its all-to-alls for the first bucket."""


def profile_named(name: str) -> Profile:
    if name in EMULATED_WORKLOADS:
        return EMULATED_WORKLOADS[name].as_emulated()
    return scaled_compute(load_profile(name), PROFILES[name]) if PROFILES[name] != 1 else load_profile(name)


def cells(workers: list[int], gbits: list[float], latencies_us: list[float], algorithm: str):
    return itertools.product(workers, gbits, latencies_us, [algorithm])


def main(argv: list[str] | None = None) -> None:
    parser = runner.make_parser(__doc__)
    parser.add_argument("--profiles", nargs="+", choices=[*PROFILES, *EMULATED_WORKLOADS],
                        help="default: the accelerator profiles, or with --emulated the emulated workloads")
    parser.add_argument("--emulated", action="store_true",
                        help="the bench's emulated workloads and hosts: defaults for every option below")
    parser.add_argument("--workers", type=int, nargs="+")
    parser.add_argument("--gbit", type=float, nargs="+")
    parser.add_argument("--latency-us", type=float, nargs="+")
    parser.add_argument("--algorithm", choices=("ring", "tree"), default="ring")
    parser.add_argument("--in-flight", type=int,
                        help="collectives the link runs at once (default 1, NCCL; with --emulated 2, gloo)")
    parser.add_argument("--all-to-all", choices=("on", "off"),
                        help="the first bucket may go in two all-to-alls (default off; with --emulated on, gloo)")
    runner.add_json(parser, help="write every cell here")
    args = parser.parse_args(argv)
    defaults = EMULATED_DEFAULTS if args.emulated else ACCELERATOR_DEFAULTS
    for option, value in defaults.items():
        if getattr(args, option) is None:
            setattr(args, option, value)
    rows = []
    for name in args.profiles:
        profile = profile_named(name)
        worst = None
        for workers, gbit, latency_us, algorithm in cells(args.workers, args.gbit, args.latency_us, args.algorithm):
            cluster = Cluster(workers, gbit, latency_s=latency_us * 1e-6, algorithm=algorithm, in_flight=args.in_flight,
                              all_to_all=args.all_to_all == "on")
            ddp = {mb: simulate(profile, cluster, DDPConfig.like_torch(mb)).iteration_s for mb in DDP_BUCKETS_MB}
            best_mb = min(ddp, key=ddp.get)
            adopted = as_run(Strategy(), profile, cluster)
            ours = simulate(profile, cluster, adopted).iteration_s
            row = {"profile": name, "workers": workers, "gbit": gbit, "latency_us": latency_us,
                   "algorithm": algorithm, "commsched_ms": ours * 1e3, "best_ddp_ms": ddp[best_mb] * 1e3,
                   "best_ddp_bucket_mb": best_mb, "ddp_default_ms": ddp[None] * 1e3,
                   "bound_ms": bound_s(profile, cluster) * 1e3, "ratio": ours / ddp[best_mb],
                   "partition_mb": adopted.partition_mb, "credit_mb": adopted.credit_mb,
                   "bucket_cap_mb": adopted.bucket_cap_mb}
            rows.append(row)
            if worst is None or row["ratio"] > worst["ratio"]:
                worst = row
        slower = [r for r in rows if r["profile"] == name and r["ratio"] > 1.0 + 1e-9]
        cells_of = sum(r["profile"] == name for r in rows)
        print(f"{name}: {cells_of} cells; commsched / best DDP: worst {worst['ratio']:.3f} "
              f"({worst['workers']} workers, {worst['gbit']:g} Gbit/s, {worst['latency_us']:g} us); "
              f"slower than the best DDP in {len(slower)} cells; median "
              f"{sorted(r['ratio'] for r in rows if r['profile'] == name)[cells_of // 2]:.3f}")
        for r in slower:
            partitions = (f"whole buckets of {r['bucket_cap_mb']:g} MiB" if r["partition_mb"] is None
                          else f"{r['partition_mb']:g} MiB partitions")
            print(f"  {r['workers']:5d} workers {r['gbit']:6g} Gbit/s {r['latency_us']:4g} us: "
                  f"{r['commsched_ms']:.2f} ms ({partitions}) vs DDP {r['best_ddp_ms']:.2f} ms "
                  f"(bucket {r['best_ddp_bucket_mb'] or 'default'}): {r['ratio']:.3f}")
    runner.write_json(args.json, rows)


if __name__ == "__main__":
    main()

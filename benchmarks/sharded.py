"""What does sharding the optimizer state (ZeRO-1) save in memory, and cost in time? On emulated hosts (root).

    sudo .venv/bin/python benchmarks/sharded.py --json results/sharded.json    # about 10 minutes on 2 cores

``AllReduce(shard_optimizer=True)`` keeps 1/N of the optimizer state per rank
and all-gathers the updated parameters besides the all-reduce of gradients
(`commsched.update.sharded`). Per optimizer (SGD with momentum 0.9, lr 0.005;
Adam, lr 1e-3) and number of hosts, a fresh `EmulatedCluster` (the one
``commsched bench`` uses, one torchrun process per host, gloo on the host's
``eth0``) trains the 22M-parameter MLP (``mlp-22m``: at a small batch its
optimizer step is as long as its forward and backward passes) with: torch DDP
at ``bucket_cap_mb`` 5 and 25 (its default; ``--ddp-bucket-mb`` sets the sweep),
commsched's default ``AllReduce()``, commsched with sharded optimizer state, and
torch FSDP2 (``fully_shard`` per layer, ``reshard_after_forward=False``).
``--fixed-layout`` adds the sharded system with ``Strategy(adaptive=False)``,
whose buckets are never laid out anew; ``--reduce-scatter`` adds it with
``AllReduce(shard_optimizer=True, reduce_scatter=True)`` (ZeRO-2: gradients
reduce-scattered, on gloo by an all-to-all); ``--no-fsdp2`` leaves FSDP2 out.

As ``commsched bench`` does (`commsched.bench.grid`): first each system's peak
RSS, in a child forked per system that trains it alone for a few iterations
(`commsched.bench.memory`; the max over ranks), then every system side by side
in interleaved rounds (`commsched.bench.compare`: the order alternates each
round). Reported per cell: the median iteration time (rank 0, over every
measured iteration of every round; with ``--repeats``, the median over fresh
clusters of those), its ratio to commsched's ``AllReduce()``, the peak RSS, the
optimizer state rank 0 holds (``commsched.status(model).sharding.state_bytes``
when sharded, else the tensors in ``optimizer.state``, FSDP2's local shards),
commsched's time in updates per iteration, and the final training loss. *best
DDP* is the fastest of the DDP bucket sizes. Then the targets:

- state: sharded state per rank <= the unsharded (``AllReduce()``'s) / N plus
  one bucket's worth (the largest bucket: chunks are rounded up);
- memory: best DDP's peak RSS minus the sharded one's >= 60% of the state saved
  (best DDP's state minus the sharded one's); the same against ``AllReduce()``;
- time: sharded / ``AllReduce()`` <= 1.03, and sharded / FSDP2.

On the emulated workloads, whose computation is known, each system also gets its bound
(`commsched.simulator.bound_s`; for the sharded systems and FSDP2 `sharded_bound_s`, [Note: the
bound of sharded state]: the parameters' all-gather cannot start before the backward pass ends)
and its time over it: where the sharded bound is above ``AllReduce()``'s, no schedule meets the
1.03 target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from commsched.bench import runner
from commsched.bench.models import WORKLOADS
from commsched.bench.systems import Commsched, System, TorchDDP, TorchFSDP2, decode, encode
from commsched.strategy import AllReduce, Strategy

DDP_DEFAULT_BUCKET_MB = 25.0
"""torch DDP's own ``bucket_cap_mb`` default."""
ALLREDUCE = Commsched(Strategy())
SHARDED = Commsched(Strategy(backend=AllReduce(shard_optimizer=True)), "sharded optimizer")
FIXED = Commsched(Strategy(backend=AllReduce(shard_optimizer=True), adaptive=False), "sharded, fixed layout")
"""Sharded, without the cost model's choice of partitions at the end of warm-up: its buckets keep
their first layout, which tells what a new layout costs in memory (where the buckets change, the
whole state is gathered on every rank for a moment and cut anew)."""
SCATTERED = Commsched(Strategy(backend=AllReduce(shard_optimizer=True, reduce_scatter=True)),
                      "sharded, reduce-scatter")
FSDP2 = TorchFSDP2()
LEARNING_RATE = {"sgd": 0.005, "adam": 1e-3}
"""The bench's SGD learning rate, 0.05, diverges on this model."""
WORKLOAD = "mlp-22m"
"""The default model; ``--workload`` takes any of `commsched.bench.models`'s, such as the emulated
accelerator workloads, whose computation (charged as sleep) is long enough to hide the all-gather."""
MIB = 2**20


# ------------------------------------------------------------------ one cell
def worker(config_path: Path, out_path: Path) -> None:
    """One host under torchrun: every system's peak RSS, then the comparison; rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    from commsched.bench.compare import ComparisonConfig, compare_on_rank
    from commsched.bench.memory import peak_rss_in_children

    torch.set_num_threads(1)
    spec = json.loads(config_path.read_text())
    config = ComparisonConfig(**{**spec, "systems": tuple(decode(s) for s in spec["systems"])}, show_progress=False)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    started = time.monotonic()
    # First: the children are forked from a process that holds nothing yet.
    peaks = peak_rss_in_children(config, rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    measured_memory = time.monotonic()
    import torch._dynamo  # noqa: F401 - before the group, as commsched.bench.grid's worker
    dist.init_process_group("gloo")
    results = compare_on_rank(rank, world_size, config)
    if rank == 0:
        phases_s = {"peak_rss": measured_memory - started, "comparison": time.monotonic() - measured_memory}
        out_path.write_text(json.dumps({"phases_s": phases_s, "systems": {
            name: {**asdict(result), "peak_rss_mib": peaks[name]} for name, result in results.items()}}))
    dist.destroy_process_group()


def ddp_sweep(bucket_mb: list[float]) -> tuple[TorchDDP, ...]:
    """torch DDP at each bucket size (its default spelled as itself): best DDP is the fastest of them."""
    return tuple(TorchDDP() if mb == DDP_DEFAULT_BUCKET_MB else TorchDDP(mb) for mb in bucket_mb)


def lineup(bucket_mb: list[float], fixed_layout: bool, reduce_scatter: bool = False,
           fsdp2: bool = True) -> tuple[System, ...]:
    """The systems of every cell; ``fixed_layout`` adds `FIXED`, ``reduce_scatter`` `SCATTERED`."""
    return (*ddp_sweep(bucket_mb), ALLREDUCE, SHARDED, *((FIXED,) if fixed_layout else ()),
            *((SCATTERED,) if reduce_scatter else ()), *((FSDP2,) if fsdp2 else ()))


def run_cell(hosts: int, rate_gbit: float, optimizer: str, args: argparse.Namespace, port: int = 29541,
             systems: tuple[System, ...] | None = None, sample_cpu: bool = False) -> dict:
    """One fresh cluster: ``{"systems": {name: result as data}, "phases_s": seconds of the peak RSS phase
    and of the comparison}``, and with ``sample_cpu`` how busy the cores were (``"cpu"``). ``systems``:
    this script's `lineup` unless given (benchmarks/layouts.py)."""
    systems = systems or lineup(args.ddp_bucket_mb, args.fixed_layout, args.reduce_scatter, not args.no_fsdp2)
    spec = {"workload": args.workload, "batch_size": args.batch_size, "iterations": args.iterations,
            "rounds": args.rounds, "warmup": args.warmup, "learning_rate": LEARNING_RATE[optimizer],
            "optimizer": optimizer, "systems": [encode(system) for system in systems]}
    return runner.on_emulated_hosts(__file__, hosts, rate_gbit, spec, args.timeout_s,
                                    f"{optimizer} on {hosts} hosts", torchrun=True, port=port, sample_cpu=sample_cpu)


# ------------------------------------------------------------------ report
def bounds(workload: str, hosts: int, rate_gbit: float, names: list[str]) -> dict[str, float]:
    """Each system's bound in seconds (see the module's docstring); empty where the workload's
    computation is not known beforehand (the real-compute models)."""
    from commsched.bench.emulated import EMULATED_WORKLOADS
    from commsched.simulator import Cluster, bound_s, sharded_bound_s

    if workload not in EMULATED_WORKLOADS:
        return {}
    profile, cluster = EMULATED_WORKLOADS[workload].as_emulated(), Cluster(hosts, rate_gbit)
    sharded = {SHARDED.name: False, FIXED.name: False, SCATTERED.name: True, FSDP2.name: True}
    return {name: sharded_bound_s(profile, cluster, sharded[name]) if name in sharded else bound_s(profile, cluster)
            for name in names}


def _median(runs: list[dict], name: str, value) -> float:
    return statistics.median(value(run[name]) for run in runs)


def summarize(hosts: int, optimizer: str, runs: list[dict], ddp_names: list[str],
              bounds_s: dict[str, float] | None = None) -> dict:
    """Medians over repeats by system, and the targets' figures (best DDP: the fastest of ``ddp_names``;
    ``bounds_s``: each system's bound, where known)."""
    systems = {}
    for name in runs[0]:
        update_s = [r[name]["update_s"] for r in runs if r[name]["update_s"]]
        bound = (bounds_s or {}).get(name)
        systems[name] = {
            "ms": _median(runs, name, lambda r: statistics.median(r["iteration_times_s"])) * 1e3,
            "bound_ms": None if bound is None else bound * 1e3,
            "peak_rss_mib": _median(runs, name, lambda r: r["peak_rss_mib"]),
            "state_mib": _median(runs, name, lambda r: r["optimizer_state_bytes"]) / MIB,
            "update_ms": statistics.median(statistics.median(u) for u in update_s) * 1e3 if update_s else None,
            "final_loss": _median(runs, name, lambda r: r["final_loss"]),
        }
    best_ddp = min(ddp_names, key=lambda name: systems[name]["ms"])
    full, fsdp2, ddp = (systems.get(s) for s in (ALLREDUCE.name, FSDP2.name, best_ddp))
    targets = {}
    for name in (SHARDED.name, FIXED.name, SCATTERED.name):
        if name not in systems:
            continue
        ours, sharding = systems[name], runs[0][name]["sharding"]
        state_per_element = full["state_mib"] / sharding["total_elements"]
        targets[name] = {
            "state_bound_mib": full["state_mib"] / hosts + max(sharding["chunk_elements"]) * hosts * state_per_element,
            "rss_saved_over_state_saved_vs_best_ddp": _share(ddp, ours),
            "rss_saved_over_state_saved_vs_allreduce": _share(full, ours),
            "time_vs_allreduce": ours["ms"] / full["ms"],
            "time_vs_fsdp2": ours["ms"] / fsdp2["ms"] if fsdp2 else float("nan"),
            "time_vs_best_ddp": ours["ms"] / ddp["ms"],
        }
    return {"hosts": hosts, "optimizer": optimizer, "best_ddp": best_ddp, "systems": systems, "targets": targets}


def _share(other: dict, sharded: dict) -> float:
    """How much of the optimizer state sharding saves against ``other`` comes off the peak RSS."""
    saved = other["state_mib"] - sharded["state_mib"]
    return (other["peak_rss_mib"] - sharded["peak_rss_mib"]) / saved if saved > 0 else float("nan")


def markdown(cell: dict, rate_gbit: float) -> str:
    lines = [f"{cell['optimizer']}, {cell['hosts']} hosts, {rate_gbit:g} Gbit/s (best DDP: {cell['best_ddp']})",
             "", "| system | ms | / AllReduce() | bound ms | / bound | peak RSS MiB | state MiB per rank | update ms "
             "| final loss |", "|---|---|---|---|---|---|---|---|---|"]
    full = cell["systems"][ALLREDUCE.name]
    for name, s in cell["systems"].items():
        update = "-" if s["update_ms"] is None else f"{s['update_ms']:.1f}"
        bound = "- | -" if s.get("bound_ms") is None else f"{s['bound_ms']:.1f} | {s['ms'] / s['bound_ms']:.3f}"
        lines.append(f"| {name} | {s['ms']:.1f} | {s['ms'] / full['ms']:.3f} | {bound} | {s['peak_rss_mib']:.0f} "
                     f"| {s['state_mib']:.1f} | {update} | {s['final_loss']:.4f} |")
    for name, t in cell["targets"].items():
        ours = cell["systems"][name]
        lines += ["", f"{name}:",
                  f"- state per rank {ours['state_mib']:.1f} MiB, bound (unsharded / N + one bucket) "
                  f"{t['state_bound_mib']:.1f}: {_verdict(ours['state_mib'] <= t['state_bound_mib'])}",
                  f"- peak RSS saved / state saved: {t['rss_saved_over_state_saved_vs_best_ddp']:.2f} against best DDP "
                  f"(target >= 0.60: {_verdict(t['rss_saved_over_state_saved_vs_best_ddp'] >= 0.6)}), "
                  f"{t['rss_saved_over_state_saved_vs_allreduce']:.2f} against AllReduce()",
                  f"- time / AllReduce() {t['time_vs_allreduce']:.3f} (target <= 1.03: "
                  f"{_verdict(t['time_vs_allreduce'] <= 1.03)}), / FSDP2 {t['time_vs_fsdp2']:.3f}, "
                  f"/ best DDP {t['time_vs_best_ddp']:.3f}"]
        if ours.get("bound_ms") is not None and full.get("bound_ms") is not None:
            lines.append(f"- its bound {ours['bound_ms']:.1f} ms is {ours['bound_ms'] / full['bound_ms']:.3f} times "
                         f"AllReduce()'s ({full['bound_ms']:.1f} ms; see [Note: the bound of sharded state])")
    return "\n".join(lines) + "\n"


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def main(argv: list[str] | None = None) -> int:
    parser = runner.make_parser(__doc__)
    parser.add_argument("--worker", nargs=2, type=Path, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adam"], choices=sorted(LEARNING_RATE))
    runner.add_hosts(parser, default=[2, 4])
    runner.add_rate_gbit(parser, default=1.0)
    parser.add_argument("--workload", default=WORKLOAD, choices=sorted(WORKLOADS),
                        help="the model (default: the 22M-parameter MLP, whose forward pass hides little)")
    parser.add_argument("--batch-size", type=int, default=8, help="per host")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--iterations", type=int, default=2, help="measured, per system per round")
    parser.add_argument("--warmup", type=int, default=3,
                        help="unmeasured iterations per system (commsched plans at the 4th, the first round's "
                             "unmeasured lead-in)")
    parser.add_argument("--ddp-bucket-mb", nargs="+", type=float, default=[5.0, DDP_DEFAULT_BUCKET_MB],
                        help="torch DDP's bucket_cap_mb values; best DDP is the fastest (100, one bucket for this "
                             "model, was the slowest in every cell: left out to save time)")
    parser.add_argument("--fixed-layout", action="store_true",
                        help="also train the sharded system with Strategy(adaptive=False): its buckets are never "
                             "laid out anew, which tells the new layout's peak from the steady state's")
    parser.add_argument("--reduce-scatter", action="store_true",
                        help="also train AllReduce(shard_optimizer=True, reduce_scatter=True) (ZeRO-2)")
    parser.add_argument("--no-fsdp2", action="store_true", help="leave torch FSDP2 out (the slowest system)")
    runner.add_repeats(parser, default=1, help="fresh clusters per cell")
    runner.add_timeout(parser, default=1200.0, help="per cluster")
    runner.add_json(parser, help="write every run and the summaries here")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    runner.refuse_below_one(parser, args, "repeats", "rounds", "iterations")
    problem = runner.cluster_problem("sharded")
    if problem:
        return problem
    cells: list[dict] = []
    report = []
    for optimizer in args.optimizers:
        for hosts in args.hosts:
            started = time.monotonic()
            outputs = [run_cell(hosts, args.rate_gbit, optimizer, args) for _ in range(args.repeats)]
            runs = [output["systems"] for output in outputs]
            cell = summarize(hosts, optimizer, runs, [ddp.name for ddp in ddp_sweep(args.ddp_bucket_mb)],
                             bounds(args.workload, hosts, args.rate_gbit, list(runs[0])))
            cells.append({**cell, "runs": runs, "phases_s": [output["phases_s"] for output in outputs]})
            report.append(markdown(cell, args.rate_gbit))
            phases = ", ".join(f"{phase} {seconds:.0f} s" for phase, seconds in outputs[0]["phases_s"].items())
            print(f"{optimizer}, {hosts} hosts: {time.monotonic() - started:.0f} s ({phases})", file=sys.stderr,
                  flush=True)
            runner.write_json(args.json, cells)
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How close the simulator comes to measured iteration times on the emulated cluster.

    sudo .venv/bin/python benchmarks/validate_simulator.py            # the full table (about 30 min, 2 cores)
    sudo .venv/bin/python benchmarks/validate_simulator.py --hosts 2 --rates-gbit 1 --models vgg-like

For every cell (hosts x model x link rate) a fresh emulated cluster trains, side
by side in interleaved rounds, torch DDP with its defaults and the bench's other
bucket sizes, commsched's default `Strategy` and two other Strategies (coarse
partitions; no forward overlap).
Then, on the same hosts, the model is profiled with every host computing at
once and the link is measured (`commsched.bench.in_situ`), as a user would
profile on their own cluster before asking the simulator. The simulator is
given that profile and link and nothing measured during the comparison; its
iteration time for each system is set against the measured median.

``--from-runs results/validation/runs.json`` simulates an earlier run's cells again
(after a change to the simulator) without measuring; with ``--in-flight 1`` as if
the link ran one collective at a time, whatever the backend.

Writes ``runs.json`` (every measurement and profile) and ``validation.md`` (the
table, median and worst absolute error; then per cell commsched's default against
the fastest DDP, and the simulator's bound and best schedule) into ``--out``;
prints them.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import statistics
import sys
from pathlib import Path

from commsched.bench import runner
from commsched.bench.grid import BATCH, DDP_SWEEP_MB, run_cell
from commsched.bench.results import Cell
from commsched.bench.systems import Commsched, ComputeOnly, TorchDDP
from commsched.layout.setting import LayoutSetting
from commsched.planning.cost_model import Setting
from commsched.profiling.model import scaled_compute
from commsched.profiling.profile import Profile
from commsched.simulator import Cluster, DDPConfig, bound_s, simulate
from commsched.simulator.search import best_strategy
from commsched.strategy import Strategy

SYSTEMS = (
    ComputeOnly(),
    TorchDDP(),
    *(TorchDDP(mb) for mb in DDP_SWEEP_MB),
    Commsched(Strategy()),
    Commsched(Strategy(partition_mb=4.0, credit_mb=16.0, adaptive=False), "4 MiB partitions"),
    Commsched(Strategy(overlap_forward=False, adaptive=False), "no forward overlap"),
)
"""What each cell trains; compute alone is measured for the table, not simulated."""

_SETTING = re.compile(r"^(whole buckets(?: of ([0-9.]+) MiB, the first (too|([0-9.]+) MiB))?"
                      r"|partitions of ([0-9.]+) MiB, (no credit window|credit ([0-9.]+) MiB))")


def strategy_in_use(system: Commsched, partitioning: str | None, layout: dict | None = None) -> Strategy:
    """The Strategy the run used: with ``adaptive``, the sizes it kept at the end of warm-up
    (``layout``, `commsched.status`'s sizes as the bench records them), or where an older run
    lacks them, the cost model's choice in `commsched.status`'s text."""
    strategy = system.strategy
    if strategy.adaptive and layout:
        return dataclasses.replace(strategy, **layout, adaptive=False)
    match = _SETTING.match(partitioning or "")
    if not strategy.adaptive or match is None:
        return strategy
    if match.group(1).startswith("whole buckets"):
        whole = dataclasses.replace(strategy, partition_mb=None, credit_mb=None, adaptive=False)
        if match.group(2) is None:
            return whole
        cap = float(match.group(2))
        first = cap if match.group(4) is None else float(match.group(4))
        return dataclasses.replace(whole, bucket_cap_mb=cap, first_bucket_mb=first)
    credit = None if match.group(7) is None else float(match.group(7))
    return dataclasses.replace(strategy, partition_mb=float(match.group(5)), credit_mb=credit, adaptive=False)


def simulated_s(system: object, profile: Profile, cluster: Cluster, measured: dict) -> float:
    if isinstance(system, TorchDDP):
        return simulate(profile, cluster, DDPConfig.like_torch(system.bucket_cap_mb)).iteration_s
    assert isinstance(system, Commsched)
    used = strategy_in_use(system, measured.get("partitioning"), measured.get("layout_in_use"))
    return simulate(profile, cluster, used).iteration_s


def cluster_of(cell: Cell, profile: Profile, in_flight: int | None = None) -> Cluster:
    """The cell's cluster from its measured link (gloo on host memory: all-to-alls among 3 or more
    hosts); ``in_flight`` replaces the link's."""
    cluster = dataclasses.replace(Cluster.from_link(profile.link, workers=cell.hosts), all_to_all=cell.hosts >= 3)
    return cluster if in_flight is None else dataclasses.replace(cluster, in_flight=in_flight)


def compare_cell(cell: Cell, run: dict, in_flight: int | None = None) -> list[dict]:
    """One row per simulated system of one measured cell.

    Besides the prediction from the profile as taken, each row has one from the
    profile with its compute scaled to the compute alone the comparison measured
    (``calibrated``): where the two differ, the profile's compute was off (the
    hosts share two cores, so a few profiled iterations vary), not the model.
    """
    profile = Profile.from_dict(run["profile"])
    cluster = cluster_of(cell, profile, in_flight)
    compute_alone_s = statistics.median(run["systems"][ComputeOnly().name]["iteration_times_s"])
    calibrated = scaled_compute(profile, compute_alone_s / (profile.forward_s + profile.backward_s + profile.update_s))
    rows = []
    for system in SYSTEMS:
        if isinstance(system, ComputeOnly):
            continue
        measured = run["systems"][system.name]
        measured_s = statistics.median(measured["iteration_times_s"])
        predicted_s = simulated_s(system, profile, cluster, measured)
        calibrated_s = simulated_s(system, calibrated, cluster, measured)
        rows.append({"model": cell.model, "hosts": cell.hosts, "gbit": cell.rate_gbit, "system": system.name,
                     "measured_ms": measured_s * 1e3, "simulated_ms": predicted_s * 1e3,
                     "error": (predicted_s - measured_s) / measured_s,
                     "calibrated_ms": calibrated_s * 1e3, "calibrated_error": (calibrated_s - measured_s) / measured_s})
    return rows


def versus_best_ddp(cell: Cell, run: dict, in_flight: int | None = None) -> dict:
    """One measured cell: commsched's default against the fastest torch DDP bucket size, and the
    layout the default kept."""
    median_s = {name: statistics.median(r["iteration_times_s"]) for name, r in run["systems"].items()
                if r.get("iteration_times_s")}
    ddp = {s.name: median_s[s.name] for s in SYSTEMS if isinstance(s, TorchDDP) and s.name in median_s}
    best = min(ddp, key=ddp.get)
    default = next(s for s in SYSTEMS if isinstance(s, Commsched) and s.strategy == Strategy())
    kept = strategy_in_use(default, run["systems"][default.name].get("partitioning"),
                           run["systems"][default.name].get("layout_in_use"))
    cpu = run.get("cpu") or {}
    profile = Profile.from_dict(run["profile"])
    cluster = cluster_of(cell, profile, in_flight)
    _, fastest = best_strategy(profile, cluster)
    return {"model": cell.model, "hosts": cell.hosts, "gbit": cell.rate_gbit, "best_ddp": best,
            "bound_ms": bound_s(profile, cluster) * 1e3, "best_schedule_ms": fastest.iteration_s * 1e3,
            "best_ddp_ms": ddp[best] * 1e3, "commsched_ms": median_s[default.name] * 1e3,
            "compute_ms": median_s[ComputeOnly().name] * 1e3, "speedup": ddp[best] / median_s[default.name],
            "kept": Setting.of(LayoutSetting.of(kept)).describe(), "cpu_median": cpu.get("median"),
            "link": profile.link}


BEST_SCHEDULE_NOTE = (
    "The simulated bound is max(compute, one all-reduce of every gradient) on the cell's profile and link; "
    "the simulated best schedule is the fastest Strategy of `commsched.simulator.search.strategy_space` there "
    "(gradients exist only once the backward pass makes them, and each collective pays the link's fixed "
    "cost): no schedule the simulator knows comes nearer the bound.\n")


def versus_markdown(cells: list[dict]) -> str:
    lines = ["| model | hosts | Gbit/s | compute ms | best DDP ms | commsched ms | vs best DDP | kept | "
             "simulated bound ms | simulated best schedule ms | commsched / best schedule | CPU busy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        busy = "" if c["cpu_median"] is None else f"{c['cpu_median']:.0%}"
        lines.append(f"| {c['model']} | {c['hosts']} | {c['gbit']:g} | {c['compute_ms']:.0f} | {c['best_ddp_ms']:.0f} "
                     f"({c['best_ddp'].removeprefix('torch DDP').lstrip(', ') or 'default'}) | "
                     f"{c['commsched_ms']:.0f} | {c['speedup']:.2f}x | {c['kept']} | {c['bound_ms']:.0f} | "
                     f"{c['best_schedule_ms']:.0f} | {c['commsched_ms'] / c['best_schedule_ms']:.2f} | {busy} |")
    lines += ["", BEST_SCHEDULE_NOTE,
              "The link each cell measured (`commsched.profiling.link.measure_link`, on its hosts):", "",
              "| model | hosts | Gbit/s | fixed cost ms | MB/s | in flight | compute slowdown | "
              "collective slowdown |", "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        link = c["link"]
        lines.append(f"| {c['model']} | {c['hosts']} | {c['gbit']:g} | {link.latency_s * 1e3:.1f} | "
                     f"{link.bytes_per_s / 1e6:.1f} | {link.in_flight} | {link.compute_slowdown:.2f} | "
                     f"{link.collective_slowdown:.2f} |")
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict]) -> str:
    lines = ["| model | hosts | Gbit/s | system | measured ms | simulated ms | error | calibrated ms | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['hosts']} | {r['gbit']:g} | {r['system']} | {r['measured_ms']:.0f} | "
              f"{r['simulated_ms']:.0f} | {r['error']:+.1%} | {r['calibrated_ms']:.0f} | "
              f"{r['calibrated_error']:+.1%} |" for r in rows]
    for key, label in (("error", "Simulated from the profile as taken"),
                       ("calibrated_error", "With the profile's compute calibrated to the measured compute alone")):
        errors = [abs(r[key]) for r in rows]
        if not errors:
            continue
        worst = max(rows, key=lambda r: abs(r[key]))
        lines += ["", f"{label}: median absolute error {statistics.median(errors):.1%}; worst {max(errors):.1%} "
                      f"({worst['model']}, {worst['hosts']} hosts, {worst['gbit']:g} Gbit/s, {worst['system']})."]
        for name in dict.fromkeys(r["system"] for r in rows):
            mine = [abs(r[key]) for r in rows if r["system"] == name]
            lines.append(f"- {name}: median {statistics.median(mine):.1%}, worst {max(mine):.1%}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = runner.make_parser(__doc__)
    runner.add_hosts(parser, default=[2, 4])
    parser.add_argument("--models", nargs="+", default=sorted(BATCH), choices=sorted(BATCH))
    runner.add_rates_gbit(parser, default=[0.25, 1.0, 10.0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    runner.add_timeout(parser, default=1800)
    parser.add_argument("--out", type=Path, default=Path("results/validation"))
    parser.add_argument("--from-runs", type=Path, metavar="RUNS_JSON",
                        help="simulate the cells of an earlier run's runs.json again, without measuring")
    parser.add_argument("--in-flight", type=int, metavar="N",
                        help="with --from-runs: simulate every cell's link running N collectives at once, "
                             "whatever its backend runs (1: one at a time)")
    args = parser.parse_args(argv)
    if args.in_flight is not None and not args.from_runs:
        parser.error("--in-flight replays an earlier run: give --from-runs too")
    runner.refuse_below_one(parser, args, "rounds", "iterations")
    if args.from_runs:
        print(report(runner.read_rows(args.from_runs), args.in_flight))
        return 0
    problem = runner.cluster_problem("validate_simulator")
    if problem:
        return problem
    args.out.mkdir(parents=True, exist_ok=True)
    record = []
    for hosts, model, rate in itertools.product(args.hosts, args.models, args.rates_gbit):
        cell = Cell(model, rate, hosts, BATCH[model], 0)
        print(f"{model}, {hosts} hosts, {rate:g} Gbit/s ...", flush=True)
        run = run_cell(cell, SYSTEMS, args.rounds, args.iterations, args.warmup, args.timeout_s, profile=True)
        record.append({"cell": dataclasses.asdict(cell), "run": run})
        runner.write_json(args.out / "runs.json", record)
        (args.out / "validation.md").write_text(report(record))
    print(report(record))
    return 0


def report(record: list[dict], in_flight: int | None = None) -> str:
    """The simulator's errors on every system of every cell, then commsched against the best DDP."""
    cells = [(Cell(**entry["cell"]), entry["run"]) for entry in record]
    rows = [row for cell, run in cells for row in compare_cell(cell, run, in_flight)]
    return (markdown(rows) + "\nMeasured: commsched's default against the fastest torch DDP bucket size\n\n"
            + versus_markdown([versus_best_ddp(cell, run, in_flight) for cell, run in cells]))


if __name__ == "__main__":
    sys.exit(main())

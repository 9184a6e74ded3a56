"""A bench cell's measurements -> one row of ratios; rows -> the Markdown table and the plot.

Systems are picked by type and fields (`commsched.bench.systems`), never by name.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from commsched.bench.systems import Commsched, ComputeOnly, System, TorchDDP, scheduling_off


@dataclass(frozen=True)
class Cell:
    """One point of the grid, measured on a fresh emulated cluster."""

    model: str
    rate_gbit: float
    hosts: int
    """Workers (each an emulated host)."""
    batch_size: int
    ps_servers: int = 0
    """Extra hosts serving the parameter-server system (0: no such system)."""


def _the(chosen: Sequence[System], what: str, matches: Callable[[System], bool]) -> str:
    """The name of the one system of ``chosen`` that ``matches``."""
    found = [system.name for system in chosen if matches(system)]
    if len(found) != 1:
        raise ValueError(f"the systems must hold exactly one {what}, got {found}")
    return found[0]


def summarize(cell: Cell, runs: list[dict], chosen: Sequence[System]) -> dict:
    """Medians over repeats of each system's mean iteration time, and the derived ratios.

    ``runs`` are `run_cell`'s results for ``cell``, all of the same ``chosen``
    systems (a `lineup`).
    """

    def per_repeat(name: str) -> list[float]:
        return [statistics.fmean(r["systems"][name]["iteration_times_s"]) for r in runs]

    def allreduce_commsched(system: System, scheduled: bool) -> bool:
        return (isinstance(system, Commsched) and not system.num_servers
                and scheduling_off(system.strategy) != scheduled)

    compute = per_repeat(_the(chosen, "compute-only system", lambda s: isinstance(s, ComputeOnly)))
    allreduce = [statistics.median(r["allreduce"]["iteration_times_s"]) for r in runs]
    allreduce_cpu = [statistics.median(r["allreduce"]["cpu_times_s"]) for r in runs]
    bounds = [max(c, a) for c, a in zip(compute, allreduce)]
    ddp_names = [system.name for system in chosen if isinstance(system, TorchDDP)]
    best_ddp = [min(statistics.fmean(r["systems"][n]["iteration_times_s"]) for n in ddp_names) for r in runs]
    ddp = per_repeat(_the(chosen, "torch DDP with its defaults",
                          lambda s: isinstance(s, TorchDDP) and s.bucket_cap_mb is None))
    off = per_repeat(_the(chosen, "all-reduce commsched with scheduling off",
                          lambda s: allreduce_commsched(s, scheduled=False)))
    ours = per_repeat(_the(chosen, "all-reduce commsched with scheduling on",
                           lambda s: allreduce_commsched(s, scheduled=True)))
    ps: dict = {}
    if cell.ps_servers:
        name = _the(chosen, f"commsched with {cell.ps_servers} parameter servers",
                    lambda s: isinstance(s, Commsched) and s.num_servers == cell.ps_servers)
        ps_times = per_repeat(name)
        server_bytes = runs[0]["systems"][name]["server_bytes"]
        link_s = cell.hosts * max(server_bytes) * 8 / (cell.rate_gbit * 1e9)
        ps_bounds = [max(c, link_s) for c in compute]
        ps = {
            "ps_ms": statistics.median(ps_times) * 1e3,
            "ps_link_bound_ms": link_s * 1e3,
            "ps_bound_ms": statistics.median(ps_bounds) * 1e3,
            "ps_speedup_vs_ddp": statistics.median(d / p for d, p in zip(ddp, ps_times)),
            "ps_vs_allreduce": statistics.median(o / p for o, p in zip(ours, ps_times)),
            "ps_efficiency": statistics.median(b / p for b, p in zip(ps_bounds, ps_times)),
            "ps_server_imbalance": max(server_bytes) / statistics.fmean(server_bytes),
        }
    return {
        **asdict(cell),
        "compute_ms": statistics.median(compute) * 1e3,
        "allreduce_ms": statistics.median(allreduce) * 1e3,
        "allreduce_cpu_ms": statistics.median(allreduce_cpu) * 1e3,
        "bound_ms": statistics.median(bounds) * 1e3,
        "ddp_ms": statistics.median(ddp) * 1e3,
        "best_ddp_ms": statistics.median(best_ddp) * 1e3,
        "scheduling_off_ms": statistics.median(off) * 1e3,
        "commsched_ms": statistics.median(ours) * 1e3,
        "speedup_vs_ddp": statistics.median(d / o for d, o in zip(ddp, ours)),
        "speedup_vs_ddp_range": [min(d / o for d, o in zip(ddp, ours)), max(d / o for d, o in zip(ddp, ours))],
        "speedup_vs_best_ddp": statistics.median(d / o for d, o in zip(best_ddp, ours)),
        "efficiency": statistics.median(b / o for b, o in zip(bounds, ours)),
        "ddp_efficiency": statistics.median(b / d for b, d in zip(bounds, ddp)),
        "repeats": len(runs),
        **ps,
    }


def markdown(rows: list[dict]) -> str:
    header = ("| model | hosts | Gbit/s | batch | compute ms | all-reduce ms (CPU ms) | bound ms | DDP ms "
              "| best DDP ms | sched. off ms | commsched ms | speedup vs DDP (range) | vs best DDP "
              "| efficiency (DDP's) |")
    lines = [header, "|" + "|".join(["---"] * (header.count("|") - 1)) + "|"]
    for r in rows:
        low, high = r["speedup_vs_ddp_range"]
        lines.append(
            f"| {r['model']} | {r['hosts']} | {r['rate_gbit']:g} | {r['batch_size']} | {r['compute_ms']:.0f} "
            f"| {r['allreduce_ms']:.0f} ({r['allreduce_cpu_ms']:.0f}) | {r['bound_ms']:.0f} | {r['ddp_ms']:.0f} "
            f"| {r['best_ddp_ms']:.0f} | {r['scheduling_off_ms']:.0f} | {r['commsched_ms']:.0f} "
            f"| {r['speedup_vs_ddp']:.2f} ({low:.2f}-{high:.2f}) | {r['speedup_vs_best_ddp']:.2f} "
            f"| {r['efficiency']:.2f} ({r['ddp_efficiency']:.2f}) |"
        )
    ps_rows = [r for r in rows if r.get("ps_servers")]
    if ps_rows:
        header = ("| model | workers + servers | Gbit/s | PS ms | PS bound ms (busiest server link ms) "
                  "| PS speedup vs DDP | PS time / all-reduce commsched time | PS efficiency "
                  "| most loaded server / mean |")
        lines += ["", header, "|" + "|".join(["---"] * (header.count("|") - 1)) + "|"]
        for r in ps_rows:
            lines.append(
                f"| {r['model']} | {r['hosts']} + {r['ps_servers']} | {r['rate_gbit']:g} | {r['ps_ms']:.0f} "
                f"| {r['ps_bound_ms']:.0f} ({r['ps_link_bound_ms']:.0f}) | {r['ps_speedup_vs_ddp']:.2f} "
                f"| {1 / r['ps_vs_allreduce']:.2f} | {r['ps_efficiency']:.2f} | {r['ps_server_imbalance']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for hosts in sorted({r["hosts"] for r in rows if r["model"] == model}):
            mine = sorted((r for r in rows if r["model"] == model and r["hosts"] == hosts), key=lambda r: r["rate_gbit"])
            ax.plot([r["rate_gbit"] for r in mine], [r["speedup_vs_ddp"] for r in mine], "o-", label=f"{hosts} hosts")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("link rate (Gbit/s)")
        ax.set_ylabel("speedup over torch DDP")
        ax.set_title(model)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ driver

"""A bench cell's measurements -> one row of ratios; rows -> the Markdown tables, the plot,
and a line per cell saying where commsched's iteration time goes.

Systems are picked by type and fields (`commsched.bench.systems`), never by name.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from commsched.bench.cpu_guard import CORES_BUSY_THRESHOLD, SAMPLE_INTERVAL_S, cores_set_the_pace
from commsched.bench.models import input_layer_share
from commsched.bench.systems import Commsched, ComputeOnly, System, TorchDDP, TorchFSDP2, scheduling_off


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


def _fsdp2(cell_runs: list[dict], chosen: Sequence[System], ours: list[float]) -> dict:
    """The FSDP2 columns: its time and commsched's speedup over it (None where absent or
    where FSDP2 could not train the model)."""
    names = [system.name for system in chosen if isinstance(system, TorchFSDP2)]
    if len(names) != 1 or any(r["systems"][names[0]].get("unavailable") for r in cell_runs):
        return {"fsdp2_ms": None, "speedup_vs_fsdp2": None}
    times = [statistics.fmean(r["systems"][names[0]]["iteration_times_s"]) for r in cell_runs]
    return {"fsdp2_ms": statistics.median(times) * 1e3,
            "speedup_vs_fsdp2": statistics.median(f / o for f, o in zip(times, ours))}


def _figures(cell_runs: list[dict], name: str) -> dict:
    """commsched's own figures (`commsched.status`), medians over repeats of per-iteration means."""
    def median_of_means(key: str) -> float | None:
        means = [statistics.fmean(r["systems"][name][key]) for r in cell_runs if r["systems"][name].get(key)]
        return statistics.median(means) * 1e3 if means else None

    return {"commsched_exposed_ms": median_of_means("exposed_wait_s"),
            "commsched_updates_ms": median_of_means("update_s"),
            "commsched_drain_ms": median_of_means("drain_s"),
            "commsched_partitioning": cell_runs[0]["systems"][name].get("partitioning")}


def _contention_ratios(cell_runs: list[dict]) -> list[float] | None:
    """Per repeat, the median over pairs of compute and all-reduce together over the longer alone
    ([Note: the bound with contention] in `commsched.bench.contention`); None where a run lacks them."""
    ratios = []
    for r in cell_runs:
        measured = r.get("contention")
        if not measured or not measured.get("together_s"):
            return None
        ratios.append(statistics.median(
            t / max(c, a) for t, c, a in zip(measured["together_s"], measured["compute_alone_s"],
                                             measured["allreduce_s"])))
    return ratios


def _contention(cell_runs: list[dict], bounds: list[float], ours: list[float]) -> dict:
    """The bound with contention and commsched's efficiency against it (None where not measured)."""
    ratios = _contention_ratios(cell_runs)
    if ratios is None:
        return {"contention_ratio": None, "contended_bound_ms": None, "contended_efficiency": None}
    contended = [b * ratio for b, ratio in zip(bounds, ratios)]
    return {"contention_ratio": statistics.median(ratios),
            "contended_bound_ms": statistics.median(contended) * 1e3,
            "contended_efficiency": statistics.median(b / o for b, o in zip(contended, ours))}


def _cpu(cell_runs: list[dict]) -> dict:
    """How busy the cores were (`commsched.bench.cpu_guard`): medians over the repeats that measured
    it of each run's median and 90th percentile, and whether the cores set the cell's pace by that
    median; None (and not marked) where no run measured it, as in runs saved before it was."""
    measured = [r["cpu"] for r in cell_runs if r.get("cpu")]
    if not measured:
        return {"cpu_busy_median": None, "cpu_busy_p90": None, "cpu_cores": None, "cores_set_the_pace": False}
    median = statistics.median(m["median"] for m in measured)
    return {"cpu_busy_median": median, "cpu_busy_p90": statistics.median(m["p90"] for m in measured),
            "cpu_cores": measured[0]["cores"], "cores_set_the_pace": cores_set_the_pace(median)}


def unavailable(cell_runs: list[dict]) -> dict[str, str]:
    """Systems that could not train the cell's model, with why (from the first run saying so)."""
    reasons: dict[str, str] = {}
    for r in cell_runs:
        for name, result in r["systems"].items():
            if result.get("unavailable"):
                reasons.setdefault(name, result["unavailable"])
    return reasons


def peak_rss(cell_runs: list[dict]) -> dict[str, float] | None:
    """Peak RSS in MiB by system, from the first run that measured it (None: none did)."""
    for r in cell_runs:
        peaks = {name: result.get("peak_rss_mib", math.nan) for name, result in r["systems"].items()}
        if any(not math.isnan(value) for value in peaks.values()):
            return peaks
    return None


def summarize(cell: Cell, runs: list[dict], chosen: Sequence[System],
              peak_rss_mib: dict[str, float] | None = None) -> dict:
    """Medians over repeats of each system's mean iteration time, and the derived ratios.

    ``runs`` are `run_cell`'s results for ``cell``, all of the same ``chosen``
    systems (a `lineup`). ``peak_rss_mib`` (by system name) defaults to what
    ``runs`` measured; the grid passes the figures of another cell of the same
    model, hosts and batch, since memory does not depend on the link rate.
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
    share = input_layer_share(cell.model)
    input_layer_bounds = [max(b, c + a * share) for b, c, a in zip(bounds, compute, allreduce)]
    ddp_names = [system.name for system in chosen if isinstance(system, TorchDDP)]
    ddp_means = {n: [statistics.fmean(r["systems"][n]["iteration_times_s"]) for r in runs] for n in ddp_names}
    best_ddp = [min(means[i] for means in ddp_means.values()) for i in range(len(runs))]
    ddp = per_repeat(_the(chosen, "torch DDP with its defaults", lambda s: s == TorchDDP()))
    off = per_repeat(_the(chosen, "all-reduce commsched with scheduling off",
                          lambda s: allreduce_commsched(s, scheduled=False)))
    ours_name = _the(chosen, "all-reduce commsched with scheduling on",
                     lambda s: allreduce_commsched(s, scheduled=True))
    ours = per_repeat(ours_name)
    ps: dict = {}
    if cell.ps_servers:
        name = _the(chosen, f"commsched with {cell.ps_servers} parameter servers",
                    lambda s: isinstance(s, Commsched) and s.num_servers == cell.ps_servers and not s.label)
        ps_times = per_repeat(name)
        variants = [s for s in chosen if isinstance(s, Commsched) and s.num_servers and s.label]
        server_bytes = runs[0]["systems"][name]["server_bytes"]
        link_s = cell.hosts * max(server_bytes) * 8 / (cell.rate_gbit * 1e9)
        # [Note: the measured server link]: timed with even shares, scaled to the busiest server.
        even_link = [statistics.median(r["server_link"]["iteration_times_s"]) for r in runs]
        measured_link = [e * max(server_bytes) / statistics.fmean(server_bytes) for e in even_link]
        ps_bounds = [max(c, m) for c, m in zip(compute, measured_link)]
        # The input layer's pushes can start only when the backward pass ends, and its pulls (the
        # last one aside) overlap them: at best its bytes are spread evenly over the servers' links.
        ps_input_bounds = [max(b, c + share * e) for b, c, e in zip(ps_bounds, compute, even_link)]
        ps = {
            "ps_ms": statistics.median(ps_times) * 1e3,
            "ps_link_bound_ms": link_s * 1e3,
            "ps_measured_link_ms": statistics.median(measured_link) * 1e3,
            "ps_bound_ms": statistics.median(ps_bounds) * 1e3,
            "ps_speedup_vs_ddp": statistics.median(d / p for d, p in zip(ddp, ps_times)),
            "ps_vs_allreduce": statistics.median(o / p for o, p in zip(ours, ps_times)),
            "ps_efficiency": statistics.median(b / p for b, p in zip(ps_bounds, ps_times)),
            "ps_input_layer_bound_ms": statistics.median(ps_input_bounds) * 1e3,
            "ps_input_layer_efficiency": statistics.median(b / p for b, p in zip(ps_input_bounds, ps_times)),
            "ps_server_imbalance": max(server_bytes) / statistics.fmean(server_bytes),
            "ps_variants": {
                v.label: {"ms": statistics.median(per_repeat(v.name)) * 1e3,
                          "vs_default": statistics.median(t / p for t, p in zip(per_repeat(v.name), ps_times))}
                for v in variants
            },
        }
    return {
        **asdict(cell),
        "compute_ms": statistics.median(compute) * 1e3,
        "allreduce_ms": statistics.median(allreduce) * 1e3,
        "allreduce_cpu_ms": statistics.median(allreduce_cpu) * 1e3,
        "bound_ms": statistics.median(bounds) * 1e3,
        "ddp_ms": statistics.median(ddp) * 1e3,
        "best_ddp_ms": statistics.median(best_ddp) * 1e3,
        "best_ddp_system": min(ddp_means, key=lambda n: statistics.median(ddp_means[n])),
        "scheduling_off_ms": statistics.median(off) * 1e3,
        "commsched_ms": statistics.median(ours) * 1e3,
        "speedup_vs_ddp": statistics.median(d / o for d, o in zip(ddp, ours)),
        "speedup_vs_ddp_range": [min(d / o for d, o in zip(ddp, ours)), max(d / o for d, o in zip(ddp, ours))],
        "speedup_vs_best_ddp": statistics.median(d / o for d, o in zip(best_ddp, ours)),
        "efficiency": statistics.median(b / o for b, o in zip(bounds, ours)),
        "ddp_efficiency": statistics.median(b / d for b, d in zip(bounds, ddp)),
        "input_layer_ms": statistics.median(allreduce) * share * 1e3,
        "input_layer_bound_ms": statistics.median(input_layer_bounds) * 1e3,
        "input_layer_efficiency": statistics.median(b / o for b, o in zip(input_layer_bounds, ours)),
        "repeats": len(runs),
        **_contention(runs, bounds, ours),
        **_fsdp2(runs, chosen, ours),
        **_figures(runs, ours_name),
        **_cpu(runs),
        "peak_rss_mib": peak_rss_mib if peak_rss_mib is not None else peak_rss(runs),
        "unavailable": unavailable(runs),
        **ps,
    }


@dataclass(frozen=True)
class Breakdown:
    """Where one commsched iteration's time goes, in ms (medians over repeats).

    ``other`` is what is left: dispatch and bookkeeping, and computation slowed
    down by communication sharing the cores; it may be negative where compute
    alone was measured slower than in the commsched run.
    """

    total: float
    compute: float
    exposed: float
    updates: float

    @property
    def other(self) -> float:
        return self.total - self.compute - self.exposed - self.updates


def breakdown(row: dict) -> Breakdown | None:
    """The default commsched system's iteration split (None where commsched gave no figures)."""
    if row.get("commsched_exposed_ms") is None or row.get("commsched_updates_ms") is None:
        return None
    return Breakdown(row["commsched_ms"], row["compute_ms"], row["commsched_exposed_ms"], row["commsched_updates_ms"])


def breakdown_line(row: dict) -> str | None:
    """One line: ``vgg-like 2 hosts 0.25 Gbit/s: 713 ms = compute 599 + exposed communication 60 + ...``."""
    split = breakdown(row)
    if split is None:
        return None
    line = (f"{row['model']} {row['hosts']} hosts {row['rate_gbit']:g} Gbit/s: {round(split.total)} ms = "
            f"compute {round(split.compute)} + exposed communication {round(split.exposed)} "
            f"+ updates {round(split.updates)} + other {round(split.other)} (dispatch, contention)")
    if "input_layer_bound_ms" in row and row["input_layer_bound_ms"] >= row["bound_ms"] + 1.0:
        line += (f"; the input layer's reduction ({round(row['input_layer_ms'])} ms) hides behind no computation, "
                 f"so no schedule beats {round(row['input_layer_bound_ms'])} ms "
                 f"(efficiency against that: {row['input_layer_efficiency']:.2f})")
    if row.get("contention_ratio") is not None:
        line += (f"; on these shared cores, compute and one all-reduce started together took "
                 f"{row['contention_ratio']:.2f}x the longer of the two alone: the bound with contention is "
                 f"{round(row['contended_bound_ms'])} ms (efficiency against it: {row['contended_efficiency']:.2f})")
    if row.get("commsched_drain_ms") is not None:
        line += (f"; finishing what is in flight after a round (opt.synchronize(), not in the time) took "
                 f"{round(row['commsched_drain_ms'])} ms")
    if row.get("commsched_partitioning"):
        line += f"; partitioning: {row['commsched_partitioning']}"
    return line


def _table(header: str, lines: list[str]) -> list[str]:
    return [header, "|" + "|".join(["---"] * (header.count("|") - 1)) + "|", *lines]


def _or_na(value: float | None, spec: str) -> str:
    return "n/a" if value is None or math.isnan(value) else format(value, spec)


def _times_table(rows: list[dict]) -> list[str]:
    header = ("| model | hosts | Gbit/s | batch | compute ms | all-reduce ms (CPU ms) | bound ms | DDP ms "
              "| best DDP ms | FSDP2 ms | sched. off ms | commsched ms | speedup vs DDP (range) | vs best DDP "
              "| vs FSDP2 | efficiency (DDP's) | bound with contention ms (efficiency) | CPU busy (p90) |")
    lines = []
    for r in rows:
        low, high = r["speedup_vs_ddp_range"]
        lines.append(
            f"| {r['model']} | {r['hosts']} | {r['rate_gbit']:g} | {r['batch_size']} | {r['compute_ms']:.0f} "
            f"| {r['allreduce_ms']:.0f} ({r['allreduce_cpu_ms']:.0f}) | {r['bound_ms']:.0f} | {r['ddp_ms']:.0f} "
            f"| {r['best_ddp_ms']:.0f} | {_or_na(r.get('fsdp2_ms'), '.0f')} | {r['scheduling_off_ms']:.0f} "
            f"| {r['commsched_ms']:.0f} | {r['speedup_vs_ddp']:.2f} ({low:.2f}-{high:.2f}) "
            f"| {r['speedup_vs_best_ddp']:.2f} | {_or_na(r.get('speedup_vs_fsdp2'), '.2f')} "
            f"| {r['efficiency']:.2f} ({r['ddp_efficiency']:.2f}) | {_contended(r)} | {_cpu_busy(r)} |"
        )
    return _table(header, lines) + _cpu_footnote(rows)


def _cpu_footnote(rows: list[dict]) -> list[str]:
    """Under the times table, where a cell is marked: what the mark means."""
    if not any(r.get("cores_set_the_pace") for r in rows):
        return []
    cores = max(r.get("cpu_cores") or 0 for r in rows)
    return ["", f"! The machine's {cores} cores were at least {CORES_BUSY_THRESHOLD:.0%} busy in most of the samples "
            f"taken every {SAMPLE_INTERVAL_S:g} s while the cell ran: the cores, not the links, set its pace, so "
            "such a cell measures the machine, not the links."]


def _cpu_busy(row: dict) -> str:
    """The cores' busy share, median (90th percentile), with ``!`` where they set the cell's pace."""
    if row.get("cpu_busy_median") is None:
        return "n/a"
    mark = " !" if row.get("cores_set_the_pace") else ""
    return f"{row['cpu_busy_median']:.0%} ({row['cpu_busy_p90']:.0%}){mark}"


def _contended(row: dict) -> str:
    if row.get("contended_bound_ms") is None:
        return "n/a"
    return f"{row['contended_bound_ms']:.0f} ({row['contended_efficiency']:.2f})"


def _ps_input_layer(row: dict) -> str:
    """The parameter servers' bound set by the input layer, where it exceeds theirs."""
    bound = row.get("ps_input_layer_bound_ms")
    if bound is None or bound < row["ps_bound_ms"] + 1.0:
        return "-"
    return f"{bound:.0f} ({row['ps_input_layer_efficiency']:.2f})"


def _ps_table(rows: list[dict]) -> list[str]:
    header = ("| model | workers + servers | Gbit/s | PS ms "
              "| PS bound ms (busiest server link ms: measured / at the rate) | PS speedup vs DDP "
              "| PS time / all-reduce commsched time | PS efficiency "
              "| most loaded server / mean | bound with the input layer ms (PS efficiency) |")
    lines = [
        f"| {r['model']} | {r['hosts']} + {r['ps_servers']} | {r['rate_gbit']:g} | {r['ps_ms']:.0f} "
        f"| {r['ps_bound_ms']:.0f} ({r['ps_measured_link_ms']:.0f} / {r['ps_link_bound_ms']:.0f}) "
        f"| {r['ps_speedup_vs_ddp']:.2f} "
        f"| {1 / r['ps_vs_allreduce']:.2f} | {r['ps_efficiency']:.2f} | {r['ps_server_imbalance']:.3f} "
        f"| {_ps_input_layer(r)} |"
        for r in rows if r.get("ps_servers")
    ]
    return _table(header, lines) if lines else []


def _ps_variants_table(rows: list[dict]) -> list[str]:
    """The parameter-server systems of ``--ps-block-mb``: their time, and its ratio to the default's."""
    rows = [r for r in rows if r.get("ps_variants")]
    if not rows:
        return []
    labels = list(rows[0]["ps_variants"])
    header = ("| model | workers + servers | Gbit/s | PS ms (default) | "
              + " | ".join(f"{label} ms (time / default's)" for label in labels) + " |")
    lines = [
        f"| {r['model']} | {r['hosts']} + {r['ps_servers']} | {r['rate_gbit']:g} | {r['ps_ms']:.0f} | "
        + " | ".join(f"{r['ps_variants'][label]['ms']:.0f} ({r['ps_variants'][label]['vs_default']:.3f})"
                     for label in labels) + " |"
        for r in rows
    ]
    return ["Parameter servers with other block sizes (same rounds; median over repeats of the per-repeat "
            "time ratio):", "", *_table(header, lines)]


def _rss_table(rows: list[dict]) -> list[str]:
    """Peak RSS per system, one row per model, hosts and batch (it does not depend on the rate)."""
    measured: dict[tuple, dict] = {}
    for r in rows:
        if r.get("peak_rss_mib"):
            measured.setdefault((r["model"], r["hosts"], r["batch_size"]), r["peak_rss_mib"])
    if not measured:
        return []
    names = list(next(iter(measured.values())))
    header = "| model | hosts | batch | " + " | ".join(f"{name} MiB" for name in names) + " |"
    lines = [f"| {model} | {hosts} | {batch} | " + " | ".join(_or_na(peaks.get(n), ".0f") for n in names) + " |"
             for (model, hosts, batch), peaks in measured.items()]
    return ["Peak RSS per system (max over its ranks; each system alone in a process forked before the "
            "comparison, trained a few iterations):", "", *_table(header, lines)]


def _notes(rows: list[dict]) -> list[str]:
    """The breakdown lines, and the systems that could not train a model."""
    lines = [line for line in map(breakdown_line, rows) if line]
    if lines:
        lines = ["Where commsched's iteration time goes (rank 0, mean per measured iteration; compute is the "
                 "compute-only system's time):", "", *(f"- {line}" for line in lines)]
    reasons = sorted({reason for r in rows for reason in r.get("unavailable", {}).values()})
    if reasons:
        lines += ["", "Could not run:", "", *(f"- {reason}" for reason in reasons)]
    return lines


def markdown(rows: list[dict]) -> str:
    """The tables of ``results.md``: times, parameter servers (and their block sizes), peak RSS, then the notes."""
    sections = [section for section in (_times_table(rows), _ps_table(rows), _ps_variants_table(rows),
                                        _rss_table(rows), _notes(rows)) if section]
    return "\n\n".join("\n".join(section) for section in sections) + "\n"


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

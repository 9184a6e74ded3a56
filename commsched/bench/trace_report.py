"""``commsched trace-report DIR``: per iteration, how much communication was hidden.

Reads the ``rank<N>.json`` traces written with ``Strategy(trace_dir=DIR)``.
Per iteration (from one forward pass to the next) of each rank:

- time: the iteration's length;
- wire busy: the union of its partitions' time on the wire;
- exposed: the time the compute row was blocked waiting for communication
  (the ``gates`` row: forward gates, the end-of-backward wait, synchronize);
- overlap: the share of wire time that was not exposed, 1 - exposed / busy;
- backward: from the first module's backward span to the last one's end.

With several ranks it also gives how much longer the slowest rank's backward
pass took than the fastest's, per iteration (median): every rank's iteration
waits at the end of backward for the slowest one's last partitions, so that
time shows as "exposed" on the faster ranks although no schedule can hide it.
It also draws a Gantt chart of one iteration, all rows of all ranks.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from commsched.engine.trace import ROWS


@dataclass(frozen=True)
class IterationSummary:
    rank: int
    iteration: int
    start_us: float
    time_ms: float
    wire_busy_ms: float
    exposed_ms: float
    backward_ms: float | None = None
    """None where the iteration has no backward span (a step without backward)."""

    @property
    def overlap(self) -> float:
        if self.wire_busy_ms <= 0:
            return 1.0
        return max(0.0, min(1.0, 1.0 - self.exposed_ms / self.wire_busy_ms))


def load_traces(directory: Path) -> dict[int, list[dict]]:
    files = sorted(directory.glob("rank*.json"))
    if not files:
        raise FileNotFoundError(
            f"no rank*.json traces in {directory}; train with Strategy(trace_dir='{directory}') first"
        )
    traces = {}
    for path in files:
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
        traces[int(path.stem.removeprefix("rank"))] = events
    return traces


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1e3


def _clipped(events: list[dict], start: float, stop: float) -> list[tuple[float, float]]:
    out = []
    for e in events:
        a, b = max(e["ts"], start), min(e["ts"] + e["dur"], stop)
        if b > a:
            out.append((a, b))
    return out


def _extent_ms(events: list[dict], start: float, stop: float) -> float | None:
    """From the first of ``events`` starting in ``[start, stop)`` to the last one's end."""
    inside = [e for e in events if start <= e["ts"] < stop]
    if not inside:
        return None
    return (max(e["ts"] + e["dur"] for e in inside) - min(e["ts"] for e in inside)) / 1e3


def summarize(events: list[dict], rank: int) -> list[IterationSummary]:
    iterations = sorted((e for e in events if e["tid"] == "compute" and e["name"] == "iteration"),
                        key=lambda e: e["ts"])
    wire = [e for e in events if e["tid"] == "wire"]
    gates = [e for e in events if e["tid"] == "gates"]
    backward = [e for e in events if e["tid"] == "compute" and e["name"].startswith("backward ")]
    summaries = []
    for it in iterations:
        start, stop = it["ts"], it["ts"] + it["dur"]
        summaries.append(IterationSummary(
            rank=rank, iteration=it["args"].get("iteration", -1), start_us=start, time_ms=it["dur"] / 1e3,
            wire_busy_ms=_union_ms(_clipped(wire, start, stop)),
            exposed_ms=_union_ms(_clipped(gates, start, stop)),
            backward_ms=_extent_ms(backward, start, stop),
        ))
    return summaries


def backward_spread_ms(per_rank: dict[int, list[IterationSummary]]) -> list[float]:
    """Per iteration every rank traced with a backward pass: the slowest rank's backward
    time minus the fastest's."""
    by_iteration: dict[int, dict[int, float]] = {}
    for rank, summaries in per_rank.items():
        for s in summaries:
            if s.backward_ms is not None:
                by_iteration.setdefault(s.iteration, {})[rank] = s.backward_ms
    return [max(times.values()) - min(times.values())
            for _, times in sorted(by_iteration.items()) if len(times) == len(per_rank)]


def draw_gantt(traces: dict[int, list[dict]], window: tuple[float, float], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, stop = window
    lanes = [(rank, row) for rank in sorted(traces) for row in ROWS]
    colors = {"compute": "tab:blue", "gates": "tab:red", "queue": "tab:gray", "wire": "tab:green",
              "update": "tab:orange"}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(lanes) + 1.2))
    for lane, (rank, row) in enumerate(lanes):
        spans = [(a - start, b - a) for a, b in _clipped(
            [e for e in traces[rank] if e["tid"] == row and e["name"] != "iteration"], start, stop)]
        ax.broken_barh([(a / 1e3, w / 1e3) for a, w in spans], (lane - 0.4, 0.8),
                       facecolors=colors[row], edgecolor="black", linewidth=0.2)
    ax.set_yticks(range(len(lanes)), [f"rank {r} {row}" for r, row in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the iteration began")
    ax.set_title("commsched timeline: red = waiting for communication, green = on the wire")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(directory: Path, iteration: int | None = None, png: Path | None = None) -> str:
    """The report as text; the Gantt chart of ``iteration`` (default: the last full one) in ``png``."""
    traces = load_traces(directory)
    per_rank = {rank: summarize(events, rank) for rank, events in traces.items()}
    lines = [f"{'rank':>4} {'iteration':>9} {'time ms':>9} {'wire busy ms':>13} {'exposed ms':>11} {'overlap':>8} "
             f"{'backward ms':>12}"]
    for rank, summaries in per_rank.items():
        for s in summaries:
            backward = "-" if s.backward_ms is None else f"{s.backward_ms:.1f}"
            lines.append(f"{rank:>4} {s.iteration:>9} {s.time_ms:9.1f} {s.wire_busy_ms:13.1f} "
                         f"{s.exposed_ms:11.1f} {s.overlap:8.0%} {backward:>12}")
    everything = [s for summaries in per_rank.values() for s in summaries]
    if everything:
        lines.append(
            f"median over {len(everything)} rank-iterations: "
            f"time {statistics.median(s.time_ms for s in everything):.1f} ms, "
            f"exposed {statistics.median(s.exposed_ms for s in everything):.1f} ms, "
            f"overlap {statistics.median(s.overlap for s in everything):.0%}"
        )
    spread = backward_spread_ms(per_rank) if len(per_rank) > 1 else []
    if spread:
        lines.append(
            f"the slowest rank's backward pass took {statistics.median(spread):.1f} ms longer than the fastest's "
            f"(median over {len(spread)} iterations; the faster ranks wait for it at the end of backward)"
        )
    rank0 = per_rank.get(min(per_rank), [])
    if png is not None and rank0:
        chosen = next((s for s in rank0 if s.iteration == iteration), rank0[-1])
        draw_gantt(traces, (chosen.start_us, chosen.start_us + chosen.time_ms * 1e3), png)
        lines.append(f"Gantt chart of iteration {chosen.iteration}: {png}")
    return "\n".join(lines)

"""The trace report's per-iteration backward time and the spread between ranks, on written traces."""

from __future__ import annotations

import json
from pathlib import Path

from commsched.bench.trace_report import backward_spread_ms, report, summarize


def span(row: str, name: str, start_ms: float, duration_ms: float, iteration: int) -> dict:
    return {"ph": "X", "tid": row, "name": name, "ts": start_ms * 1e3, "dur": duration_ms * 1e3,
            "args": {"iteration": iteration}}


def iterations(backward_ms: list[float | None]) -> list[dict]:
    """One 100 ms iteration per entry: a forward pass, then backward spans lasting the entry
    (from 40 ms in; none where None), and one partition on the wire."""
    events = []
    for index, backward in enumerate(backward_ms):
        start = 100.0 * index
        events += [span("compute", "iteration", start, 100.0, index),
                   span("compute", "forward Net", start, 30.0, index), span("wire", "P0 b0", start + 45, 10.0, index)]
        if backward is not None:  # two modules' spans: the pass runs from the first start to the last end
            events += [span("compute", "backward head", start + 40, 5.0, index),
                       span("compute", "backward stem", start + 40 + backward - 5, 5.0, index)]
    return events


def write(directory: Path, traces: dict[int, list[dict]]) -> None:
    for rank, events in traces.items():
        (directory / f"rank{rank}.json").write_text(json.dumps({"traceEvents": events}))


def test_backward_time_runs_from_the_first_backward_span_to_the_last_and_is_none_without_one():
    summaries = summarize(iterations([30.0, None, 52.5]), rank=0)
    assert [s.backward_ms for s in summaries] == [30.0, None, 52.5]


def test_the_spread_is_slowest_minus_fastest_over_iterations_every_rank_has():
    per_rank = {0: summarize(iterations([30.0, 50.0, 40.0]), 0), 1: summarize(iterations([45.0, 20.0, None]), 1)}
    assert backward_spread_ms(per_rank) == [15.0, 30.0]


def test_the_report_gives_the_column_and_the_median_spread(tmp_path: Path):
    write(tmp_path, {0: iterations([30.0, 50.0, 40.0]), 1: iterations([45.0, 20.0, 44.0])})
    text = report(tmp_path)
    assert "backward ms" in text.splitlines()[0]
    assert "the slowest rank's backward pass took 15.0 ms longer than the fastest's (median over 3 iterations" in text


def test_one_rank_has_no_spread_line(tmp_path: Path):
    write(tmp_path, {0: iterations([30.0, None])})
    text = report(tmp_path)
    assert "slowest rank" not in text and text.splitlines()[2].split()[-1] == "-"

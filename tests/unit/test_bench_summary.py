"""The benchmark's arithmetic: bound, speedups, efficiency, table and plot."""

from __future__ import annotations

import pytest

from commsched.bench import COMPUTE_ONLY, UNSCHEDULED_NAME, Cell, markdown, plot, summarize
from commsched.compare import ALLREDUCE_ONLY, COMMSCHED, DDP


def run(compute, allreduce, ddp, ddp_big, off, ours):
    def times(value):
        return {"iteration_times_s": [value] * 3, "cpu_times_s": [value / 2] * 3}

    return {COMPUTE_ONLY: times(compute), ALLREDUCE_ONLY: times(allreduce), DDP: times(ddp),
            "torch DDP, bucket_cap_mb=100": times(ddp_big), UNSCHEDULED_NAME: times(off), COMMSCHED: times(ours)}


def test_summary_ratios():
    cell = Cell("vgg-like", 0.25, 2, 64)
    runs = [run(0.5, 0.4, 1.0, 0.9, 0.95, 0.625), run(0.5, 0.4, 1.2, 1.0, 1.1, 0.6)]
    row = summarize(cell, runs)
    assert row["bound_ms"] == pytest.approx(500)
    assert row["speedup_vs_ddp"] == pytest.approx((1.0 / 0.625 + 1.2 / 0.6) / 2)
    assert row["speedup_vs_ddp_range"] == pytest.approx([1.6, 2.0])
    assert row["speedup_vs_best_ddp"] == pytest.approx((0.9 / 0.625 + 1.0 / 0.6) / 2)
    assert row["efficiency"] == pytest.approx((0.5 / 0.625 + 0.5 / 0.6) / 2)
    assert row["allreduce_cpu_ms"] == pytest.approx(200)


def test_table_and_plot(tmp_path):
    rows = [summarize(Cell("vgg-like", rate, 2, 64), [run(0.5, 0.4 / rate, 1.0, 0.9, 0.95, 0.7)])
            for rate in (0.25, 1.0)]
    table = markdown(rows)
    assert table.count("\n") == 4 and "| vgg-like | 2 | 0.25 | 64 |" in table
    header, separator = table.splitlines()[:2]
    assert header.count("|") == separator.count("|")
    assert plot(rows, tmp_path / "speedup.png").stat().st_size > 5000

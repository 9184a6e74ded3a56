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


def test_parameter_server_bound_is_the_busiest_server_link():
    from commsched.bench import ps_name

    cell = Cell("vgg-like", 1.0, 2, 64, ps_servers=2)
    runs = [run(0.1, 0.4, 1.0, 0.9, 0.95, 0.625)]
    runs[0][ps_name(2)] = {"iteration_times_s": [0.5] * 3, "server_bytes": [30_000_000, 20_000_000]}
    row = summarize(cell, runs)
    # 2 workers push (and pull) the busiest server's 30 MB over 1 Gbit/s links: 0.48 s each way.
    assert row["ps_link_bound_ms"] == pytest.approx(480)
    assert row["ps_bound_ms"] == pytest.approx(480)
    assert row["ps_efficiency"] == pytest.approx(0.48 / 0.5)
    assert row["ps_speedup_vs_ddp"] == pytest.approx(2.0)
    assert row["ps_server_imbalance"] == pytest.approx(1.2)
    table = markdown([row])
    assert "| vgg-like | 2 + 2 | 1 | 500 | 480 (480) | 2.00 | 0.80 | 0.96 | 1.200 |" in table

"""The benchmark's arithmetic: bound, speedups, efficiency, table and plot; systems as JSON."""

from __future__ import annotations

import json

import pytest

from commsched.bench.grid import lineup
from commsched.bench.results import Cell, markdown, plot, summarize
from commsched.bench.systems import UNSCHEDULED, Commsched, ComputeOnly, TorchDDP, TorchFSDP2, decode, encode
from commsched.strategy import ParameterServer, Strategy

COMPUTE, DDP, DDP_BIG = ComputeOnly(), TorchDDP(), TorchDDP(bucket_cap_mb=100)
OFF, OURS = Commsched(UNSCHEDULED, "scheduling off"), Commsched(Strategy())
SYSTEMS = (COMPUTE, DDP, DDP_BIG, OFF, OURS)


def run(compute, allreduce, ddp, ddp_big, off, ours):
    def times(value):
        return {"iteration_times_s": [value] * 3, "cpu_times_s": [value / 2] * 3}

    systems = {COMPUTE: compute, DDP: ddp, DDP_BIG: ddp_big, OFF: off, OURS: ours}
    return {"systems": {system.name: times(value) for system, value in systems.items()}, "allreduce": times(allreduce)}


def test_summary_ratios():
    cell = Cell("vgg-like", 0.25, 2, 64)
    runs = [run(0.5, 0.4, 1.0, 0.9, 0.95, 0.625), run(0.5, 0.4, 1.2, 1.0, 1.1, 0.6)]
    row = summarize(cell, runs, SYSTEMS)
    assert row["bound_ms"] == pytest.approx(500)
    assert row["speedup_vs_ddp"] == pytest.approx((1.0 / 0.625 + 1.2 / 0.6) / 2)
    assert row["speedup_vs_ddp_range"] == pytest.approx([1.6, 2.0])
    assert row["speedup_vs_best_ddp"] == pytest.approx((0.9 / 0.625 + 1.0 / 0.6) / 2)
    assert row["efficiency"] == pytest.approx((0.5 / 0.625 + 0.5 / 0.6) / 2)
    assert row["allreduce_cpu_ms"] == pytest.approx(200)


def test_table_and_plot(tmp_path):
    rows = [summarize(Cell("vgg-like", rate, 2, 64), [run(0.5, 0.4 / rate, 1.0, 0.9, 0.95, 0.7)], SYSTEMS)
            for rate in (0.25, 1.0)]
    table = markdown(rows)
    assert table.count("\n") == 4 and "| vgg-like | 2 | 0.25 | 64 |" in table
    header, separator = table.splitlines()[:2]
    assert header.count("|") == separator.count("|")
    assert plot(rows, tmp_path / "speedup.png").stat().st_size > 5000


def test_parameter_server_bound_is_the_busiest_server_link():
    ps = Commsched(Strategy(backend=ParameterServer(num_servers=2)))
    cell = Cell("vgg-like", 1.0, 2, 64, ps_servers=2)
    runs = [run(0.1, 0.4, 1.0, 0.9, 0.95, 0.625)]
    runs[0]["systems"][ps.name] = {"iteration_times_s": [0.5] * 3, "server_bytes": [30_000_000, 20_000_000]}
    row = summarize(cell, runs, (*SYSTEMS, ps))
    # 2 workers push (and pull) the busiest server's 30 MB over 1 Gbit/s links: 0.48 s each way.
    assert row["ps_link_bound_ms"] == pytest.approx(480)
    assert row["ps_bound_ms"] == pytest.approx(480)
    assert row["ps_efficiency"] == pytest.approx(0.48 / 0.5)
    assert row["ps_speedup_vs_ddp"] == pytest.approx(2.0)
    assert row["ps_server_imbalance"] == pytest.approx(1.2)
    table = markdown([row])
    assert "| vgg-like | 2 + 2 | 1 | 500 | 480 (480) | 2.00 | 0.80 | 0.96 | 1.200 |" in table


def test_display_names():
    assert [s.name for s in lineup(ps_servers=2)] == [
        "compute only", "torch DDP", "torch DDP, bucket_cap_mb=5", "torch DDP, bucket_cap_mb=100",
        "torch DDP, static graph, grad views", "torch DDP, bucket_cap_mb=5, static graph, grad views",
        "torch FSDP2", "commsched, scheduling off", "commsched", "commsched PS, 2 servers",
    ]
    assert TorchDDP(25, static_graph=True).name == "torch DDP, bucket_cap_mb=25, static graph"
    assert TorchFSDP2(reshard_after_forward=True).name == "torch FSDP2, reshard after forward"
    assert Commsched(Strategy(backend=ParameterServer())).name == "commsched PS, 1 server"


def test_systems_round_trip_through_json():
    systems = (*lineup(trace_dir="/tmp/trace", ps_servers=2),
               Commsched(Strategy(backend=ParameterServer(num_servers=3, mode="async", max_staleness=2)), "async"),
               TorchDDP(0.5, gradient_as_bucket_view=True), TorchFSDP2(reshard_after_forward=True))
    decoded = tuple(decode(data) for data in json.loads(json.dumps([encode(s) for s in systems])))
    assert decoded == systems
    assert [type(s) for s in decoded] == [type(s) for s in systems]
    assert decoded[-3].strategy.backend == ParameterServer(num_servers=3, mode="async", max_staleness=2)
    assert decoded[-2] == TorchDDP(0.5, static_graph=False, gradient_as_bucket_view=True)
    assert decoded[-1].reshard_after_forward is True

"""The benchmark's arithmetic: bound, speedups, efficiency, table and plot; systems as JSON."""

from __future__ import annotations

import json

import pytest

from commsched.bench.grid import PS_TRACE_SUBDIR, lineup
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
    assert all(line.endswith("| n/a |") for line in table.splitlines()[2:])  # no CPU figures: not marked
    assert plot(rows, tmp_path / "speedup.png").stat().st_size > 5000

    busy = {"median": 0.91, "p90": 0.97, "cores": 2, "samples": 30, "cores_set_the_pace": True}
    rows[1] = summarize(Cell("vgg-like", 1.0, 2, 64), [run(0.5, 0.4, 1.0, 0.9, 0.95, 0.7) | {"cpu": busy}], SYSTEMS)
    lines = markdown(rows).splitlines()
    assert lines[2].endswith("| n/a |") and lines[3].endswith("| 91% (97%) ! |")
    assert lines[4] == "" and lines[5].startswith("! The machine's 2 cores were at least 85% busy")


def ps_run(*times, ps_s, server_bytes, server_link_s):
    """A run with the parameter-server system and the measured server link ([Note: the measured server link])."""
    ps = Commsched(Strategy(backend=ParameterServer(num_servers=len(server_bytes))))
    result = run(*times)
    result["systems"][ps.name] = {"iteration_times_s": [ps_s] * 3, "server_bytes": server_bytes}
    result["server_link"] = {"iteration_times_s": [server_link_s, server_link_s * 2, server_link_s], "cpu_times_s": []}
    return ps, result


def test_parameter_server_bound_is_the_busiest_server_link_as_measured():
    ps, measured = ps_run(0.1, 0.4, 1.0, 0.9, 0.95, 0.625, ps_s=0.6, server_bytes=[30_000_000, 20_000_000],
                          server_link_s=0.42)
    row = summarize(Cell("vgg-like", 1.0, 2, 64, ps_servers=2), [measured], (*SYSTEMS, ps))
    # 2 workers push (and pull) the busiest server's 30 MB over 1 Gbit/s links: 0.48 s each way at the
    # rate. Measured with even shares of 25 MB: 0.42 s (the median), so 0.504 s for 30 MB.
    assert row["ps_link_bound_ms"] == pytest.approx(480)
    assert row["ps_measured_link_ms"] == pytest.approx(504)
    assert row["ps_bound_ms"] == pytest.approx(504)
    assert row["ps_efficiency"] == pytest.approx(0.504 / 0.6)
    assert row["ps_speedup_vs_ddp"] == pytest.approx(1.0 / 0.6)
    assert row["ps_server_imbalance"] == pytest.approx(1.2)
    table = markdown([row])
    assert "| vgg-like | 2 + 2 | 1 | 600 | 504 (504 / 480) | 1.67 | 0.96 | 0.84 | 1.200 | - |" in table


def test_parameter_server_bound_is_the_computation_where_it_takes_longer():
    ps, measured = ps_run(0.55, 0.4, 1.0, 0.9, 0.95, 0.625, ps_s=0.6, server_bytes=[30_000_000],
                          server_link_s=0.5)
    row = summarize(Cell("vgg-like", 1.0, 2, 64, ps_servers=1), [measured], (*SYSTEMS, ps))
    assert row["ps_measured_link_ms"] == pytest.approx(500)
    assert row["ps_bound_ms"] == pytest.approx(550)


def test_the_input_layer_raises_the_parameter_servers_bound_where_its_push_hides_behind_nothing():
    """The Transformer-like's embedding: pushed once the backward pass ends, through the one server's link."""
    from commsched.bench.models import input_layer_share

    share = input_layer_share("transformer-like")
    ps, measured = ps_run(0.221, 0.175, 0.4, 0.33, 0.35, 0.34, ps_s=0.467, server_bytes=[20_875_000],
                          server_link_s=0.35)
    row = summarize(Cell("transformer-like", 1.0, 2, 16, ps_servers=1), [measured], (*SYSTEMS, ps))
    assert row["ps_link_bound_ms"] == pytest.approx(334)
    assert row["ps_bound_ms"] == pytest.approx(350)
    # The input layer's pushes are priced like the link as measured: 350 ms for what the rate gives 334.
    assert row["ps_input_layer_bound_ms"] == pytest.approx(221 + 350 * share)
    assert row["ps_input_layer_efficiency"] == pytest.approx((0.221 + 0.350 * share) / 0.467)
    assert f"| {221 + 350 * share:.0f} ({(0.221 + 0.350 * share) / 0.467:.2f}) |" in markdown([row])


def test_other_parameter_server_block_sizes_are_compared_with_the_default():
    chosen = lineup(ps_servers=1, ps_block_mb=(1.0, 0.25))
    default, *variants = [s for s in chosen if isinstance(s, Commsched) and s.num_servers]
    assert default.strategy.backend == ParameterServer() and default.label == ""
    assert [(v.label, v.strategy.backend.block_mb) for v in variants] == [("block_mb=1", 1.0), ("block_mb=0.25", 0.25)]
    cell = Cell("vgg-like", 1.0, 2, 64, ps_servers=1)
    runs = []
    for ps_s, big_s, small_s in ((0.5, 0.6, 0.45), (0.5, 0.5, 0.4)):
        runs.append(run(0.1, 0.4, 1.0, 0.9, 0.95, 0.625))
        runs[-1]["systems"].update({
            default.name: {"iteration_times_s": [ps_s] * 3, "server_bytes": [30_000_000]},
            variants[0].name: {"iteration_times_s": [big_s] * 3, "server_bytes": [30_000_000]},
            variants[1].name: {"iteration_times_s": [small_s] * 3, "server_bytes": [30_000_000]},
        })
        runs[-1]["server_link"] = {"iteration_times_s": [0.3] * 3, "cpu_times_s": []}
    row = summarize(cell, runs, (*SYSTEMS, *[s for s in chosen if isinstance(s, Commsched) and s.num_servers]))
    assert row["ps_ms"] == pytest.approx(500)  # the default's, not a variant's
    assert row["ps_variants"]["block_mb=1"] == pytest.approx({"ms": 550, "vs_default": 1.1})
    assert row["ps_variants"]["block_mb=0.25"] == pytest.approx({"ms": 425, "vs_default": 0.85})
    table = markdown([row])
    assert "| vgg-like | 2 + 1 | 1 | 500 | 550 (1.100) | 425 (0.850) |" in table
    assert "block_mb=0.25 ms (time / default's)" in table


def test_display_names():
    assert [s.name for s in lineup(ps_servers=2)] == [
        "compute only", "torch DDP", "torch DDP, bucket_cap_mb=1", "torch DDP, bucket_cap_mb=5",
        "torch DDP, bucket_cap_mb=100",
        "torch DDP, static graph, grad views", "torch DDP, bucket_cap_mb=5, static graph, grad views",
        "torch FSDP2", "commsched, scheduling off", "commsched", "commsched PS, 2 servers",
    ]
    assert TorchDDP(25, static_graph=True).name == "torch DDP, bucket_cap_mb=25, static graph"
    assert TorchFSDP2(reshard_after_forward=True).name == "torch FSDP2, reshard after forward"
    assert Commsched(Strategy(backend=ParameterServer())).name == "commsched PS, 1 server"


def test_trace_goes_to_the_all_reduce_and_parameter_server_systems_apart():
    traced = {s.name: s.strategy.trace_dir for s in lineup(trace_dir="/tmp/trace", ps_servers=1)
              if isinstance(s, Commsched)}
    assert traced == {"commsched, scheduling off": None, "commsched": "/tmp/trace",
                      "commsched PS, 1 server": f"/tmp/trace/{PS_TRACE_SUBDIR}"}
    assert all(s.strategy.trace_dir is None for s in lineup(ps_servers=1) if isinstance(s, Commsched))


def test_systems_round_trip_through_json():
    systems = (*lineup(trace_dir="/tmp/trace", ps_servers=2, ps_block_mb=(0.25,)),
               Commsched(Strategy(backend=ParameterServer(num_servers=3, mode="async", max_staleness=2)), "async"),
               TorchDDP(0.5, gradient_as_bucket_view=True), TorchFSDP2(reshard_after_forward=True))
    decoded = tuple(decode(data) for data in json.loads(json.dumps([encode(s) for s in systems])))
    assert decoded == systems
    assert [type(s) for s in decoded] == [type(s) for s in systems]
    assert decoded[-3].strategy.backend == ParameterServer(num_servers=3, mode="async", max_staleness=2)
    assert decoded[-2] == TorchDDP(0.5, static_graph=False, gradient_as_bucket_view=True)
    assert decoded[-1].reshard_after_forward is True


def test_the_input_layers_reduction_raises_the_bound_where_it_hides_behind_nothing():
    """The Transformer-like's embedding is its first layer and last gradient: at 1 Gbit/s its
    reduction alone takes longer than the gap between compute and a whole all-reduce."""
    from commsched.bench.models import TransformerLike, input_layer_share

    model = TransformerLike()
    share = model.embedding.weight.numel() / sum(p.numel() for p in model.parameters())
    assert input_layer_share("transformer-like") == pytest.approx(share)
    assert input_layer_share("vgg-like") < 0.001  # a first convolution: nothing to speak of

    slow = run(0.228, 0.175, 0.39, 0.34, 0.4, 0.35)
    slow["systems"][OURS.name] |= {"exposed_wait_s": [0.1] * 3, "update_s": [0.003] * 3}
    row = summarize(Cell("transformer-like", 1.0, 2, 16), [slow], SYSTEMS)
    assert row["bound_ms"] == pytest.approx(228)
    assert row["input_layer_ms"] == pytest.approx(175 * share)
    assert row["input_layer_bound_ms"] == pytest.approx(228 + 175 * share)
    assert row["input_layer_efficiency"] == pytest.approx((0.228 + 0.175 * share) / 0.35)
    assert "no schedule beats" in markdown([row])

    fast_compute = run(0.1, 0.4, 0.6, 0.5, 0.55, 0.45)  # the whole all-reduce is the bound
    row = summarize(Cell("transformer-like", 0.25, 2, 16), [fast_compute], SYSTEMS)
    assert row["input_layer_bound_ms"] == pytest.approx(row["bound_ms"])

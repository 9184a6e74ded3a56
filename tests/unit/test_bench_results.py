"""The benchmark's new figures: best DDP over every DDP peer, FSDP2's columns, peak RSS (measured once
per model, hosts and batch), where commsched's time goes, and the settings of --quick and the full grid."""

from __future__ import annotations

import argparse
import math

import pytest

from commsched.bench import grid
from commsched.bench.results import Breakdown, Cell, breakdown, breakdown_line, markdown, summarize
from commsched.bench.systems import UNSCHEDULED, Commsched, ComputeOnly, TorchDDP, TorchFSDP2
from commsched.strategy import Strategy

COMPUTE, DDP, STATIC, FSDP2 = ComputeOnly(), TorchDDP(), TorchDDP(5, True, True), TorchFSDP2()
OFF, OURS = Commsched(UNSCHEDULED, "scheduling off"), Commsched(Strategy())
SYSTEMS = (COMPUTE, DDP, STATIC, FSDP2, OFF, OURS)
TIMES = {COMPUTE: 0.5, DDP: 1.0, STATIC: 0.8, FSDP2: 1.2, OFF: 0.95, OURS: 0.7}


def run(times=TIMES, exposed=(0.01, 0.03), updates=(0.002, 0.004), peaks=None, fsdp2_refused=None,
        drain=(0.09, 0.11)) -> dict:
    systems = {s.name: {"iteration_times_s": [value] * 2, "peak_rss_mib": (peaks or {}).get(s, math.nan)}
               for s, value in times.items()}
    systems[OURS.name] |= {"exposed_wait_s": list(exposed), "update_s": list(updates), "drain_s": list(drain),
                           "partitioning": "the cost model's choice: partitions of 1 MiB"}
    if fsdp2_refused:
        systems[FSDP2.name] = {"iteration_times_s": [], "unavailable": fsdp2_refused}
    return {"systems": systems, "allreduce": {"iteration_times_s": [0.4] * 3, "cpu_times_s": [0.01] * 3}}


CELL = Cell("vgg-like", 0.25, 2, 64)


def test_best_ddp_is_the_fastest_of_every_ddp_peer():
    row = summarize(CELL, [run()], SYSTEMS)
    assert row["ddp_ms"] == pytest.approx(1000)
    assert row["best_ddp_ms"] == pytest.approx(800) and row["best_ddp_system"] == STATIC.name
    assert row["speedup_vs_best_ddp"] == pytest.approx(0.8 / 0.7)


def test_fsdp2_columns():
    row = summarize(CELL, [run(), run({**TIMES, FSDP2: 1.4})], SYSTEMS)
    assert row["fsdp2_ms"] == pytest.approx(1300)
    assert row["speedup_vs_fsdp2"] == pytest.approx((1.2 / 0.7 + 1.4 / 0.7) / 2)
    assert "| FSDP2 ms |" in markdown([row]) and "| 1300 |" in markdown([row])


def test_fsdp2_that_cannot_run_shows_na_and_why():
    reason = "torch FSDP2 cannot train vgg-like: ValueError: shared parameter"
    row = summarize(CELL, [run(fsdp2_refused=reason)], SYSTEMS)
    assert row["fsdp2_ms"] is None and row["speedup_vs_fsdp2"] is None
    assert row["unavailable"] == {FSDP2.name: reason}
    table = markdown([row])
    assert "| 800 | n/a | 950 | 700 |" in table
    assert f"Could not run:\n\n- {reason}" in table


def test_peak_rss_table_has_a_column_per_system():
    peaks = {s: 300.0 + i for i, s in enumerate(SYSTEMS)}
    row = summarize(CELL, [run(peaks=peaks)], SYSTEMS)
    assert row["peak_rss_mib"] == {s.name: value for s, value in peaks.items()}
    lines = markdown([row]).splitlines()
    header = next(line for line in lines if "compute only MiB" in line)
    assert header == "| model | hosts | batch | " + " | ".join(f"{s.name} MiB" for s in SYSTEMS) + " |"
    assert "| vgg-like | 2 | 64 | 300 | 301 | 302 | 303 | 304 | 305 |" in lines


def test_peak_rss_given_by_the_grid_wins_over_the_runs():
    row = summarize(CELL, [run()], SYSTEMS, peak_rss_mib={OURS.name: 123.0})
    assert row["peak_rss_mib"] == {OURS.name: 123.0}
    assert summarize(CELL, [run()], SYSTEMS)["peak_rss_mib"] is None


def test_breakdown_sums_to_the_iteration_time():
    split = Breakdown(total=713, compute=599, exposed=60, updates=20)
    assert split.other == pytest.approx(34)
    assert Breakdown(total=500, compute=520, exposed=10, updates=5).other == pytest.approx(-35)


def test_breakdown_line_from_a_summary():
    row = summarize(CELL, [run(), run(exposed=(0.05, 0.07), updates=(0.006, 0.008))], SYSTEMS)
    split = breakdown(row)
    # medians over repeats of the per-iteration means: exposed (20, 60) -> 40 ms, updates (3, 7) -> 5 ms
    assert (split.total, split.compute, split.exposed, split.updates) == pytest.approx((700, 500, 40, 5))
    assert split.compute + split.exposed + split.updates + split.other == pytest.approx(split.total)
    assert breakdown_line(row) == (
        "vgg-like 2 hosts 0.25 Gbit/s: 700 ms = compute 500 + exposed communication 40 + updates 5 "
        "+ other 155 (dispatch, contention); finishing what is in flight after a round (opt.synchronize(), "
        "not in the time) took 100 ms; partitioning: the cost model's choice: partitions of 1 MiB")
    assert f"- {breakdown_line(row)}" in markdown([row])


def test_the_bound_with_contention_scales_the_plain_bound_by_the_measured_ratio():
    """compute 0.5 s, all-reduce 0.4 s: bound 0.5 s. Started together they took 10% and 30% longer
    than the longer alone in two repeats; commsched took 0.7 s."""
    def measured(together: float) -> dict:
        return {"compute_alone_s": [0.5, 0.5, 0.52], "allreduce_s": [0.4, 0.45, 0.4],
                "together_s": [together * 0.5, together * 0.5, together * 0.52]}

    runs = [run() | {"contention": measured(1.1)}, run() | {"contention": measured(1.3)}]
    row = summarize(CELL, runs, SYSTEMS)
    assert row["contention_ratio"] == pytest.approx(1.2)
    assert row["contended_bound_ms"] == pytest.approx(600)
    assert row["contended_efficiency"] == pytest.approx(0.6 / 0.7)
    assert "| 600 (0.86) |" in markdown([row])
    assert breakdown_line(row).split("; ")[1] == (
        "on these shared cores, compute and one all-reduce started together took 1.20x the longer of the two "
        "alone: the bound with contention is 600 ms (efficiency against it: 0.86)")

    earlier = summarize(CELL, [run()], SYSTEMS)  # runs saved before the measurement existed
    assert earlier["contended_bound_ms"] is None and "| n/a |" in markdown([earlier])
    assert "bound with contention" not in breakdown_line(earlier)


def test_breakdown_line_never_shows_minus_zero():
    row = {"model": "m", "hosts": 2, "rate_gbit": 1.0, "commsched_ms": 100.0, "compute_ms": 90.2,
           "commsched_exposed_ms": 8.0, "commsched_updates_ms": 2.0}
    assert breakdown_line(row).endswith("+ other 0 (dispatch, contention)")


def test_no_breakdown_without_commsched_figures():
    plain = run()
    del plain["systems"][OURS.name]["exposed_wait_s"]
    row = summarize(CELL, [plain], SYSTEMS)
    assert breakdown(row) is None and breakdown_line(row) is None
    assert "exposed communication" not in markdown([row])


def test_cells_where_the_cores_set_the_pace_are_marked():
    """Two repeats with the cores 90% and 95% busy at the median: the cell's 92% is over the threshold."""
    def busy(median: float, p90: float) -> dict:
        return {"median": median, "p90": p90, "cores": 2, "samples": 40, "cores_set_the_pace": median >= 0.85}

    row = summarize(CELL, [run() | {"cpu": busy(0.9, 0.98)}, run() | {"cpu": busy(0.95, 1.0)}], SYSTEMS)
    assert row["cpu_busy_median"] == pytest.approx(0.925) and row["cpu_busy_p90"] == pytest.approx(0.99)
    assert row["cpu_cores"] == 2 and row["cores_set_the_pace"]
    table = markdown([row])
    assert table.splitlines()[0].endswith("| CPU busy (p90) |")
    assert table.splitlines()[2].endswith("| 92% (99%) ! |")
    assert "! The machine's 2 cores were at least 85% busy" in table
    assert "such a cell measures the machine, not the links." in table

    calm = summarize(CELL, [run() | {"cpu": busy(0.6, 0.9)}, run() | {"cpu": busy(0.7, 0.95)}], SYSTEMS)
    assert not calm["cores_set_the_pace"]
    assert markdown([calm]).splitlines()[2].endswith("| 65% (92%) |") and "!" not in markdown([calm])
    # one busy repeat of three does not mark the cell: the median over repeats decides
    mixed = summarize(CELL, [run() | {"cpu": busy(b, 1.0)} for b in (0.5, 0.95, 0.6)], SYSTEMS)
    assert mixed["cpu_busy_median"] == pytest.approx(0.6) and not mixed["cores_set_the_pace"]


def test_runs_without_cpu_figures_still_render():
    """Runs saved before the guard, and runs where /proc/stat could not be read ("cpu": None)."""
    for runs in ([run()], [run() | {"cpu": None}]):
        row = summarize(CELL, runs, SYSTEMS)
        assert row["cpu_busy_median"] is None and not row["cores_set_the_pace"]
        table = markdown([row])
        header, separator, line = table.splitlines()[:3]
        assert line.endswith("| n/a | n/a |")  # no contention measured either
        assert header.count("|") == separator.count("|") == line.count("|")
        assert "!" not in table


def test_each_run_says_where_the_grid_is():
    cell = Cell("vgg-like", 0.25, 2, 64, ps_servers=1)
    assert grid.start_line(2, 6, cell, 0, 3, None) == (
        "cell 2 of 6: vgg-like at 0.25 Gbit/s on 2 hosts + 1 server, repeat 1 of 3")
    assert grid.start_line(6, 6, CELL, 2, 3, 25 * 60 + 10) == (
        "cell 6 of 6: vgg-like at 0.25 Gbit/s on 2 hosts, repeat 3 of 3; about 25 min left")
    assert grid.start_line(1, 1, CELL, 1, 2, 40).endswith("; about 1 min left")
    assert grid.start_line(1, 1, CELL, 1, 2, 5).endswith("; under a minute left")


def settings(*argv: str) -> argparse.Namespace:
    args = grid.build_parser().parse_args(list(argv))
    grid.fill_in_settings(args)
    return args


def test_quick_keeps_its_size_and_takes_hosts_given():
    quick = settings("--quick")
    assert (quick.hosts, quick.rates_gbit, quick.repeats) == ([2], [0.25, 1.0], 1)
    assert len(quick.models) == 3
    assert settings("--quick", "--hosts", "4").hosts == [4]
    assert settings("--quick", "--rounds", "5").rounds == 5
    assert settings().hosts == [2, 4] and settings().repeats == 3


def test_peak_rss_is_measured_once_per_model_hosts_and_batch(tmp_path, monkeypatch, capsys):
    asked = []

    def fake_run_cell(cell, chosen, rounds, iterations, warmup, timeout_s, measure_peak_rss=False):
        asked.append((cell.model, cell.hosts, cell.rate_gbit, measure_peak_rss))
        times = {s: 0.5 + 0.1 * i for i, s in enumerate(chosen)}
        peaks = {s: 100.0 * cell.hosts for s in chosen} if measure_peak_rss else None
        busy = 0.95 if cell.hosts == 4 else 0.5  # four hosts on two cores: the cores set the pace
        return run(times, peaks=peaks) | {"cpu": {"median": busy, "p90": 1.0, "cores": 2, "samples": 9,
                                                  "cores_set_the_pace": busy >= 0.85}}

    monkeypatch.setattr(grid, "run_cell", fake_run_cell)
    cells = [Cell("vgg-like", rate, hosts, 64) for hosts in (2, 4) for rate in (0.25, 1.0)]
    rows = grid.run_grid(cells, tmp_path, rounds=1, iterations=1, warmup=1, repeats=2, timeout_s=1)
    printed = capsys.readouterr().out
    assert "cell 4 of 4: vgg-like at 1 Gbit/s on 4 hosts, repeat 2 of 2" in printed
    assert printed.count("the cores set the pace: 95% of 2 cores") == 4  # every run of the two 4-host cells
    assert [r["cores_set_the_pace"] for r in rows] == [False, False, True, True]
    # on the fastest link of each model, hosts and batch, first repeat only; shared with the slower cells
    assert [a for a in asked if a[3]] == [("vgg-like", 2, 1.0, True), ("vgg-like", 4, 1.0, True)]
    assert len(asked) == 8
    assert [set(r["peak_rss_mib"].values()) for r in rows] == [{200.0}, {200.0}, {400.0}, {400.0}]
    results = (tmp_path / "results.md").read_text()
    assert "torch FSDP2 MiB" in results and "| vgg-like | 2 | 64 | 200 |" in results
    assert "| vgg-like | 4 | 64 | 400 |" in results
    assert results.count("| 95% (100%) ! |") == 2 and results.count("| 50% (100%) |") == 2

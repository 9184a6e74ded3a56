"""The benchmarks' runner (commsched.bench.runner): options, the count refusal, the JSON's one shape,
the runs on emulated hosts (with a stand-in cluster: the real one needs root); and the arithmetic
over repeats (commsched.bench.repeats)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from commsched.bench import cluster, runner
from commsched.bench.repeats import (
    Repeat,
    fastest_cell,
    median_and_each,
    median_s,
    ms_cell,
    ratio_cell,
    ratios,
)


# ------------------------------------------------------------------ options
def test_the_parser_shows_the_docstring_as_written_or_its_first_paragraph():
    doc = "What it asks.\n\n    python it.py --json x.json     # a command\n"
    assert "    python it.py --json x.json" in runner.make_parser(doc).format_help()
    summary = runner.make_parser(doc, summary_only=True).format_help()
    assert "What it asks." in summary and "python it.py" not in summary


def test_the_common_options_keep_their_names_and_take_each_scripts_defaults():
    parser = runner.make_parser(None)
    runner.add_json(parser)
    runner.add_repeats(parser, default=3)
    runner.add_hosts(parser, default=(2, 4))
    runner.add_rate_gbit(parser, default=1.0)
    runner.add_rates_gbit(parser, default=None)
    runner.add_world_sizes(parser, default=(2, 4))
    runner.add_quick(parser, help="a smoke run")
    runner.add_timeout(parser, default=1200.0)
    args = parser.parse_args([])
    assert (args.json, args.repeats, args.hosts, args.rate_gbit, args.rates_gbit, args.world_sizes, args.quick,
            args.timeout_s) == (None, 3, [2, 4], 1.0, None, [2, 4], False, 1200.0)
    args = parser.parse_args(["--json", "out/x.json", "--repeats", "1", "--hosts", "8", "--rates-gbit", "0.25", "1",
                              "--world-sizes", "2", "--quick", "--rate-gbit", "0.5"])
    assert args.json == Path("out/x.json") and args.hosts == [8] and args.rates_gbit == [0.25, 1.0]
    assert args.world_sizes == [2] and args.quick and args.rate_gbit == 0.5 and args.repeats == 1


def test_a_count_below_one_is_refused_before_any_cluster(capsys):
    parser = runner.make_parser(None)
    parser.add_argument("--calibrations", type=int, default=60)
    runner.add_repeats(parser, default=3)
    with pytest.raises(SystemExit):
        runner.refuse_below_one(parser, parser.parse_args(["--calibrations", "0"]), "calibrations")
    assert "--calibrations must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        runner.refuse_below_one(parser, parser.parse_args(["--repeats", "-1"]), "calibrations", "repeats")
    assert "--repeats must be at least 1" in capsys.readouterr().err
    runner.refuse_below_one(parser, parser.parse_args(["--repeats", "1"]), "calibrations", "repeats")


# ------------------------------------------------------------------ emulated hosts
def test_a_machine_without_emulated_hosts_is_told_why(monkeypatch, capsys):
    monkeypatch.setattr(cluster, "unavailable_reason", lambda: "building network namespaces needs root")
    assert runner.cluster_problem("layouts") == 2
    assert capsys.readouterr().err == "layouts: building network namespaces needs root; it needs the emulated cluster\n"
    monkeypatch.setattr(cluster, "unavailable_reason", lambda: None)
    assert runner.cluster_problem("layouts") is None


def test_on_emulated_hosts_shapes_every_link_at_the_rate(monkeypatch):
    seen = {}

    def run(script, hosts, link, config, timeout_s, what, **options):
        seen.update(script=script, hosts=hosts, link=link, config=config, timeout_s=timeout_s, what=what, **options)
        return {"ok": True}

    monkeypatch.setattr(cluster, "run_script_on_hosts", run)
    assert runner.on_emulated_hosts("b.py", 4, 0.25, {"a": 1}, 60.0, "a cell", torchrun=True, port=29541) == {"ok": True}
    assert seen == {"script": "b.py", "hosts": 4, "link": cluster.LinkSpec(rate_mbit=250.0), "config": {"a": 1},
                    "timeout_s": 60.0, "what": "a cell", "torchrun": True, "port": 29541, "sample_cpu": False}


class _Hosts:
    """Stands in for `EmulatedCluster`: every host's process runs here, its argv recorded."""

    argv: list[list[str]] = []

    def __init__(self, num_hosts, link, immediate_acks=True):
        self.num_hosts = num_hosts

    def __enter__(self):
        _Hosts.argv = []
        return self

    def __exit__(self, *exc):
        pass

    def address(self, host):
        return f"10.0.0.{host + 1}"

    def torch_env(self, host, port=29500):
        return {"RANK": str(host), "WORLD_SIZE": str(self.num_hosts), "MASTER_PORT": str(port)}

    def popen(self, host, argv, env=None, **kwargs):
        _Hosts.argv.append(list(argv))
        if "torch.distributed.run" in argv:  # stand in for torchrun: run the worker's part alone
            argv = [sys.executable, *argv[argv.index("--nproc-per-node=1") + 4:]]
        return subprocess.Popen(argv, env={**env, "PATH": "/usr/bin:/bin"}, **kwargs)


WORKER = """import json, os, sys
config, out = sys.argv[sys.argv.index("--worker") + 1:]
if os.environ.get("RANK", "0") == "0":
    open(out, "w").write(json.dumps({"config": json.load(open(config)), "rank": os.environ.get("RANK")}))
"""


@pytest.mark.parametrize("torchrun", [False, True])
def test_run_script_on_hosts_runs_the_worker_on_every_host_and_returns_rank_0s_json(tmp_path, monkeypatch, torchrun):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    monkeypatch.setattr(cluster, "EmulatedCluster", _Hosts)
    result = cluster.run_script_on_hosts(str(script), 2, cluster.LinkSpec(rate_mbit=100), {"model": "mlp"}, 60,
                                         "a cell", torchrun=torchrun, port=29541, sample_cpu=True)
    assert result["config"] == {"model": "mlp"} and "cpu" in result
    assert len(_Hosts.argv) == 2
    if torchrun:
        assert _Hosts.argv[1][1:4] == ["-m", "torch.distributed.run", "--nnodes=2"]
        assert "--node-rank=1" in _Hosts.argv[1] and "--master-port=29541" in _Hosts.argv[1]
    else:
        assert result["rank"] == "0" and _Hosts.argv[0][1] == str(script)
    assert "cpu" not in cluster.run_script_on_hosts(str(script), 1, cluster.LinkSpec(), {}, 60, "a cell")


def test_a_failed_host_says_which_run_and_why(tmp_path, monkeypatch):
    script = tmp_path / "worker.py"
    script.write_text("import sys\nsys.exit('no such model')\n")
    monkeypatch.setattr(cluster, "EmulatedCluster", _Hosts)
    with pytest.raises(RuntimeError, match="a host of a cell exited with 1:\nno such model"):
        cluster.run_script_on_hosts(str(script), 2, cluster.LinkSpec(), {}, 60, "a cell")


# ------------------------------------------------------------------ the JSON
def test_the_commit_is_that_of_the_checkout_or_none(tmp_path):
    assert runner.commit(tmp_path) is None
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a").write_text("a")
    subprocess.run(["git", "-C", str(tmp_path), "add", "a"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=x", "-c", "user.email=x@x", "commit", "-q", "-m",
                    "a"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert runner.commit(tmp_path) == head
    (tmp_path / "a").write_text("b")
    assert runner.commit(tmp_path) == f"{head}-dirty"


def test_the_machine_names_its_cores_and_versions():
    found = runner.machine()
    assert set(found) == {"platform", "cpus", "usable_cpus", "python", "torch", "gpu"}
    assert found["cpus"] >= 1 and found["python"].count(".") == 2


def test_write_json_keeps_one_shape_and_read_rows_reads_it_and_older_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "commit", lambda: "abc1234")
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py", "--json", "out dir/x.json"])
    path = tmp_path / "out" / "x.json"
    runner.write_json(path, [{"ms": 1.5}], part="speed")
    saved = json.loads(path.read_text())
    assert list(saved) == ["command", "commit", "machine", "part", "rows"]
    assert saved["command"] == "benchmarks/x.py --json 'out dir/x.json'" and saved["commit"] == "abc1234"
    assert saved["rows"] == [{"ms": 1.5}] and saved["part"] == "speed"
    assert runner.read_rows(path) == [{"ms": 1.5}]
    older = tmp_path / "older.json"
    older.write_text(json.dumps({"iterations": [1], "rows": "theirs"}))
    assert runner.read_rows(older) == {"iterations": [1], "rows": "theirs"}
    runner.write_json(None, [1])  # no --json: nothing written


# ------------------------------------------------------------------ repeats
def test_a_repeat_gives_the_fastest_and_the_ratios_within_it():
    r = Repeat.of({"ddp 5": [0.09, 0.07, 0.2], "ddp 25": [0.1], "ours": [0.099, 0.2, 0.05]})
    assert r.medians_s == {"ddp 5": 0.09, "ddp 25": 0.1, "ours": 0.099}
    assert r.fastest(["ddp 5", "ddp 25"]) == "ddp 5" and r.fastest(["ddp 25"]) == "ddp 25"
    assert r.ratio("ours", "ddp 25") == pytest.approx(0.99)
    assert r.ratio("ours", ["ddp 25", "ddp 5"]) == pytest.approx(1.1)


def test_medians_over_repeats_and_the_cells_of_a_table():
    repeats = [Repeat({"a": 0.1, "b": 0.2, "c": 0.3}), Repeat({"a": 0.3, "b": 0.2, "c": 0.1}),
               Repeat({"a": 0.2, "b": 0.5, "c": 0.4})]
    assert median_s(repeats, "a") == pytest.approx(0.2)
    assert ratios(repeats, "a", "b") == pytest.approx([0.5, 1.5, 0.4])
    assert ratios(repeats, "a", ["b", "c"]) == pytest.approx([0.5, 3.0, 0.5])
    assert ms_cell(repeats, "b") == "200.0"
    assert fastest_cell(repeats, ["b", "c"], str.upper) == "200.0 (B C C)"  # fastest: 200, 100, 400 ms
    assert ratio_cell(repeats, "a", "b") == "0.500 (0.500 1.500 0.400)"


def test_median_and_each_shows_every_repeat():
    assert median_and_each([0.99, 0.8, 0.5]) == "0.800 (0.990 0.800 0.500)"
    assert median_and_each([1.0, 1.25], spec=".2f", sep=", ") == "1.12 (1.00, 1.25)"

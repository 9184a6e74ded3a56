"""The ``commsched`` command as a user runs it.

Each command is a process of its own that spends a second or more importing torch, and
the tests' commands do not depend on each other's: they all start when the first test
that runs one needs it (`commands`), two at a time, and each test checks its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

COMMANDS: dict[str, Callable[[Path], object]] = {}
"""What each test runs, by name: a function of a directory of its own, returning what the test checks."""

AT_ONCE = 2
"""Commands running together: about one per core (each is mostly a single-threaded import)."""

LONGEST = {"test_a_saved_profile_gives_the_same_table", "test_demo_prints_both_systems_with_equal_losses",
           "test_an_import_path_and_a_torchvision_name_build_the_model",
           "test_plan_refuses_in_one_line_with_exit_code_2[another version]"}


def runs(name: str):
    """Register ``fn`` as what test ``name`` runs (see `commands`)."""
    def register(fn):
        COMMANDS[name] = fn
        return fn
    return register


@pytest.fixture(scope="module")
def commands(request, tmp_path_factory):
    """Every selected test's commands, started together; ``commands[name].result()`` waits for test ``name``'s."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    wanted = [name for name in COMMANDS if name.split("[")[0] in selected]
    wanted.sort(key=lambda name: name not in LONGEST)  # the longest first: the two workers end together
    pool = ThreadPoolExecutor(max_workers=AT_ONCE)
    started: dict[str, Future] = {name: pool.submit(COMMANDS[name], tmp_path_factory.mktemp("cli")) for name in wanted}
    yield started
    pool.shutdown(wait=True, cancel_futures=True)


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "commsched.cli", *args],
        capture_output=True, text=True, timeout=timeout,
    )


@runs("test_demo_prints_both_systems_with_equal_losses")
def demo(tmp_path):
    return run_cli("demo", "--iterations", "3", "--rounds", "2", "--warmup", "1", "--no-progress")


@pytest.mark.distributed
def test_demo_prints_both_systems_with_equal_losses(commands):
    done = commands["test_demo_prints_both_systems_with_equal_losses"].result()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch DDP" in done.stdout and "commsched" in done.stdout and "commsched PS, 1 server" in done.stdout
    assert "losses agree to 4 decimals: yes" in done.stdout


BAD_ARGUMENTS = [
    (["demo", "--world-size", "0"], "--world-size must be at least 1"),
    (["demo", "--ps-servers", "-1"], "--ps-servers must be at least 0"),
    (["demo", "--workload", "nope"], "invalid choice"),
    (["demo", "--bucket-cap-mb", "-1"], "Strategy.bucket_cap_mb must be finite and greater than 0"),
    (["bench", "--ps-servers", "0", "--ps-block-mb", "0.25"], "give --ps-servers 1 or more"),
    (["bench", "--ps-block-mb", "0"], "--ps-block-mb: ParameterServer.block_mb must be None or finite"),
]
for _args, _ in BAD_ARGUMENTS:
    runs(f"test_bad_arguments_say_what_to_change[{' '.join(_args)}]")(
        lambda tmp_path, args=_args: run_cli(*args, timeout=60))


@pytest.mark.parametrize("args, message", BAD_ARGUMENTS)
def test_bad_arguments_say_what_to_change(commands, args, message):
    done = commands[f"test_bad_arguments_say_what_to_change[{' '.join(args)}]"].result()
    assert done.returncode != 0
    assert message in done.stderr


# ------------------------------------------------------------------ commsched plan
PLAN_CELLS = ["--workers", "2", "8", "--gbit", "1", "10"]
ROW = re.compile(r"^[│|\s]*(\d+)[│|\s]+(\d+(?:\.\d+)?)[│|\s]+\d+\.\d+[│|\s]")


def run_plan(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "commsched.cli", "plan", *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )


def table_rows(stdout: str) -> dict[tuple[int, float], str]:
    rows = {}
    for line in stdout.splitlines():
        match = ROW.match(line)
        if match:
            rows[(int(match[1]), float(match[2]))] = line
    return rows


@runs("test_plan_prints_a_row_per_cell_each_with_a_strategy")
def plan_rows(tmp_path):
    return run_plan("demo-mlp", "--iterations", "2", *PLAN_CELLS)


def test_plan_prints_a_row_per_cell_each_with_a_strategy(commands):
    done = commands["test_plan_prints_a_row_per_cell_each_with_a_strategy"].result()
    assert done.returncode == 0, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    assert set(rows) == {(2, 1.0), (2, 10.0), (8, 1.0), (8, 10.0)}, done.stdout
    assert all("Strategy(" in line for line in rows.values()), done.stdout
    assert "demo-mlp on cpu, batch 32 per worker" in done.stdout


@runs("test_a_saved_profile_gives_the_same_table")
def saved_profile(tmp_path):
    path, png = tmp_path / "demo.json", tmp_path / "speedup.png"
    saved = run_plan("demo-mlp", "--iterations", "2", "--save-profile", str(path), *PLAN_CELLS)
    if saved.returncode != 0:
        return saved, None, None, png
    loaded = run_plan("--profile", str(path), "--plot", str(png), *PLAN_CELLS)
    faster = run_plan("--profile", str(path), "--compute-scale", "0.5", *PLAN_CELLS)
    return saved, loaded, faster, png


def test_a_saved_profile_gives_the_same_table(commands):
    saved, loaded, faster, png = commands["test_a_saved_profile_gives_the_same_table"].result()
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    table = [line for line in saved.stdout.splitlines() if not line.startswith("saved the profile to")]
    assert [line for line in loaded.stdout.splitlines() if not line.startswith("plot: ")] == table
    assert len(table_rows(loaded.stdout)) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert faster.returncode == 0 and "compute times x0.5" in faster.stdout
    assert table_rows(faster.stdout) != table_rows(loaded.stdout)


@runs("test_an_import_path_and_a_torchvision_name_build_the_model")
def built_models(tmp_path):
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text("from torchvision import models\n")
    (tmp_path / "torchvision" / "models.py").write_text(
        "import torch\n"
        "def list_models():\n    return ['tinynet']\n"
        "def get_model(name, weights=None):\n"
        "    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(7))\n"
    )
    (tmp_path / "mymodels.py").write_text(
        "import torch\ndef conv():\n    return torch.nn.Conv2d(2, 3, 3)\n"  # a 4-D output: mean-square loss
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    args = ("--batch-size", "2", "--iterations", "1", "--workers", "2", "--gbit", "1")
    tv = run_plan("tinynet", "--input-shape", "3", "8", "8", *args, env=env)
    # As the installed `commsched` script runs: the working directory is not on sys.path by itself (-P).
    imported = subprocess.run(
        [sys.executable, "-P", "-m", "commsched.cli", "plan", "mymodels:conv", "--input-shape", "2", "5", "5", *args],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    return tv, imported


def test_an_import_path_and_a_torchvision_name_build_the_model(commands):
    tv, imported = commands["test_an_import_path_and_a_torchvision_name_build_the_model"].result()
    assert tv.returncode == 0, tv.stdout + tv.stderr
    assert "tinynet on cpu, batch 2 per worker" in tv.stdout and len(table_rows(tv.stdout)) == 1
    assert imported.returncode == 0, imported.stdout + imported.stderr
    assert "mymodels:conv on cpu" in imported.stdout and len(table_rows(imported.stdout)) == 1


def missing_torchvision(tmp_path) -> dict:
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text("raise ImportError(\"No module named 'torchvision'\")\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}


def other_version(tmp_path) -> str:
    path = tmp_path / "old.json"
    saved = run_plan("demo-mlp", "--iterations", "1", "--save-profile", str(path), "--workers", "2", "--gbit", "1")
    assert saved.returncode == 0, saved.stderr
    data = json.loads(path.read_text())
    data["version"] = 0
    path.write_text(json.dumps(data))
    return str(path)


PLAN_REFUSALS = {
    "torchvision missing": "torchvision, which would build it, is not installed: pip install torchvision==",
    "unknown name with torchvision": "unknown model 'nope'",
    "bad import path": "cannot import 'no_such_package.models'",
    "no factory": "commsched.bench.models has no 'nope'",
    "another version": "this profile has format version 0",
    "no model": "give MODEL to measure, or --profile FILE",
    "bad workers": "--workers must all be at least 1",
    "bad in-flight": "--in-flight must be at least 1",
}
"""What ``commsched plan`` refuses, and what its one line must say."""


def plan_refusal(tmp_path, case):
    env = None
    if case == "torchvision missing":
        args, env = ["nope"], missing_torchvision(tmp_path)
    elif case == "unknown name with torchvision":
        (tmp_path / "torchvision").mkdir()
        (tmp_path / "torchvision" / "__init__.py").write_text("from torchvision import models\n")
        (tmp_path / "torchvision" / "models.py").write_text("def list_models():\n    return ['resnet50']\n")
        args, env = ["nope"], {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    elif case == "bad import path":
        args = ["no_such_package.models:make"]
    elif case == "no factory":
        args = ["commsched.bench.models:nope", "--input-shape", "8"]
    elif case == "another version":
        args = ["--profile", other_version(tmp_path)]
    elif case == "no model":
        args = []
    elif case == "bad in-flight":
        args = ["demo-mlp", "--in-flight", "0"]
    else:
        args = ["demo-mlp", "--workers", "0"]
    return run_plan(*args, env=env)


for _case in PLAN_REFUSALS:
    runs(f"test_plan_refuses_in_one_line_with_exit_code_2[{_case}]")(
        lambda tmp_path, case=_case: plan_refusal(tmp_path, case))


@pytest.mark.parametrize("case", list(PLAN_REFUSALS))
def test_plan_refuses_in_one_line_with_exit_code_2(commands, case):
    done = commands[f"test_plan_refuses_in_one_line_with_exit_code_2[{case}]"].result()
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("commsched plan: ") and done.stderr.count("\n") == 1, done.stderr
    assert PLAN_REFUSALS[case] in done.stderr, done.stderr


def test_the_recommended_strategy_names_only_what_differs():
    from commsched.bench.plan_output import strategy_code
    from commsched.strategy import ParameterServer, Strategy

    assert strategy_code(Strategy()) == "Strategy()"
    # Buckets are capped at the partition size: a bucket cap above it changes nothing and is left out.
    assert strategy_code(Strategy(partition_mb=2.0, credit_mb=8.0, bucket_cap_mb=5.0, adaptive=False)) == (
        "Strategy(partition_mb=2, credit_mb=8, adaptive=False)")
    assert strategy_code(Strategy(partition_mb=None, credit_mb=0.5, bucket_cap_mb=5.0)) == (
        "Strategy(bucket_cap_mb=5, partition_mb=None, credit_mb=0.5)")
    assert strategy_code(Strategy(backend=ParameterServer(num_servers=2))) == (
        "Strategy(backend=ParameterServer(num_servers=2))")


def test_the_torchvision_release_for_a_torch_release():
    from commsched.bench.plan import torchvision_version

    assert torchvision_version("2.13.0+cpu") == "0.28.0"
    assert torchvision_version("2.4.1") == "0.19.1"


def test_a_measured_link_carries_its_host_cost_and_slowdown_into_every_cluster():
    from commsched.bench.plan import cluster_for, plan
    from commsched.profiling.profile import LinkProfile, LinkSample, ParameterProfile, Profile

    link = LinkProfile(world_size=2, samples=(LinkSample(2**16, 1e-3), LinkSample(2**20, 2e-3)),
                       latency_s=1e-3, bytes_per_s=1e9, compute_slowdown=0.25, in_flight=2)
    profile = Profile("p", "cpu", 8, 1e-3, 2e-3, 1e-4, (ParameterProfile("w", 2**18, 4, 0.0, 2e-3),), link=link)
    cluster = cluster_for(profile, 16, 10.0, 25e-6, "ring", 0)
    assert (cluster.workers, cluster.gbit_s, cluster.compute_slowdown, cluster.in_flight) == (16, 10.0, 0.25, 2)
    assert cluster_for(profile, 16, 10.0, 25e-6, "ring", 0, in_flight=1).in_flight == 1
    assert cluster.host_overhead_s == pytest.approx(1e-3 - 2 * 25e-6)
    plain = cluster_for(profile.with_link(None), 16, 10.0, 25e-6, "ring", 0)
    assert (plain.compute_slowdown, plain.host_overhead_s, plain.in_flight) == (0.0, 0.0, 1)
    assert cluster_for(profile.with_link(None), 16, 10.0, 25e-6, "ring", 0, in_flight=2).in_flight == 2
    assert not cluster.all_to_all and cluster_for(profile, 16, 10.0, 25e-6, "ring", 0, all_to_all=True).all_to_all
    slower, faster = plan(profile, [16], [10.0]), plan(profile.with_link(None), [16], [10.0])
    assert slower[0].ddp_s > faster[0].ddp_s

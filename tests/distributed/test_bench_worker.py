"""One host's part of a ``commsched bench`` cell, as torchrun starts it, on loopback: the peak RSS
of every system measured in forked children first, then the comparison; summarized into the
tables and the time breakdown."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest

from commsched.bench.grid import cell_spec
from commsched.bench.results import Cell, breakdown_line, markdown, summarize
from commsched.bench.systems import UNSCHEDULED, Commsched, ComputeOnly, TorchDDP, TorchFSDP2
from commsched.strategy import ParameterServer, Strategy

pytestmark = pytest.mark.distributed

CELL = Cell("demo-mlp", rate_gbit=1.0, hosts=2, batch_size=8, ps_servers=1)
CHOSEN = (ComputeOnly(), TorchDDP(), TorchDDP(static_graph=True, gradient_as_bucket_view=True), TorchFSDP2(),
          Commsched(UNSCHEDULED, "scheduling off"), Commsched(Strategy()),
          Commsched(Strategy(backend=ParameterServer(num_servers=1))))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """One run of the cell: 2 workers and 1 server, each a process started by torchrun."""
    tmp = tmp_path_factory.mktemp("cell")
    config, out = tmp / "config.json", tmp / "out.json"
    config.write_text(json.dumps(cell_spec(CELL, CHOSEN, rounds=2, iterations=2, warmup=4, measure_peak_rss=True)))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=3",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}",
            "-m", "commsched.bench.grid", "--worker", str(config), str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_system_has_its_peak_rss(run):
    peaks = {name: result["peak_rss_mib"] for name, result in run["systems"].items()}
    assert set(peaks) == {system.name for system in CHOSEN}
    assert all(math.isfinite(peak) and peak > 0 for peak in peaks.values()), peaks


def test_summary_has_the_new_columns_and_the_breakdown(run):
    row = summarize(CELL, [run], CHOSEN)
    assert row["fsdp2_ms"] > 0 and row["speedup_vs_fsdp2"] > 0
    assert row["peak_rss_mib"] == {name: result["peak_rss_mib"] for name, result in run["systems"].items()}
    assert row["commsched_exposed_ms"] >= 0 and row["commsched_updates_ms"] >= 0
    assert breakdown_line(row).startswith(f"demo-mlp 2 hosts 1 Gbit/s: {round(row['commsched_ms'])} ms = compute ")
    table = markdown([row])
    assert "| FSDP2 ms |" in table and "| torch FSDP2 MiB |" in table and "exposed communication" in table
    assert run["phases_s"]["peak_rss"] > 0 and run["phases_s"]["comparison"] > 0

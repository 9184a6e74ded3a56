"""The emulated cluster: shaped links, real training across namespaces, tear-down."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import commsched
from commsched.bench.cluster import EmulatedCluster, LinkSpec, unavailable_reason

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"emulated cluster: {unavailable_reason()}"),
]

RECEIVER = """
import socket
server = socket.create_server(("0.0.0.0", 5001))
connection, _ = server.accept()
while connection.recv(1 << 20):
    pass
connection.sendall(b"x")
"""

SENDER = """
import socket, sys, time
deadline = time.monotonic() + 20
while True:  # the receiver may not be listening yet
    try:
        connection = socket.create_connection((sys.argv[1], 5001), timeout=30)
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
payload = b"x" * (1 << 20)
start = time.perf_counter()
for _ in range(int(sys.argv[2])):
    connection.sendall(payload)
connection.shutdown(socket.SHUT_WR)
connection.recv(1)
print(int(sys.argv[2]) * 8 * 2**20 / 1e6 / (time.perf_counter() - start))
"""

TRAINER = """
import torch, torch.distributed as dist, torch.nn.functional as F
import commsched
from commsched.testing.models import ParityNet
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())  # different initial weights: prepare() must unify them
model = ParityNet()
model, optimizer = commsched.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
generator = torch.Generator().manual_seed(dist.get_rank())
for _ in range(6):
    F.mse_loss(model(torch.randn(8, 8, generator=generator)), torch.randn(8, 4, generator=generator)).backward()
    optimizer.step()
    optimizer.zero_grad()
optimizer.synchronize()
for name, p in model.named_parameters():
    copies = [torch.empty_like(p) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, p.detach())
    assert all(torch.equal(c, copies[0]) for c in copies), name
dist.destroy_process_group()
print("ok")
"""


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def sysctl(key: str, namespace: str | None = None) -> str:
    inside = ["ip", "netns", "exec", namespace] if namespace else []
    return subprocess.run([*inside, "sysctl", "-n", key], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(not Path("/proc/sys/net/ipv4/tcp_autocorking").exists(), reason="this kernel has no autocorking")
def test_hosts_send_without_tcp_autocorking_and_leave_the_machine_alone():
    outside = sysctl("net.ipv4.tcp_autocorking")
    with EmulatedCluster(2, LinkSpec(rate_mbit=100)) as cluster:
        assert [sysctl("net.ipv4.tcp_autocorking", host) for host in cluster.hosts] == ["0", "0"]
    assert sysctl("net.ipv4.tcp_autocorking") == outside


@pytest.mark.parametrize("immediate", [True, False])
def test_hosts_acknowledge_at_once_unless_asked_not_to(immediate):
    """Every host's route to the others carries ``quickack`` (see [Note: immediate ACKs on the
    emulated hosts]), but where a benchmark measures delayed ACKs; the tests that train across the
    hosts show they still reach each other."""
    with EmulatedCluster(2, LinkSpec(rate_mbit=100), immediate_acks=immediate) as cluster:
        for host in cluster.hosts:
            routes = subprocess.run(["ip", "-n", host, "route"], capture_output=True, text=True, check=True).stdout
            assert f"{cluster.address(0).rsplit('.', 1)[0]}.0/24 dev eth0" in routes, routes
            assert ("quickack 1" in routes) == immediate, routes


def test_tear_down_also_on_error():
    with pytest.raises(RuntimeError, match="inside the block"):
        with EmulatedCluster(2, LinkSpec(rate_mbit=100)) as cluster:
            names = [cluster.switch, *cluster.hosts]
            assert all(name in namespaces() for name in names)
            raise RuntimeError("inside the block")
    assert not any(name in namespaces() for name in names)


def test_link_is_shaped_to_its_rate():
    with EmulatedCluster(2, LinkSpec(rate_mbit=40)) as cluster:
        receiver = cluster.popen(1, [sys.executable, "-c", RECEIVER])
        sender = cluster.popen(0, [sys.executable, "-c", SENDER, cluster.address(1), "4"],
                               stdout=subprocess.PIPE, text=True)
        out, _ = sender.communicate(timeout=60)
        receiver.wait(timeout=10)
    mbit_per_s = float(out)
    assert 20 < mbit_per_s < 44, f"measured {mbit_per_s:.1f} Mbit/s on a 40 Mbit/s link"


def test_commsched_trains_across_hosts():
    with EmulatedCluster(2, LinkSpec(rate_mbit=200)) as cluster:
        procs = [cluster.popen(h, [sys.executable, "-c", TRAINER], cluster.torch_env(h, port=29611),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in range(2)]
        outputs = [p.communicate(timeout=120) for p in procs]
    for host, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and out.strip() == "ok", (
            f"host {host} exited with {proc.returncode}\nstdout: {out[-500:]}\nstderr: {err[-3000:]}")


def test_bench_runs_one_cell_with_torchrun_on_every_host():
    from commsched.bench.grid import Cell, lineup, run_cell, summarize
    from commsched.bench.systems import Commsched, ComputeOnly

    cell = Cell("resnet-like", rate_gbit=1.0, hosts=2, batch_size=2, ps_servers=1)
    # The default commsched without its cost model's choice: measuring that choice would make every
    # system warm up 29 iterations (`warmup_of`); tests/distributed/test_bench_worker.py runs it whole.
    chosen = tuple(Commsched(commsched.Strategy(adaptive=False)) if system == Commsched(commsched.Strategy())
                   else system for system in lineup(ps_servers=1))
    result = run_cell(cell, chosen, rounds=1, iterations=1, warmup=1, timeout_s=300, port=29622)
    assert {s.name for s in chosen} <= set(result["systems"]) and ComputeOnly().name in result["systems"]
    row = summarize(cell, [result], chosen)
    assert row["bound_ms"] > 0 and row["commsched_ms"] > 0 and row["ps_ms"] > 0 and row["ps_bound_ms"] > 0
    # [Note: the measured server link]: the bytes crossed the shaped link (its burst aside, no faster than its rate).
    assert row["ps_measured_link_ms"] > 0.9 * row["ps_link_bound_ms"]

"""Faults on the emulated cluster: a killed host and a cut link.

Three hosts (network namespaces) train with the default Strategy (a short
``timeout_s``). Mid-training one host's process is killed (SIGKILL), or one
host's link is cut (no error reaches anyone: its connections stay open and
silent). Every survivor must raise a `CommunicationTimeout` naming the lost
rank within ``timeout_s`` + 5 s of the fault, and every process must exit.
The job's store runs in a process of its own on host 0, as torchrun's agent
hosts it there, so it outlives the ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from commsched.bench.cluster import EmulatedCluster, LinkSpec, unavailable_reason

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"emulated cluster: {unavailable_reason()}"),
]

HOSTS = 3
TIMEOUT_S = 5.0
NOTICE_WITHIN_S = TIMEOUT_S + 5.0
EXIT_WITHIN_S = 30.0
"""Ending on its own, instead of after the group's timeout (30 minutes): 1-4 s on an idle machine,
14.5 s once on a loaded 2-core one. A rank slower than `SLOW_EXIT_S` prints where its threads are."""
SLOW_EXIT_S = 5.0
PORT = 29633

STORE = """
import sys, torch.distributed as dist
store = dist.TCPStore("0.0.0.0", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("LISTENING", flush=True)
sys.stdin.read()  # until the test closes it
"""

TRAINER = """
import faulthandler, sys, time, torch, torch.distributed as dist, torch.nn.functional as F
import commsched
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
model, optimizer = commsched.prepare(model, optimizer, commsched.Strategy(timeout_s=float(sys.argv[1])))
generator = torch.Generator().manual_seed(rank)
try:
    for iteration in range(10**7):
        if iteration == 10:  # past warm-up and the plan's agreement
            print("TRAINING", flush=True)
        F.mse_loss(model(torch.randn(8, 32, generator=generator)), torch.zeros(8, 4)).backward()
        optimizer.step()
        optimizer.zero_grad()
except commsched.CommunicationTimeout as error:
    print("ERROR", repr(time.time()), str(error).replace("\\n", " "), flush=True)
    faulthandler.dump_traceback_later(float(sys.argv[2]), file=sys.stdout)  # an exit slower than that: where
    raise
"""


class Host:
    """One rank's process and what it printed."""

    def __init__(self, process: subprocess.Popen):
        self.process = process
        self.lines: list[str] = []
        self.exited_at: float | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def printed(self, word: str) -> str | None:
        return next((line for line in list(self.lines) if line.startswith(word)), None)

    def error(self) -> tuple[float, str] | None:
        line = self.printed("ERROR ")
        if line is None:
            return None
        _, at, message = line.split(" ", 2)
        return float(at), message

    def log(self) -> str:
        return "".join(self.lines)[-4000:]


def run_fault(fault: str, lost: int) -> tuple[float, list[Host]]:
    """Train on three hosts, inflict ``fault`` on host ``lost``; return when it happened and the
    hosts once every one has exited (or been killed after waiting long enough)."""
    with EmulatedCluster(HOSTS, LinkSpec(), tag=f"f{fault[0]}{os.getpid() % 10000}") as cluster:
        store = cluster.popen(0, [sys.executable, "-c", STORE, str(PORT)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
        hosts: list[Host] = []
        try:
            assert store.stdout.readline().strip() == "LISTENING"
            for h in range(HOSTS):
                env = {**cluster.torch_env(h, port=PORT), "TORCHELASTIC_USE_AGENT_STORE": "True"}
                hosts.append(Host(cluster.popen(h, [sys.executable, "-c", TRAINER, str(TIMEOUT_S), str(SLOW_EXIT_S)], env,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
            _wait_for(lambda: all(host.printed("TRAINING") for host in hosts)
                      or any(host.process.poll() is not None for host in hosts), 180)
            assert all(host.printed("TRAINING") for host in hosts), [host.log() for host in hosts]
            fault_at = time.time()
            if fault == "kill":
                hosts[lost].process.kill()
            else:
                cluster.cut_link(lost)

            def settled() -> bool:
                for host in hosts:
                    if host.exited_at is None and host.process.poll() is not None:
                        host.exited_at = time.time()
                return all(host.exited_at is not None for host in hosts)

            _wait_for(settled, NOTICE_WITHIN_S + EXIT_WITHIN_S + 10)
        finally:
            for process in [host.process for host in hosts] + [store]:
                if process.poll() is None:
                    process.kill()
                process.wait(timeout=30)
    return fault_at, hosts


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def check_survivors(fault_at: float, hosts: list[Host], lost: int) -> None:
    checked = 0
    for rank, host in enumerate(hosts):
        if rank == lost:
            continue
        checked += 1
        error = host.error()
        assert error is not None, f"rank {rank} raised no CommunicationTimeout:\n{host.log()}"
        at, message = error
        assert at - fault_at < NOTICE_WITHIN_S, f"rank {rank} took {at - fault_at:.1f} s to notice: {message}"
        assert f"Rank {lost} stopped responding" in message, f"rank {rank} did not name rank {lost}: {message}"
        assert host.exited_at is not None and host.exited_at - at < EXIT_WITHIN_S, (
            f"rank {rank} got its error, then did not exit within {EXIT_WITHIN_S:g} s:\n{host.log()}")
        # 1: the error ended the script; rarely a signal at exit (see test_exit.py), promptly all the same.
        assert host.process.returncode in (1, -signal.SIGSEGV, -signal.SIGABRT), (
            f"rank {rank} exited with {host.process.returncode}:\n{host.log()}")
    assert checked == HOSTS - 1, f"{checked} survivors checked of {HOSTS - 1}"


def test_a_killed_host_is_named_by_every_survivor():
    fault_at, hosts = run_fault("kill", lost=1)
    check_survivors(fault_at, hosts, lost=1)


def test_a_cut_link_is_named_by_every_survivor_and_the_cut_host_ends_too():
    fault_at, hosts = run_fault("cut", lost=2)
    check_survivors(fault_at, hosts, lost=2)
    cut = hosts[2]
    error = cut.error()
    assert error is not None, f"the cut-off rank raised no CommunicationTimeout:\n{cut.log()}"
    at, message = error
    assert "cannot reach the job's store" in message, message
    assert cut.exited_at is not None and cut.exited_at - at < EXIT_WITHIN_S, cut.log()

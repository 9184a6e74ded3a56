"""An emulated cluster on one machine: hosts as network namespaces with shaped links.

Each host is a network namespace with one interface, ``eth0``, cabled by a veth
pair to a bridge that lives in a namespace of its own (the switch), so nothing
outside the namespaces is touched. Both directions of every host's link are
shaped with ``tc`` (``tbf`` for the rate; ``netem`` for delay and loss, where
the kernel has it): the host's egress on ``eth0`` and the switch's egress
towards the host. `EmulatedCluster.cut_link` cuts a host off, for fault tests.
Needs root and iproute2.

    with EmulatedCluster(2, LinkSpec(rate_mbit=250)) as cluster:
        procs = [cluster.popen(i, [sys.executable, "train.py"], cluster.torch_env(i)) for i in range(2)]

Tear-down always runs: on leaving the ``with`` block, on an exception, on
Ctrl-C, and on SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from commsched.bench.cpu_guard import CpuSampler

PREFIX = "csx"
SUBNET = "10.213.7"
"""Addresses exist only inside the namespaces this module creates."""


HOST_SYSCTLS = {"net.ipv4.tcp_autocorking": "0"}
"""Set in every host's namespace: see [Note: no TCP autocorking on the emulated hosts].

[Note: no TCP autocorking on the emulated hosts] Linux holds back a small write
to a TCP socket while the socket's earlier packets are still queued below it
(autocorking), to send both in one packet. On an emulated host those packets wait
in ``tbf``'s queue, where a real link's NIC would be sending them. gloo's ring
sends each step of an all-reduce as a few writes, and at 8 hosts and 0.5 Gbit/s
an all-reduce of 1.0 or 1.01 MiB took 55-81 ms (medians of 10-12 in 15 sets of
16; single ones up to 157), against 29-31 ms for 0.99 MiB and 34-36 ms for 1.05 MiB, with no TCP
retransmission; with autocorking off, 1.0 MiB took 34-36 ms. Turning off
slow start after idle, or larger socket buffers, changed nothing. The emulated
links are meant to have a rate, not this, so every host turns it off.
"""


HOST_ROUTE_OPTIONS = ("quickack", "1")
"""Set on every host's route to the others: see [Note: immediate ACKs on the emulated hosts].

[Note: immediate ACKs on the emulated hosts] Linux delays the ACK of a
segment by up to 40 ms in the hope of sending it with data. Among 4 emulated
hosts at 0.5 Gbit/s, with ``tbf`` queueing each host's packets, 21-22 of 290
all-reduces of 0.5 MiB took more than twice their median of 13 ms, up to
96-112 ms (one rank's part done, the others' 40 ms or more later), and an
iteration whose collective met one lost that much: commsched's iterations in
the VGG16 cell spread from 226 to 409 ms around a median of 235-259. With every
host's route acknowledging at once, 0-1 of 290 did, the longest 22-30 ms
(docs/records/2026-11-28-emulated-hosts-tcp.md). Among 2 hosts delayed ACKs cost
1-3 stalls of 17-23 ms in 290; among 8, none, and acknowledging at once makes the median
all-reduce of 0.5 MiB slower there (28 ms against 24: twice the ACK packets, on
two cores for eight hosts). The emulated links are meant to have a rate, not
100 ms stalls, so every host's route acknowledges at once (a route option, gone
with the namespace).
"""


class ClusterUnavailable(RuntimeError):
    """This machine cannot build namespaces (no root, or no iproute2)."""


@dataclass(frozen=True)
class LinkSpec:
    """One host's link to the switch, in each direction."""

    rate_mbit: float | None = None
    """Bandwidth in Mbit/s; None leaves it unshaped."""
    delay_ms: float = 0.0
    """One-way delay added in each direction."""
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"LinkSpec.rate_mbit must be > 0 or None, got {self.rate_mbit!r}")
        if self.delay_ms < 0 or not 0 <= self.loss_pct < 100:
            raise ValueError(f"LinkSpec needs delay_ms >= 0 and 0 <= loss_pct < 100, got {self}")

    @property
    def shaped(self) -> bool:
        return self.rate_mbit is not None or bool(self.delay_ms) or bool(self.loss_pct)

    def qdisc_args(self) -> list[str]:
        """The ``tc qdisc add ... root`` arguments: netem when delay or loss is asked, else tbf."""
        if self.delay_ms or self.loss_pct:
            args = ["netem", "limit", "100000"]
            if self.delay_ms:
                args += ["delay", f"{self.delay_ms}ms"]
            if self.loss_pct:
                args += ["loss", f"{self.loss_pct}%"]
            if self.rate_mbit is not None:
                args += ["rate", f"{self.rate_mbit}mbit"]
            return args
        bytes_per_s = self.rate_mbit * 1e6 / 8
        burst = max(64 * 1024, int(bytes_per_s / 250))
        return ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot be built here, or None if it can."""
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2 is missing ({', '.join(missing)} not found); apt-get install iproute2"
    return None


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def _set_sysctls(namespace: str, settings: Mapping[str, str]) -> None:
    """Set ``settings`` in ``namespace``; one this kernel does not have is left out (a kernel
    without autocorking has nothing to turn off)."""
    for key, value in settings.items():
        if not Path("/proc/sys", *key.split(".")).exists():
            continue
        _run("ip", "netns", "exec", namespace, "sysctl", "-q", "-w", f"{key}={value}")


class EmulatedCluster:
    """``num_hosts`` namespaces on one bridge; use as a context manager."""

    def __init__(self, num_hosts: int, link: LinkSpec = LinkSpec(), tag: str | None = None,
                 immediate_acks: bool = True):
        """``immediate_acks``: every host's route acknowledges at once (`HOST_ROUTE_OPTIONS`); False
        leaves Linux's delayed ACKs, to measure what they cost."""
        if num_hosts < 1 or num_hosts > 200:
            raise ValueError(f"num_hosts must be between 1 and 200, got {num_hosts}")
        self.num_hosts = num_hosts
        self.link = link
        self.immediate_acks = immediate_acks
        self.tag = tag or str(os.getpid() % 100000)
        self.switch = f"{PREFIX}{self.tag}sw"
        self.hosts = [f"{PREFIX}{self.tag}h{i}" for i in range(num_hosts)]
        self._created: list[str] = []
        self._previous_sigterm = None

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    # ------------------------------------------------------------- lifecycle
    def __enter__(self) -> EmulatedCluster:
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            self._add_namespace(host)
            port = f"p{i}"
            _run("ip", "-n", host, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                 "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            _run("ip", "-n", host, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", host, "link", "set", "eth0", "up")
            _run("ip", "-n", host, "link", "set", "lo", "up")
            if self.immediate_acks:
                _run("ip", "-n", host, "route", "replace", f"{SUBNET}.0/24", "dev", "eth0", "proto", "kernel",
                     "scope", "link", "src", self.address(i), *HOST_ROUTE_OPTIONS)
            _set_sysctls(host, HOST_SYSCTLS)
        self.set_link(self.link)

    def _add_namespace(self, name: str) -> None:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def close(self) -> None:
        """Delete every namespace (their interfaces go with them). Idempotent."""
        while self._created:
            subprocess.run(["ip", "netns", "del", self._created.pop()], capture_output=True)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    # ---------------------------------------------------------------- shaping
    def set_link(self, link: LinkSpec) -> None:
        """Reshape every host's link, both directions."""
        self.link = link
        for i, host in enumerate(self.hosts):
            for namespace, device in ((host, "eth0"), (self.switch, f"p{i}")):
                subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"],
                               capture_output=True)
                if not link.shaped:
                    continue
                done = subprocess.run(
                    ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root",
                     *link.qdisc_args()], capture_output=True, text=True)
                if done.returncode != 0 and "unknown" in done.stderr and (link.delay_ms or link.loss_pct):
                    raise ClusterUnavailable(
                        "this kernel has no netem qdisc, so delay and loss cannot be emulated; "
                        "rate shaping (tbf) still works: use LinkSpec(rate_mbit=...) alone"
                    )
                if done.returncode != 0:
                    raise RuntimeError(f"tc qdisc add on {namespace}/{device} failed: {done.stderr.strip()}")

    def cut_link(self, host: int) -> None:
        """Take host ``host``'s link down at both ends, as a pulled cable: no error reaches anyone,
        its connections stay open, and nothing more gets through in either direction."""
        _run("ip", "-n", self.switch, "link", "set", f"p{host}", "down")
        _run("ip", "-n", self.hosts[host], "link", "set", "eth0", "down")

    # ---------------------------------------------------------------- running
    def popen(self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` inside host ``host``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[host], *argv],
                                env={**os.environ, **(env or {})}, **kwargs)

    def torch_env(self, host: int, port: int = 29500) -> dict[str, str]:
        """torch.distributed's env:// variables for one process per host, rank = host."""
        return {
            "MASTER_ADDR": self.address(0), "MASTER_PORT": str(port),
            "RANK": str(host), "WORLD_SIZE": str(self.num_hosts),
            "LOCAL_RANK": "0", "GLOO_SOCKET_IFNAME": "eth0",
        }


def wait_for_hosts(procs: Sequence[subprocess.Popen], timeout_s: float, what: str) -> None:
    """Wait for every host's process (started with ``stderr=PIPE, text=True``), killing any still
    running when one outlasts ``timeout_s``; raise `RuntimeError` with the end of a failed one's stderr."""
    try:
        errors = [p.communicate(timeout=timeout_s)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, err in zip(procs, errors, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"a host of {what} exited with {p.returncode}:\n{err[-3000:]}")


def run_script_on_hosts(script: str | Sequence[str], hosts: int, link: LinkSpec, config: Mapping[str, Any],
                        timeout_s: float, what: str, immediate_acks: bool = True, torchrun: bool = False,
                        port: int = 29500, sample_cpu: bool = False) -> Any:
    """Run ``python script --worker CONFIG OUT`` on every host of a fresh cluster (one thread each)
    and return the JSON the script wrote to OUT: a benchmark's worker reads ``config`` from CONFIG,
    and its rank 0 writes what it measured. ``script``: a path, or the arguments that name it
    (``["-m", "commsched.bench.grid"]``).

    Each host runs it with torch's env:// variables set, or with ``torchrun`` under
    ``torch.distributed.run`` (one node per host, rank 0's address the master's). ``sample_cpu``
    adds ``"cpu"``: how busy the machine's cores were while the hosts ran
    (`commsched.bench.cpu_guard.CpuUse` as data, None where ``/proc/stat`` cannot be read), so that a
    run whose cores rather than links set the pace can be told apart. ``immediate_acks``: as
    `EmulatedCluster`'s.
    """
    target = [script] if isinstance(script, str) else list(script)
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(hosts, link, immediate_acks=immediate_acks) as cluster:
        config_path, out_path = Path(tmp) / "config.json", Path(tmp) / "out.json"
        config_path.write_text(json.dumps(dict(config)))
        worker = [*target, "--worker", str(config_path), str(out_path)]
        sampler = CpuSampler() if sample_cpu else None
        with contextlib.nullcontext() if sampler is None else sampler:
            procs = []
            for host in range(hosts):
                if torchrun:
                    argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={hosts}", "--nproc-per-node=1",
                            f"--node-rank={host}", f"--master-addr={cluster.address(0)}", f"--master-port={port}",
                            *worker]
                    env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
                else:
                    argv, env = [sys.executable, *worker], {**cluster.torch_env(host, port), "OMP_NUM_THREADS": "1"}
                procs.append(cluster.popen(host, argv, env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                           text=True))
            wait_for_hosts(procs, timeout_s, what)
        result = json.loads(out_path.read_text())
    if sampler is not None:
        use = sampler.summary()
        result = {**result, "cpu": None if use is None else asdict(use)}
    return result


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)

"""Peak resident memory (RSS) of each system, each measured on its own.

The comparison (`commsched.bench.compare`) trains every system in one process,
so that process's peak cannot be split by system. The method here:

- Before the comparison, each host's process, still holding nothing but
  imported torch (no model, no process group, no threads of its own), forks
  one child per system, one system after the other. Every child thus starts
  from the same memory, and forking costs neither a new interpreter nor a
  second import of torch.
- The child joins a process group of its own (the job's store, under a
  prefix of its own), builds only that system as the comparison does
  (`commsched.bench.peers`), trains `RSS_ITERATIONS` iterations (commsched's
  warm-up, the iteration that plans, and one with forward overlap), finishes
  what is in flight, and reads ``getrusage(RUSAGE_SELF).ru_maxrss`` (before
  ``commsched.release``, see `peak_rss_on_rank`): its own
  peak, which counts the pages it shares with its parent (torch, about the
  same for every system) and everything the system allocated.
- Reported: the max over the system's ranks (a parameter-server system's
  servers included), in MiB. Differences between systems are what each
  system costs; the common part is the process with torch loaded.
- The child first fixes glibc's mmap threshold (`fix_mmap_threshold`). With
  glibc's defaults, freed memory is kept for reuse (per thread, and below a
  threshold that rises as large blocks are freed), so a peak depends on the
  order of allocations as much as on what is alive at once: it moved by tens
  of MiB between repeats of one system. Fixed, every block from 128 KiB on is
  mapped by itself and returned when freed, and the peak is what was alive at
  once (within about a MiB between repeats).

`peak_rss_on_rank` is the measurement in an initialised group (tests call it
with `commsched.testing.run_ranks`); `peak_rss_in_children` forks the children
and gathers their figures.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing
import resource
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

import commsched
from commsched.bench.compare import ComparisonConfig, serve, served, start_or_explain, worker_group
from commsched.bench.models import WORKLOADS
from commsched.bench.systems import Commsched, System
from commsched.engine.lifecycle import WARMUP_ITERATIONS

RSS_ITERATIONS = WARMUP_ITERATIONS + 2
"""commsched's warm-up iterations, the one that plans, and one with forward overlap:
by then every system has allocated what it keeps."""

_STORE_PREFIX = "commsched-bench-peak-rss"


MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's own initial threshold, kept fixed."""

_M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number, from glibc's malloc.h."""


def fix_mmap_threshold() -> bool:
    """Have glibc map every block from `MMAP_THRESHOLD_BYTES` on by itself, and return it to the
    system when freed, from now on in this process. False where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def own_peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_on_rank(rank: int, world_size: int, config: ComparisonConfig, system: System) -> float:
    """Train only ``system`` for `RSS_ITERATIONS`; return the max over ranks of their peak RSS, in MiB.

    The default group holds exactly the ranks ``system`` uses: the workers, and
    the servers last for a parameter-server system. A peer that cannot train the
    model gives NaN. Meaningful only in a process that ran nothing else before.
    """
    servers = config.num_servers if served(system) else 0
    config = replace(config, systems=(system,), warmup=RSS_ITERATIONS, num_servers=servers)
    torch.manual_seed(0)
    base = WORKLOADS[config.workload].build()
    num_workers = world_size - config.num_servers
    workers = worker_group(world_size, config.num_servers)
    available, own_peak = True, float("nan")
    if rank >= num_workers:
        serve(base, config)
        own_peak = own_peak_rss_mib()
    else:
        outcome = start_or_explain(system, base, workers, config, rank, num_workers)
        available = not isinstance(outcome, str)
        if available:
            outcome.settle()
            # Read before the release: with sharded optimizer state it gathers the whole
            # state back into the optimizer, which training never holds.
            own_peak = own_peak_rss_mib()
            if isinstance(system, Commsched):
                commsched.release(outcome.model)  # lets servers finish
    peak = torch.tensor([own_peak])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def system_ranks(system: System, num_workers: int, num_servers: int) -> int:
    """How many ranks ``system`` runs on: the workers, and the servers if it uses them."""
    return num_workers + (num_servers if served(system) else 0)


def peak_rss_in_children(config: ComparisonConfig, rank: int, world_size: int, store_host: str, store_port: int,
                         timeout_s: float = 600.0) -> dict[str, float]:
    """Every system's `peak_rss_on_rank`, each in a child forked from this process, in turn.

    Call it on every rank of a job before anything else (no process group yet);
    ``store_host:store_port`` is the job's TCPStore (torchrun's ``MASTER_ADDR``
    and ``MASTER_PORT``). Ranks a system does not use (servers, for the
    all-reduce systems) skip it. Returns MiB by system name (NaN for a peer
    that cannot train the model); rank 0 takes part in every system.
    """
    _load_lazy_modules()
    num_workers = world_size - config.num_servers
    peaks: dict[str, float] = {}
    for index, system in enumerate(config.systems):
        ranks = system_ranks(system, num_workers, config.num_servers)
        if rank < ranks:
            group = _Group(store_host, store_port, f"{_STORE_PREFIX}/{index}", rank, ranks, timeout_s)
            peaks[system.name] = _in_child(config, _untraced(system), group)
    return peaks


def _untraced(system: System) -> System:
    """``system`` without a trace directory: tracing's own buffers are not the system's memory."""
    if isinstance(system, Commsched) and system.strategy.trace_dir is not None:
        return replace(system, strategy=replace(system.strategy, trace_dir=None))
    return system


def _load_lazy_modules() -> None:
    """Import in the parent what the systems would import at first use (torch's
    optimizers load torch._dynamo, seconds and megabytes), so that no child pays
    for it in time or in memory."""
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


@dataclass(frozen=True)
class _Group:
    """Where a child finds the other ranks of its system, and its place among them."""

    store_host: str
    store_port: int
    prefix: str
    """Keeps each system's rendezvous apart from the job's and from the other systems'."""
    rank: int
    world_size: int
    timeout_s: float

    def join(self) -> None:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(self.store_host, self.store_port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(self.prefix, store), rank=self.rank,
                                world_size=self.world_size, timeout=timeout)


def _in_child(config: ComparisonConfig, system: System, group: _Group) -> float:
    """Run `_child` in a forked process; its figure, or its traceback as an error."""
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_child, args=(config, system, group, send),
                                                       name=f"peak RSS of {system.name}")
    child.start()
    send.close()
    limit_s = group.timeout_s + 30
    try:
        if not receive.poll(limit_s):
            raise RuntimeError(f"measuring the peak RSS of {system.name} took over {limit_s:g} s")
        ok, payload = receive.recv()
    except EOFError:
        ok, payload = False, f"the child died (exit code {child.exitcode}) without reporting"
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    if not ok:
        raise RuntimeError(f"measuring the peak RSS of {system.name} failed:\n{payload}")
    return payload


def _child(config: ComparisonConfig, system: System, group: _Group, send: Connection) -> None:
    """A forked child: join this system's group, measure, report through ``send``."""
    try:
        fix_mmap_threshold()
        group.join()
        send.send((True, peak_rss_on_rank(group.rank, group.world_size, config, system)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        send.send((False, traceback.format_exc()))

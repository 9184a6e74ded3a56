"""Train the same model with several systems (`commsched.bench.systems`), side by side, on each rank.

Shared by ``commsched demo``, ``commsched bench`` and the benchmarks. Every
system starts from the same weights and sees the same batches; their runs are
interleaved in rounds (alternating which goes first) so that drift in machine
load hits all alike.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import commsched
from commsched.api import prepare_server
from commsched.bench.models import WORKLOADS
from commsched.bench.systems import Commsched, ComputeOnly, System, TorchDDP
from commsched.strategy import Strategy


@dataclass(frozen=True)
class ComparisonConfig:
    """What to train with which systems, and how long to measure each."""

    workload: str = "demo-mlp"
    batch_size: int = 64
    """Per rank."""
    iterations: int = 20
    """Measured iterations per system per round."""
    rounds: int = 3
    warmup: int = 3
    """Iterations per system before the first round, not measured."""
    learning_rate: float = 0.05
    systems: tuple[System, ...] = (TorchDDP(), Commsched(Strategy()))
    """Trained side by side; their names must differ (results are keyed by name)."""
    num_servers: int = 0
    """The last ``num_servers`` ranks are parameter servers: they serve the systems with
    ``Strategy(backend=ParameterServer(...))`` (which must use as many servers) and sit
    out the others, which run on the remaining ranks (the workers)."""
    show_progress: bool = True

    def __post_init__(self) -> None:
        names = [system.name for system in self.systems]
        if len(set(names)) != len(names):
            raise ValueError(f"ComparisonConfig.systems must have distinct names, got {names}")
        for system in self.systems:
            if isinstance(system, Commsched) and system.num_servers not in (0, self.num_servers):
                raise ValueError(f"system {system.name!r} uses {system.num_servers} servers, the comparison "
                                 f"{self.num_servers}")


@dataclass
class SystemResult:
    """What one system measured on rank 0 (plain data, so it travels as JSON)."""

    iteration_times_s: list[float] = field(default_factory=list)
    cpu_times_s: list[float] = field(default_factory=list)
    """CPU time of the whole process (all threads) per iteration, where measured
    (`allreduce_on_rank`)."""
    final_loss: float = float("nan")
    eval_loss: float = float("nan")
    server_bytes: list[int] = field(default_factory=list)
    """Parameter-server systems: bytes of blocks each server holds (for the link bound)."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.iteration_times_s)


class _Run:
    """One system training on this rank: its model, optimizer, batches and result."""

    def __init__(self, system: System, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 config: ComparisonConfig, rank: int, world_size: int):
        self.system, self.model, self.optimizer = system, model, optimizer
        workload = WORKLOADS[config.workload]
        self._stream = workload.batches(config.batch_size * world_size, seed=1)
        self._mine = slice(rank * config.batch_size, (rank + 1) * config.batch_size)
        self.result = SystemResult()
        self.last_loss = torch.zeros(())

    def step(self) -> float:
        x, y = next(self._stream)
        start = time.perf_counter()
        loss = F.cross_entropy(self.model(x[self._mine]), y[self._mine])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        elapsed = time.perf_counter() - start
        self.last_loss = loss.detach()
        return elapsed

    def settle(self) -> float:
        """Finish anything still in flight; return how long that took."""
        start = time.perf_counter()
        synchronize = getattr(self.optimizer, "synchronize", None)
        if synchronize is not None:
            synchronize()
        return time.perf_counter() - start


def _served(system: System) -> bool:
    return isinstance(system, Commsched) and system.num_servers > 0


def _worker_group(world_size: int, num_servers: int) -> dist.ProcessGroup:
    """The ranks that train (all but the last ``num_servers``); collective over the world."""
    if not num_servers:
        return dist.group.WORLD
    return dist.new_group(list(range(world_size - num_servers)))


def compare_on_rank(rank: int, world_size: int, config: ComparisonConfig) -> dict[str, SystemResult] | None:
    """Run the comparison; rank 0 returns the results by system name, other ranks None."""
    workload = WORKLOADS[config.workload]
    torch.manual_seed(0)
    base = workload.build()
    num_workers = world_size - config.num_servers
    workers = _worker_group(world_size, config.num_servers)

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=0.9)

    if rank >= num_workers:
        _serve(base, sgd, config)
        return None

    runs = []
    for system in config.systems:
        model = copy.deepcopy(base)
        if isinstance(system, ComputeOnly):
            optimizer = sgd(model)
        elif isinstance(system, TorchDDP):
            cap = {} if system.bucket_cap_mb is None else {"bucket_cap_mb": system.bucket_cap_mb}
            model = DistributedDataParallel(model, process_group=workers, **cap)
            optimizer = sgd(model)
        else:
            group = None if _served(system) else workers
            model, optimizer = commsched.prepare(model, sgd(model), system.strategy, process_group=group)
        runs.append(_Run(system, model, optimizer, config, rank, num_workers))

    for run in runs:
        for _ in range(config.warmup):
            run.step()

    total = config.rounds * config.iterations * len(runs)
    with _progress(rank == 0 and config.show_progress, total, config.workload) as advance:
        for round_index in range(config.rounds):
            order = runs if round_index % 2 == 0 else runs[::-1]
            for run in order:
                dist.barrier(group=workers)
                for _ in range(config.iterations):
                    run.result.iteration_times_s.append(run.step())
                    advance(run.system.name)
                # Work a system left in flight is charged to it, not to the next one.
                run.result.iteration_times_s[-1] += run.settle()

    held_out_x, held_out_y = next(workload.batches(256, seed=12345))
    for run in runs:
        run.settle()
        loss = run.last_loss.clone()
        dist.all_reduce(loss, group=workers)
        run.result.final_loss = float(loss) / num_workers
        run.model.eval()
        with torch.no_grad():
            run.result.eval_loss = float(F.cross_entropy(run.model(held_out_x), held_out_y))
        run.model.train()
    for run in runs:
        if _served(run.system):
            run.result.server_bytes = list(commsched.status(run.model).server_bytes)
            commsched.release(run.model)  # lets the servers finish
    return {run.system.name: run.result for run in runs} if rank == 0 else None


def _serve(base: torch.nn.Module, make_optimizer, config: ComparisonConfig) -> None:
    """A server rank: serve every parameter-server system at once, each on its own thread."""
    threads, failures = [], []
    for system in config.systems:
        if not _served(system):
            continue
        model = copy.deepcopy(base)
        server = prepare_server(model, make_optimizer(model), system.strategy)

        def serve(server=server, name=system.name) -> None:
            try:
                server.serve()
            except BaseException as error:  # noqa: BLE001 - re-raised below
                failures.append(f"{name}: {error}")

        threads.append(threading.Thread(target=serve, name=f"serve {system.name}", daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError("parameter server failed: " + "; ".join(failures))


def allreduce_on_rank(rank: int, world_size: int, config: ComparisonConfig) -> SystemResult | None:
    """Time one all-reduce of a buffer as large as all gradients, on the workers.

    The communication part of the bound: a measurement, not a system. Collective
    over the world (server ranks only help build the workers' group); rank 0
    returns the timings, other ranks None.
    """
    workers = _worker_group(world_size, config.num_servers)
    if rank >= world_size - config.num_servers:
        return None
    model = WORKLOADS[config.workload].build()
    buffer = torch.zeros(sum(p.numel() for p in model.parameters() if p.requires_grad))
    result = SystemResult()
    for _ in range(max(3, config.rounds)):
        dist.barrier(group=workers)
        start, cpu_start = time.perf_counter(), time.process_time()
        dist.all_reduce(buffer, group=workers)
        result.iteration_times_s.append(time.perf_counter() - start)
        result.cpu_times_s.append(time.process_time() - cpu_start)
    return result if rank == 0 else None


class _progress:
    """A rich progress bar on rank 0; a no-op elsewhere."""

    def __init__(self, enabled: bool, total: int, label: str):
        self._enabled, self._total, self._label = enabled, total, label

    def __enter__(self):
        if not self._enabled:
            return lambda name: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("{task.fields[system]}"),
        )
        self._bar.__enter__()
        task = self._bar.add_task(f"training {self._label}", total=self._total, system="")
        return lambda name: self._bar.update(task, advance=1, system=name)

    def __exit__(self, *exc):
        if self._enabled:
            self._bar.__exit__(*exc)
        return False

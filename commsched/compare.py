"""Train the same model with torch DDP and with commsched, side by side, on each rank.

Shared by ``commsched demo`` and the benchmarks. Both systems start from the
same weights and see the same batches; their runs are interleaved in rounds
(alternating which goes first) so that drift in machine load hits both alike.
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
from commsched.models import WORKLOADS
from commsched.strategy import Strategy

DDP = "torch DDP"
COMMSCHED = "commsched"


@dataclass(frozen=True)
class DDPSpec:
    """torch DDP with a given ``bucket_cap_mb`` (a system entry; None means the defaults)."""

    bucket_cap_mb: float = 25.0


LOCAL = "local"
ALLREDUCE_ONLY = "all-reduce of all gradients"
UNSCHEDULED = Strategy(
    priority=False, partition_mb=None, credit_mb=None, overlap_forward=False, fuse_optimizer=False
)
"""commsched with every scheduling feature off: the DDP-like core."""


@dataclass(frozen=True)
class ComparisonConfig:
    workload: str = "demo-mlp"
    batch_size: int = 64
    """Per rank."""
    iterations: int = 20
    """Measured iterations per system per round."""
    rounds: int = 3
    warmup: int = 3
    """Iterations per system before the first round, not measured."""
    learning_rate: float = 0.05
    systems: tuple[tuple[str, Strategy | DDPSpec | str | None], ...] = ((DDP, None), (COMMSCHED, Strategy()))
    """(name, strategy) per system; None or a `DDPSpec` means torch DDP, `LOCAL` training
    with no communication at all (every rank computing: the compute part of the bound)."""
    measure_allreduce: bool = False
    """Also time one all-reduce of all gradients (the communication part of the bound)."""
    num_servers: int = 0
    """The last ``num_servers`` ranks are parameter servers: they serve the systems with
    ``Strategy(backend="ps")`` (which must use as many servers) and sit out the others,
    which run on the remaining ranks (the workers)."""
    ddp_bucket_cap_mb: float = 25.0
    show_progress: bool = True


@dataclass
class SystemResult:
    iteration_times_s: list[float] = field(default_factory=list)
    cpu_times_s: list[float] = field(default_factory=list)
    """CPU time of the whole process (all threads) per iteration, where measured."""
    final_loss: float = float("nan")
    eval_loss: float = float("nan")
    server_bytes: list[int] = field(default_factory=list)
    """Parameter-server systems: bytes of blocks each server holds (for the link bound)."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.iteration_times_s)

    @property
    def mean_s(self) -> float:
        """Total time over iterations: the inverse of throughput."""
        return statistics.fmean(self.iteration_times_s)


class _System:
    def __init__(self, name, model, optimizer, config: ComparisonConfig, rank: int, world_size: int):
        self.name, self.model, self.optimizer = name, model, optimizer
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


def _is_parameter_server(strategy: object) -> bool:
    return isinstance(strategy, Strategy) and strategy.parameter_server


def compare_on_rank(rank: int, world_size: int, config: ComparisonConfig) -> dict[str, SystemResult] | None:
    """Run the comparison; rank 0 returns the results, other ranks None."""
    workload = WORKLOADS[config.workload]
    torch.manual_seed(0)
    base = workload.build()
    for name, strategy in config.systems:
        if _is_parameter_server(strategy) and strategy.num_servers != config.num_servers:
            raise ValueError(f"system {name!r} uses {strategy.num_servers} servers, the comparison "
                             f"{config.num_servers}")
    num_workers = world_size - config.num_servers
    workers = dist.group.WORLD if not config.num_servers else dist.new_group(list(range(num_workers)))

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=0.9)

    if rank >= num_workers:
        _serve(base, sgd, config)
        return None

    systems = []
    for name, strategy in config.systems:
        if strategy == LOCAL:
            model = copy.deepcopy(base)
            optimizer = sgd(model)
        elif strategy is None or isinstance(strategy, DDPSpec):
            cap = config.ddp_bucket_cap_mb if strategy is None else strategy.bucket_cap_mb
            model = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap, process_group=workers)
            optimizer = sgd(model)
        else:
            model = copy.deepcopy(base)
            group = None if _is_parameter_server(strategy) else workers
            model, optimizer = commsched.prepare(model, sgd(model), strategy, process_group=group)
        systems.append(_System(name, model, optimizer, config, rank, num_workers))

    for system in systems:
        for _ in range(config.warmup):
            system.step()

    total = config.rounds * config.iterations * len(systems)
    with _progress(rank == 0 and config.show_progress, total, config.workload) as advance:
        for round_index in range(config.rounds):
            order = systems if round_index % 2 == 0 else systems[::-1]
            for system in order:
                dist.barrier(group=workers)
                for _ in range(config.iterations):
                    system.result.iteration_times_s.append(system.step())
                    advance(system.name)
                # Work a system left in flight is charged to it, not to the next one.
                system.result.iteration_times_s[-1] += system.settle()

    held_out_x, held_out_y = next(workload.batches(256, seed=12345))
    for system in systems:
        system.settle()
        loss = system.last_loss.clone()
        dist.all_reduce(loss, group=workers)
        system.result.final_loss = float(loss) / num_workers
        system.model.eval()
        with torch.no_grad():
            system.result.eval_loss = float(F.cross_entropy(system.model(held_out_x), held_out_y))
        system.model.train()
    for system, (_, strategy) in zip(systems, config.systems, strict=True):
        if _is_parameter_server(strategy):
            system.result.server_bytes = system.model._commsched_reducer.backend.plan.loads_bytes()
            commsched.release(system.model)  # lets the servers finish
    results = {s.name: s.result for s in systems}
    if config.measure_allreduce:
        results[ALLREDUCE_ONLY] = _time_allreduce(base, repeats=max(3, config.rounds), group=workers)
    return results if rank == 0 else None


def _serve(base: torch.nn.Module, make_optimizer, config: ComparisonConfig) -> None:
    """A server rank: serve every parameter-server system at once, each on its own thread."""
    threads, failures = [], []
    for name, strategy in config.systems:
        if not _is_parameter_server(strategy):
            continue
        model = copy.deepcopy(base)
        server = commsched.api.prepare_server(model, make_optimizer(model), strategy)

        def serve(server=server, name=name) -> None:
            try:
                server.serve()
            except BaseException as error:  # noqa: BLE001 - re-raised below
                failures.append(f"{name}: {error}")

        threads.append(threading.Thread(target=serve, name=f"serve {name}", daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError("parameter server failed: " + "; ".join(failures))


def _time_allreduce(model: torch.nn.Module, repeats: int, group: dist.ProcessGroup) -> SystemResult:
    """One all-reduce of a buffer as large as all gradients, timed ``repeats`` times."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    buffer = torch.zeros(numel)
    result = SystemResult()
    for _ in range(repeats):
        dist.barrier(group=group)
        start, cpu_start = time.perf_counter(), time.process_time()
        dist.all_reduce(buffer, group=group)
        result.iteration_times_s.append(time.perf_counter() - start)
        result.cpu_times_s.append(time.process_time() - cpu_start)
    return result


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

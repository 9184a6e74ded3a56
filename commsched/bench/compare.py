"""Train the same model with several systems (`commsched.bench.systems`), side by side, on each rank.

Shared by ``commsched demo``, ``commsched bench`` and the benchmarks. Every
system starts from the same weights and sees the same batches; their runs are
interleaved in rounds (alternating which goes first) so that drift in machine
load hits all alike.

[Note: steady-state rounds] A round measures what a long run pays per
iteration. With forward overlap, an iteration's reductions end during the next
one's forward pass, so a round begins with one unmeasured iteration (the first
measured one then waits for its predecessor's reductions, as in a long run)
and ends by waiting for everything in flight (so that nothing is left for the
next system), which is not in the iteration times: a long run pays it once, at
its end or at an ``opt.synchronize()``. It is kept per round (``drain_s``).
Charged to the round's last iteration instead, it made a 3-iteration round of
the ResNet-like at 0.25 Gbit/s read 170, 190 and 379 ms: a mean 30% above the
steady state. Systems without overlap (torch DDP, FSDP2) finish every
iteration inside it, so the lead-in and the drain change nothing for them.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commsched
from commsched.api import prepare_server
from commsched.bench.models import WORKLOADS, Workload
from commsched.bench.peers import OPTIMIZERS, OptimizerFactory, PeerUnavailable, build, optimizer_state_bytes
from commsched.bench.systems import Commsched, System, TorchDDP, TorchFSDP2
from commsched.engine.backward_pass import IterationFigures
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.strategy import Strategy
from commsched.tuning.confirmation import LENGTH as CONFIRMATION_LENGTH

SETTLED_AFTER = WARMUP_ITERATIONS + CONFIRMATION_LENGTH + 1
"""Iterations after which commsched's layout no longer changes (without the auto-tuner)."""


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
    optimizer: str = "sgd"
    """Every system's optimizer, a key of `commsched.bench.peers.OPTIMIZERS`: SGD with momentum 0.9,
    or Adam."""
    systems: tuple[System, ...] = (TorchDDP(), Commsched(Strategy()))
    """Trained side by side; their names must differ (results are keyed by name)."""
    num_servers: int = 0
    """The last ``num_servers`` ranks are parameter servers: they serve the systems with
    ``Strategy(backend=ParameterServer(...))`` (which must use as many servers) and sit
    out the others, which run on the remaining ranks (the workers)."""
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"ComparisonConfig.optimizer must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}")
        names = [system.name for system in self.systems]
        if len(set(names)) != len(names):
            raise ValueError(f"ComparisonConfig.systems must have distinct names, got {names}")
        for system in self.systems:
            if isinstance(system, Commsched) and system.num_servers not in (0, self.num_servers):
                raise ValueError(f"system {system.name!r} uses {system.num_servers} servers, the comparison "
                                 f"{self.num_servers}")

    @property
    def make_optimizer(self) -> OptimizerFactory:
        """Builds this comparison's optimizer for a model."""
        return OPTIMIZERS[self.optimizer](self.learning_rate)


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
    exposed_wait_s: list[float] = field(default_factory=list)
    """commsched systems, per measured iteration: time the training thread waited for
    reductions (`commsched.status`'s figures; rank 0's)."""
    update_s: list[float] = field(default_factory=list)
    """commsched systems, per measured iteration: time in per-bucket updates."""
    drain_s: list[float] = field(default_factory=list)
    """Per round: how long finishing what was in flight after its last measured iteration took
    (``opt.synchronize()``; not in ``iteration_times_s``: see [Note: steady-state rounds])."""
    partitioning: str | None = None
    """commsched systems: the partitioning in use and why, where `commsched.status` says."""
    transport: str | None = None
    """commsched systems: what goes on the wire and how (`commsched.status`'s transport: which
    partitions go in two all-to-alls, for one)."""
    layout_in_use: dict | None = None
    """commsched systems: the partition, credit, bucket and first bucket sizes in use (MiB; None:
    whole / unbounded) after the last round, where `commsched.status` says: what the simulator
    is given to time the same run (benchmarks/validate_simulator.py)."""
    peak_rss_mib: float = float("nan")
    """Peak resident memory of a process running only this system, max over its ranks
    (`commsched.bench.memory`); NaN where not measured."""
    unavailable: str | None = None
    """Why this system could not train the model (then nothing else is filled)."""
    optimizer_state_bytes: int | None = None
    """Bytes of optimizer state rank 0 holds after the last round: with sharded state,
    `commsched.status`'s; else the tensors in ``optimizer.state`` (its local shards with FSDP2)."""
    sharding: dict | None = None
    """commsched with sharded optimizer state: `commsched.status(model).sharding`, as data."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.iteration_times_s)


class _FigureLog:
    """A commsched system's per-iteration figures over the measured iterations.

    `commsched.status` keeps only the latest two iterations, so it is read after
    every measured step (outside the timed span). An iteration's waits end in the
    next one's forward pass (forward overlap), so an iteration is complete once it
    is the ``previous_iteration``, or after ``synchronize()``.
    """

    def __init__(self) -> None:
        self._measured: set[int] = set()
        self._figures: dict[int, IterationFigures] = {}

    def after_step(self, model: torch.nn.Module) -> None:
        status = commsched.status(model)
        if status.current_iteration is not None:
            self._measured.add(status.current_iteration.iteration)
        if status.previous_iteration is not None:
            self._figures[status.previous_iteration.iteration] = status.previous_iteration

    def write_into(self, result: SystemResult) -> None:
        measured = sorted(self._measured & self._figures.keys())
        result.exposed_wait_s = [self._figures[i].exposed_wait_s for i in measured]
        result.update_s = [self._figures[i].update_s for i in measured]


LAYOUT_FIELDS = ("partition_mb", "credit_mb", "bucket_cap_mb", "first_bucket_mb")


def _layout_in_use(status: object) -> dict | None:
    """The sizes of `LAYOUT_FIELDS` in use, if this version's `commsched.status` tells."""
    if not all(hasattr(status, name) for name in LAYOUT_FIELDS):
        return None
    return {name: getattr(status, name) for name in LAYOUT_FIELDS}


class Run:
    """One system training on this rank: its model, optimizer, batches and result."""

    def __init__(self, system: System, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 config: ComparisonConfig, rank: int, world_size: int):
        self.system, self.model, self.optimizer = system, model, optimizer
        workload = WORKLOADS[config.workload]
        self._stream = workload.batches(config.batch_size * world_size, seed=1)
        self._mine = slice(rank * config.batch_size, (rank + 1) * config.batch_size)
        self.result = SystemResult()
        self.last_loss = torch.zeros(())
        self._figures = _FigureLog() if isinstance(system, Commsched) else None

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

    def measured_step(self) -> None:
        """One timed iteration, recorded with commsched's figures for it."""
        self.result.iteration_times_s.append(self.step())
        if self._figures is not None:
            self._figures.after_step(self.model)

    def settle(self) -> float:
        """Finish anything still in flight; return how long that took."""
        start = time.perf_counter()
        synchronize = getattr(self.optimizer, "synchronize", None)
        if synchronize is not None:
            synchronize()
        return time.perf_counter() - start

    def drain(self) -> None:
        """End a round: finish what is in flight, timed apart (see [Note: steady-state rounds])."""
        self.result.drain_s.append(self.settle())

    def finish(self) -> None:
        """Fill in what the result keeps besides times (figures, the cost model's choice)."""
        sharding = None
        if self._figures is not None:
            self._figures.write_into(self.result)
            status = commsched.status(self.model)
            self.result.partitioning = getattr(status, "partitioning", None) or None
            self.result.transport = status.transport
            self.result.layout_in_use = _layout_in_use(status)
            sharding = getattr(status, "sharding", None)
        self.result.sharding = None if sharding is None else asdict(sharding)
        self.result.optimizer_state_bytes = (optimizer_state_bytes(self.optimizer) if sharding is None
                                             else sharding.state_bytes)


def served(system: System) -> bool:
    """Whether ``system`` needs the parameter-server ranks."""
    return isinstance(system, Commsched) and system.num_servers > 0


def worker_group(world_size: int, num_servers: int) -> dist.ProcessGroup:
    """The ranks that train (all but the last ``num_servers``); collective over the world."""
    if not num_servers:
        return dist.group.WORLD
    return dist.new_group(list(range(world_size - num_servers)))


def start_run(system: System, base: torch.nn.Module, workers: dist.ProcessGroup, config: ComparisonConfig,
              rank: int, num_workers: int) -> Run:
    """Build ``system`` on a copy of ``base`` and train its unmeasured warm-up iterations (`warmup_of`)."""
    model, optimizer = build(system, copy.deepcopy(base), workers, config.make_optimizer)
    run = Run(system, model, optimizer, config, rank, num_workers)
    for _ in range(warmup_of(config)):
        run.step()
    return run


def warmup_of(config: ComparisonConfig) -> int:
    """Unmeasured iterations of every system: ``config.warmup``, and where a commsched system lets its
    cost model choose, at least until that choice has been measured against whole buckets
    (`commsched.tuning.confirmation`), so that the rounds measure the setting a run keeps, not its
    trials. The same for every system, so that their final losses compare."""
    if any(isinstance(s, Commsched) and s.strategy.measures_its_choice for s in config.systems):
        return max(config.warmup, SETTLED_AFTER)
    return config.warmup


def _may_be_unavailable(system: System) -> bool:
    """Peers that may refuse a model; commsched and DDP failing is a bug and must crash."""
    return isinstance(system, TorchFSDP2)


def start_or_explain(system: System, base: torch.nn.Module, workers: dist.ProcessGroup,
                      config: ComparisonConfig, rank: int, num_workers: int) -> Run | str:
    """`start_run`, or for a peer that cannot train this model, why (agreed by every worker).

    The peers fail alike on every rank (same model, same code), so a failure does
    not leave a rank waiting in a collective the others abandoned.
    """
    if not _may_be_unavailable(system):
        return start_run(system, base, workers, config, rank, num_workers)
    outcome: Run | str
    try:
        outcome = start_run(system, base, workers, config, rank, num_workers)
    except Exception as error:  # noqa: BLE001 - reported in the results instead of ending the bench
        reason = str(error) if isinstance(error, PeerUnavailable) else f"{type(error).__name__}: {error}"
        outcome = f"{system.name} cannot train {config.workload}: {reason}"
    failed = torch.tensor([float(isinstance(outcome, str))])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=workers)
    if failed.item() and not isinstance(outcome, str):
        outcome = f"{system.name} cannot train {config.workload}: it failed on another rank"
    return outcome


def compare_on_rank(rank: int, world_size: int, config: ComparisonConfig) -> dict[str, SystemResult] | None:
    """Run the comparison; rank 0 returns the results by system name, other ranks None.

    A peer that cannot train the model (torch FSDP2 refusing it) gets a result
    with only ``unavailable`` set, and the others go on.
    """
    workload = WORKLOADS[config.workload]
    torch.manual_seed(0)
    base = workload.build()
    num_workers = world_size - config.num_servers
    workers = worker_group(world_size, config.num_servers)

    if rank >= num_workers:
        serve(base, config)
        return None

    results: dict[str, SystemResult] = {}
    runs: list[Run] = []
    for system in config.systems:
        outcome = start_or_explain(system, base, workers, config, rank, num_workers)
        if isinstance(outcome, str):
            results[system.name] = SystemResult(unavailable=outcome)
        else:
            runs.append(outcome)
            results[system.name] = outcome.result

    total = config.rounds * config.iterations * len(runs)
    with _progress(rank == 0 and config.show_progress, total, config.workload) as advance:
        for round_index in range(config.rounds):
            order = runs if round_index % 2 == 0 else runs[::-1]
            for run in order:
                dist.barrier(group=workers)
                run.step()  # the lead-in: see [Note: steady-state rounds]
                for _ in range(config.iterations):
                    run.measured_step()
                    advance(run.system.name)
                run.drain()

    _final_losses(runs, workload, workers, num_workers)
    for run in runs:
        run.finish()
        if served(run.system):
            run.result.server_bytes = list(commsched.status(run.model).server_bytes)
            commsched.release(run.model)  # lets the servers finish
    return results if rank == 0 else None


def _final_losses(runs: list[Run], workload: Workload, workers: dist.ProcessGroup, num_workers: int) -> None:
    """Each run's last training loss (mean over workers) and its loss on a held-out batch."""
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


def serve(base: torch.nn.Module, config: ComparisonConfig) -> None:
    """A server rank: serve every parameter-server system at once, each on its own thread."""
    threads, failures = [], []
    for system in config.systems:
        if not served(system):
            continue
        model = copy.deepcopy(base)
        server = prepare_server(model, config.make_optimizer(model), system.strategy)

        def serve_one(server=server, name=system.name) -> None:
            try:
                server.serve()
            except BaseException as error:  # noqa: BLE001 - re-raised below
                failures.append(f"{name}: {error}")

        threads.append(threading.Thread(target=serve_one, name=f"serve {system.name}", daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError("parameter server failed: " + "; ".join(failures))


def gradient_elements(workload: str) -> int:
    """How many gradient elements one replica of ``workload`` reduces per iteration."""
    return sum(p.numel() for p in WORKLOADS[workload].build().parameters() if p.requires_grad)


def slowest_s(seconds: float, group: dist.ProcessGroup | None = None) -> float:
    """The largest of every rank's ``seconds`` in ``group`` (default: the world): what a
    synchronous step costs is its slowest rank's time. Collective."""
    measured = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
    return float(measured)


def allreduce_on_rank(rank: int, world_size: int, config: ComparisonConfig) -> SystemResult | None:
    """Time one all-reduce of a buffer as large as all gradients, on the workers.

    The communication part of the bound: a measurement, not a system. Collective
    over the world (server ranks only help build the workers' group); rank 0
    returns the timings, other ranks None.
    """
    workers = worker_group(world_size, config.num_servers)
    if rank >= world_size - config.num_servers:
        return None
    buffer = torch.zeros(gradient_elements(config.workload))
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

"""`prepare()`, `serve()`, `release()` and `status()`: validate, make the ranks agree, build one of each part.

`prepare` picks the backend's two parts, a `Transport` (what goes on the wire)
and an `UpdatePolicy` (where the optimizer runs), hands them to a
`GradientReducer`, and mixes commsched's behaviour into the model's and the
optimizer's classes. This is the only place that knows which backend is which.
With parameter servers, the server ranks call `serve` instead of `prepare`.
"""

from __future__ import annotations

import enum
import functools
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import _JoinConfig

from commsched.comm.agreement import (
    broadcast_from_rank0,
    checks_entry,
    describe_setup,
    describe_tensor,
    verify_same_across_ranks,
    verify_setup_across_ranks,
)
from commsched.comm.allreduce import AllReduceTransport
from commsched.comm.powersgd import PowerSGDCompressor
from commsched.comm.side_groups import control_group_for, exchange_group_for, parameter_group_for, side_group_for
from commsched.comm.two_step import SecondSteps, two_steps_possible
from commsched.device import seam_for
from commsched.engine.config import RunConfig
from commsched.engine.groups import ProcessGroups
from commsched.engine.reducer import GradientReducer
from commsched.engine.trace import check_trace_dir
from commsched.prepared.foreign_optimizers import watch_foreign_optimizers
from commsched.prepared.mixing import mix_in
from commsched.prepared.module import CommschedModule, attach_raw_view, has_own_attribute, is_prepared
from commsched.prepared.optimizer import CommschedOptimizer, keep_scheduler_counting_steps
from commsched.ps.job import check_parameter_server_setup, join_parameter_server_job
from commsched.ps.report import ServerReport
from commsched.ps.roles import is_server_rank
from commsched.ps.server import ParameterServer
from commsched.status import Status, reducer_status
from commsched.strategy import Strategy
from commsched.update.local import LocalUpdate
from commsched.update.sharded import ShardedUpdate, sharding_refusal

ModelT = TypeVar("ModelT", bound=torch.nn.Module)
OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)

def prepare(
    model: ModelT,
    optimizer: OptimizerT | None,
    strategy: Strategy | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[ModelT, OptimizerT | None]:
    """Make ``model`` and ``optimizer`` train data-parallel over ``process_group``.

    Collective over the group: every rank must call it with the same model.
    Rank 0's parameters and buffers are copied to every rank, gradient buckets
    are built, and hooks are attached. The same objects come back, with
    ``model.no_sync()`` and ``optimizer.synchronize()`` added; use them exactly
    as before. With parameter servers, the server ranks call `serve` instead.
    """
    return _prepare(model, optimizer, strategy, process_group, adopt_optimizer=False)


def prepare_adopting_optimizer(
    model: ModelT, strategy: Strategy | None = None, process_group: dist.ProcessGroup | None = None
) -> ModelT:
    """`prepare` for a model whose optimizer does not exist yet (`commsched.DistributedDataParallel`).

    The first ``step()`` of one optimizer over every trainable parameter, during
    warm-up, adopts it on every rank as if it had been passed here (see [Note: an
    adopted optimizer] in `commsched.engine.reducer`).
    """
    strategy = _checked_strategy(strategy)
    if strategy.parameter_server:
        raise ValueError(
            "with parameter servers the servers run the optimizer, so it must exist before training: call "
            "commsched.prepare(model, optimizer, strategy) on the workers and commsched.serve(...) on the servers"
        )
    model, _ = _prepare(model, None, strategy, process_group, adopt_optimizer=True)
    return model


def _prepare(
    model: ModelT,
    optimizer: OptimizerT | None,
    strategy: Strategy | None,
    process_group: dist.ProcessGroup | None,
    adopt_optimizer: bool,
) -> tuple[ModelT, OptimizerT | None]:
    strategy = _checked_strategy(strategy)
    _check_model(model)
    if strategy.compression is not None and _gradient_device(model).type != "cpu":
        raise ValueError(_compression_off_host(strategy, model))
    if strategy.shards_optimizer:
        refusal = sharding_refusal(None if adopt_optimizer else optimizer)
        if refusal is not None:
            raise ValueError(refusal)
    group, control_group = _agree(model, optimizer, strategy, process_group, _Entry.PREPARE)
    _warn_of_own_module_attribute(model)
    config = RunConfig.of(strategy)
    seam = seam_for(_gradient_device(model))
    if strategy.parameter_server:
        side = join_parameter_server_job(model, optimizer, strategy)
        if isinstance(side, ParameterServer):
            warnings.warn(
                f"commsched.prepare() was called on parameter-server rank {dist.get_rank()}: it serves until "
                "every worker has finished, then ends the process by raising commsched.ServingFinished (a "
                "SystemExit). Call commsched.serve(model, optimizer, strategy) on the server ranks instead "
                "(commsched.is_server_rank(num_servers) tells which); prepare() will stop serving in a "
                "later release.",
                DeprecationWarning, stacklevel=2,
            )
            raise ServingFinished(side.serve())
        groups = ProcessGroups(side.worker_group, side.buffer_group or side.worker_group, side.worker_group,
                               owned=side.made_groups)
        reducer = GradientReducer(model, config, side.transport, side.policy, groups, seam=seam)
    else:
        groups = ProcessGroups(group, _buffer_group(strategy, group) or group, control_group)
        if strategy.shards_optimizer:
            groups.parameters = parameter_group_for(group)
            policy = ShardedUpdate(optimizer, strategy.fuse_optimizer, lambda: groups.parameters, strategy.timeout_s,
                                   seam)
        else:
            policy = LocalUpdate(optimizer, fuse_optimizer=strategy.fuse_optimizer,
                                 overlap_forward=strategy.overlap_forward)
        all_to_all_mb = strategy.backend.all_to_all_mb
        two_steps = bool(all_to_all_mb) and two_steps_possible(group, _gradient_device(model))
        compression = None
        if two_steps or (strategy.compression is not None and dist.get_world_size(group) > 1):
            groups.exchange = exchange_group_for(group)
        if strategy.compression is not None and groups.exchange is not None:
            compression = PowerSGDCompressor(strategy.compression, dist.get_world_size(group),
                                             SecondSteps.of_group(groups.exchange))
        transport = AllReduceTransport(group, reduce_dtype=strategy.reduce_dtype,
                                       reduce_scatter=strategy.reduce_scatters,
                                       exchange_group=groups.exchange if two_steps else None,
                                       all_to_all_mb=all_to_all_mb, compression=compression,
                                       schedule_one_rank=strategy.backend.schedule_one_rank)
        try:
            reducer = GradientReducer(model, config, transport, policy, groups, awaiting_optimizer=adopt_optimizer,
                                      seam=seam)
        except BaseException:
            transport.finish()  # a refused prepare() leaves no heartbeat thread behind
            raise
    mix_in(model, CommschedModule)
    model._commsched_reducer = reducer
    attach_raw_view(model)
    model._join_config = _JoinConfig.construct_disabled_join_config()  # until torch's Join sets it
    if optimizer is not None:
        mix_in(optimizer, CommschedOptimizer)
        optimizer._commsched_reducer = reducer
        keep_scheduler_counting_steps(optimizer)
    adopter = None
    if adopt_optimizer:
        # The adopter reads the control group from the reducer's holder, which lets go of it at
        # release and at exit (see [Note: process groups at exit]); it keeps none of its own.
        adopter = functools.partial(_adopt_optimizer, model, strategy=strategy)
    watch_foreign_optimizers(model, optimizer, reducer, adopter)
    return model, optimizer


def rewire_before_training(model: torch.nn.Module, strategy: Strategy) -> PowerSGDCompressor | None:
    """For the drop-in's ``register_comm_hook``: train the prepared ``model`` with ``strategy``'s
    ``reduce_dtype`` and ``compression`` (its other fields as prepared), from the first iteration.

    Collective: every rank calls it, as every rank registers DDP's hook, and they check that they
    agree first. Returns the compressor made, if any."""
    reducer = _reducer_of(model, "register_comm_hook")
    reducer.check_untrained("register_comm_hook()")
    transport = reducer.transport
    if (strategy.compression is not None or strategy.reduce_dtype is not None) and not isinstance(
            transport, AllReduceTransport):
        raise ValueError("a comm hook that compresses needs the all-reduce backend, not parameter servers")
    if strategy.compression is not None and _gradient_device(model).type != "cpu":
        raise ValueError(_compression_off_host(strategy, model))
    setup = [checks_entry(None), *describe_setup(strategy, model, None)]
    verify_setup_across_ranks(setup, reducer.groups.control, strategy.timeout_s)
    if not isinstance(transport, AllReduceTransport):
        return None
    compression = None
    group = reducer.groups.replicas
    if strategy.compression is not None and dist.get_world_size(group) > 1:
        reducer.groups.exchange = reducer.groups.exchange or exchange_group_for(group)
        compression = PowerSGDCompressor(strategy.compression, dist.get_world_size(group),
                                         SecondSteps.of_group(reducer.groups.exchange))
    reducer.rewire(lambda: transport.rewire(strategy.reduce_dtype, compression))
    return compression


def _compression_off_host(strategy: Strategy, model: torch.nn.Module) -> str:
    return (f"Strategy(compression={strategy.compression!r}) compresses gradients in host memory only for now, and "
            f"this model's are on {_gradient_device(model)}: train it without compression (compression=None, or "
            "reduce_dtype=torch.bfloat16 for half the bytes), or with its gradients on the CPU")


def _gradient_device(model: torch.nn.Module) -> torch.device:
    """Where the model's gradients live (the first trainable parameter's device)."""
    return next((p.device for p in model.parameters() if p.requires_grad), torch.device("cpu"))


def _adopt_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy
) -> Callable[[], None]:
    """At ``optimizer``'s first ``step()``: check it as prepare() would, on every rank, then let
    the reducer take it; returns what runs once torch.optim's own step is done."""
    reducer: GradientReducer = model._commsched_reducer
    control_group = reducer.groups.control
    try:
        _check_optimizer(model, optimizer)
        setup = [checks_entry(None), *describe_setup(strategy, model, optimizer)]
        problem = None
    except Exception as error:  # noqa: BLE001 - the other ranks must hear of any failure
        setup, problem = [checks_entry(error)], error
    verify_setup_across_ranks(setup, control_group, strategy.timeout_s)
    if problem is not None:
        raise problem
    after_step = reducer.adopt_optimizer(optimizer)
    mix_in(optimizer, CommschedOptimizer)
    optimizer._commsched_reducer = reducer
    keep_scheduler_counting_steps(optimizer)
    return after_step


def _warn_of_own_module_attribute(model: torch.nn.Module) -> None:
    if has_own_attribute(model, "module"):
        warnings.warn(
            f"the prepared model ({type(model).__name__}) has an attribute of its own named 'module', so "
            "model.module is that attribute, not the model as with torch DDP's wrapper: where code written "
            "for DDP reaches the model through model.module, use the model itself",
            stacklevel=4,
        )


def serve(model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy) -> ServerReport:
    """On a parameter-server rank: serve the workers' `prepare` until every one has finished.

    Collective with the workers' ``prepare(model, optimizer, strategy)``: every
    rank passes the same model, optimizer and strategy. Returns what this server
    did; the script then ends, or goes on with work of its own. Raises
    ``ValueError`` (on every rank) if this rank is a worker.
    """
    _check_model(model)
    return _join_as_server(model, optimizer, strategy, _Entry.SERVE).serve()


class ServingFinished(SystemExit):
    """Raised by `prepare` on a parameter-server rank once every worker has finished (deprecated:
    call `serve` on server ranks).

    A `SystemExit` with code 0: uncaught, the server process ends cleanly and
    the training code after ``prepare()`` never runs there. ``report`` says
    what the server did.
    """

    def __init__(self, report: ServerReport):
        super().__init__(0)
        self.report = report


class _Entry(enum.Enum):
    """Which call is agreeing: the roles it allows differ."""

    PREPARE = "prepare"
    SERVE = "serve"
    PREPARE_SERVER = "prepare_server"


def _checked_strategy(strategy: Strategy | None) -> Strategy:
    strategy = Strategy() if strategy is None else strategy
    if not isinstance(strategy, Strategy):
        raise ValueError(f"strategy must be a commsched.Strategy, got {type(strategy).__name__}")
    return strategy


def _check_model(model: torch.nn.Module) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if is_prepared(model):
        raise RuntimeError(
            "commsched.prepare() was already called on this model (or it is the .module of one); call it "
            "once per model and keep using the model it returned"
        )


def _agree(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strategy: Strategy,
    process_group: dist.ProcessGroup | None,
    entry: _Entry,
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Validate, check that every rank has the same model and setup, copy rank 0's values.

    A check that fails on this rank alone is first told to the others, so that
    every rank raises instead of the others waiting for it. The model is
    compared first: a parameter missing on one rank would otherwise show as a
    different optimizer. Returns the group and its control group (see
    [Note: control messages] in commsched/comm/side_groups.py), on which the checks ran.
    """
    group = _resolve_process_group(process_group)
    control = control_group_for(group)
    try:
        _check_locally(model, optimizer, strategy, group, entry)
        setup = [checks_entry(None), *describe_setup(strategy, model, optimizer)]
        problem = None
    except Exception as error:  # noqa: BLE001 - the other ranks must hear of any failure
        setup, problem = [checks_entry(error)], error
    descriptions = [describe_tensor("parameter", n, p) for n, p in model.named_parameters()]
    descriptions += [describe_tensor("buffer", n, b) for n, b in model.named_buffers()]
    verify_same_across_ranks(descriptions, control, strategy.timeout_s)
    verify_setup_across_ranks(setup, control, strategy.timeout_s)
    if problem is not None:
        raise problem
    broadcast_from_rank0([*model.parameters(), *model.buffers()], group, strategy.timeout_s,
                         cpu_group=None if control is group else control)
    return group, control


def _check_locally(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strategy: Strategy,
    group: dist.ProcessGroup,
    entry: _Entry,
) -> None:
    """What this rank can check without the others."""
    if optimizer is not None:
        _check_optimizer(model, optimizer)
    if strategy.parameter_server:
        check_parameter_server_setup(optimizer, group)
    if entry is not _Entry.PREPARE:
        _check_serving(strategy, entry)
    elif strategy.trace_dir is not None:
        check_trace_dir(strategy.trace_dir)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"the model ({type(model).__name__}) has no parameter with requires_grad=True, so there is "
            "nothing to average or update: unfreeze the parameters to train (param.requires_grad_(True)), "
            "or use the model without commsched.prepare() (e.g. for evaluation, each rank runs it as is)"
        )


def prepare_server(model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy) -> ParameterServer:
    """On a server rank, what `serve` does, returning the server instead of serving.

    For code that runs several parameter-server jobs at once (each
    `ParameterServer.serve` on a thread of its own); `serve` is simpler.
    """
    return _join_as_server(model, optimizer, strategy, _Entry.PREPARE_SERVER)


def _join_as_server(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, entry: _Entry
) -> ParameterServer:
    """Agree with the workers' `prepare` (the role is checked on every rank), then join the job as its server."""
    strategy = _checked_strategy(strategy)
    _agree(model, optimizer, strategy, None, entry)
    server = join_parameter_server_job(model, optimizer, strategy)
    assert isinstance(server, ParameterServer), "the role was checked on every rank by _agree"
    return server


def _check_serving(strategy: Strategy, entry: _Entry) -> None:
    """`serve` and `prepare_server` run on the server ranks of a parameter-server job only."""
    if not strategy.parameter_server:
        raise ValueError(
            f"commsched.{entry.value}() runs a parameter server, but the strategy's backend is "
            f"{type(strategy.backend).__name__}(); pass Strategy(backend=ParameterServer(...)), or call "
            "commsched.prepare() for the all-reduce backend"
        )
    rank = dist.get_rank()
    if not is_server_rank(strategy.backend.num_servers):
        raise ValueError(
            f"commsched.{entry.value}() was called on rank {rank}, a worker of this parameter-server job "
            f"(the last {strategy.backend.num_servers} rank(s) serve): call commsched.prepare() there, and "
            f"{entry.value}() only where commsched.is_server_rank({strategy.backend.num_servers}) is True"
        )


def release(model: torch.nn.Module) -> None:
    """Stop distributed training of a prepared model: wait for what is in flight, remove hooks.

    With parameter servers this also tells them this worker is done. The model
    and optimizer then train as plain local objects. A model never released
    gets the same at exit (without waiting for reductions still in flight),
    which lets go of commsched's process groups while every thread can run.
    """
    _reducer_of(model, "release").close()


def status(model: torch.nn.Module) -> Status:
    """What commsched decided for ``model``: layout, lifecycle, forward overlap and why, figures."""
    return reducer_status(_reducer_of(model, "status"))


def _reducer_of(model: torch.nn.Module, caller: str) -> GradientReducer:
    wrapped = getattr(model, "module", None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and isinstance(wrapped, CommschedModule):
        model = wrapped  # commsched.DistributedDataParallel: the model it prepared
    if not is_prepared(model):
        raise ValueError(f"{caller}() takes a model returned by commsched.prepare(), got {type(model).__name__}")
    return model._commsched_reducer


def _buffer_group(strategy: Strategy, group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """The group for buffer broadcasts and Join's counts, so they never queue behind gradients.

    With forward overlap, gradient reductions are still in flight when the next
    forward pass broadcasts buffers (or counts the ranks still training, under
    ``Join``); on the same group the broadcast would wait for all of them (a
    model with BatchNorm would lose the overlap), and an operation issued
    beside partitions still being issued could take a different place on each
    rank. So they go on ``group``'s side group (see [Note: side groups] in
    commsched/comm/side_groups.py).
    """
    if not strategy.overlap_forward or dist.get_world_size(group) == 1:
        return None
    return side_group_for(group)


def _resolve_process_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if process_group is not None:
        return process_group
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "commsched.prepare() needs an initialised torch.distributed process group. "
            "Launch with `torchrun --nproc-per-node N train.py` and call "
            "`torch.distributed.init_process_group()` first (backend 'gloo' on CPU, 'nccl' "
            "on GPU); for a single process, init_process_group('gloo', "
            "init_method='tcp://127.0.0.1:29500', rank=0, world_size=1) works too."
        )
    return dist.group.WORLD


def _check_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, CommschedOptimizer):
        raise RuntimeError(
            "this optimizer was already passed to commsched.prepare(); build one optimizer per "
            "prepared model"
        )
    owned = {id(p) for p in model.parameters()}
    for group_index, group in enumerate(optimizer.param_groups):
        for position, param in enumerate(group["params"]):
            if id(param) not in owned:
                raise ValueError(
                    f"optimizer param_groups[{group_index}]['params'][{position}] (shape "
                    f"{tuple(param.shape)}) is not a parameter of the model being prepared; "
                    "build the optimizer from this model's parameters (e.g. "
                    "model.parameters()), and prepare each model with its own optimizer"
                )

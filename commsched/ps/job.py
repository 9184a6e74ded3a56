"""Joining a parameter-server job: check the setup, split the world into workers and servers, build each side."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from commsched.ps.config import JobConfig
from commsched.ps.push_pull import ParameterServerTransport
from commsched.ps.remote_update import ServerSideUpdate
from commsched.ps.roles import FailureBoard, PSRoles
from commsched.ps.server import ParameterServer
from commsched.strategy import ParameterServer as ParameterServerConfig
from commsched.strategy import Strategy
from commsched.update.kinds import optimizer_kind


@dataclass(frozen=True)
class WorkerSide:
    """What a worker's reducer runs on."""

    transport: ParameterServerTransport
    policy: ServerSideUpdate
    worker_group: dist.ProcessGroup
    """The workers only: order and plan agreements."""
    buffer_group: dist.ProcessGroup | None
    transport_group: dist.ProcessGroup
    """Workers and servers: pushes, pulls and commands."""

    @property
    def made_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups this job made for the model (see [Note: groups a model made for itself])."""
        return tuple(g for g in (self.worker_group, self.buffer_group, self.transport_group) if g is not None)


def check_parameter_server_setup(optimizer: torch.optim.Optimizer | None, group: dist.ProcessGroup) -> None:
    """What a parameter-server job needs, checked before any rank joins one."""
    if group is not dist.group.WORLD:
        raise ValueError(
            "Strategy(backend=ParameterServer(...)) runs on the default process group (its last "
            "num_servers ranks serve); call prepare() without process_group"
        )
    if optimizer is None:
        raise ValueError(
            "Strategy(backend=ParameterServer(...)) needs the optimizer: the parameter servers run it. "
            "Pass the optimizer to prepare()"
        )
    devices = {p.device.type for group in optimizer.param_groups for p in group["params"]}
    if devices - {"cpu"}:
        raise ValueError(
            f"Strategy(backend=ParameterServer(...)) moves CPU tensors over gloo, but the model has "
            f"parameters on {', '.join(sorted(devices - {'cpu'}))}; use the all-reduce backend "
            "(Strategy(backend=AllReduce()), the default) for GPU models"
        )
    try:
        optimizer_kind(optimizer)
    except ValueError as error:
        raise ValueError(
            f"Strategy(backend=ParameterServer(...)) runs the optimizer on the servers, which supports "
            f"torch.optim.SGD, Adam and AdamW only: {error}. Use the all-reduce backend "
            "(Strategy(backend=AllReduce()), the default) for other optimizers"
        ) from None


_jobs_started = 0
"""Parameter-server jobs started by this process (every rank counts the same)."""


def join_parameter_server_job(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy
) -> WorkerSide | ParameterServer:
    """A worker's transport and update policy, or this rank's server.

    Collective over the default group (every rank, servers included, creates
    every group). `commsched.serve` serves on a server rank; code that runs
    several parameter-server jobs at once (the benchmark) runs each
    `ParameterServer.serve` on a thread of its own.
    """
    global _jobs_started
    backend = strategy.backend
    assert isinstance(backend, ParameterServerConfig)
    config = JobConfig.of(strategy)
    roles = PSRoles.of_world(backend.num_servers)
    worker_group = dist.new_group(roles.workers)
    buffer_group = None
    if strategy.overlap_forward and strategy.broadcast_buffers and len(roles.workers) > 1:
        buffer_group = dist.new_group(roles.workers)
    transport_group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    _jobs_started += 1
    board = FailureBoard(f"commsched/ps/{_jobs_started}", roles.rank, [*roles.workers, *roles.servers])
    if roles.is_server:
        return ParameterServer(model, optimizer, config, roles, transport_group, board)
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    transport = ParameterServerTransport(config, roles, transport_group, optimizer, params, board)
    return WorkerSide(transport, ServerSideUpdate(transport), worker_group, buffer_group, transport_group)

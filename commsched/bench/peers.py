"""How each system of a comparison wraps a model and its optimizer (`build`).

The timed comparison (`commsched.bench.compare`) and the memory measurement
(`commsched.bench.memory`) build systems alike, so what one measures is what
the other ran. Every system gets plain SGD with momentum, unless the comparison
asks for Adam (`OPTIMIZERS`).

torch FSDP2 is applied per block, then on the root (`fsdp2_units`); a model it
cannot shard raises `PeerUnavailable`, which the comparison reports instead of
crashing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import commsched
from commsched.bench.systems import ComputeOnly, System, TorchDDP, TorchFSDP2

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


class PeerUnavailable(RuntimeError):
    """A peer (not commsched) cannot train this model; the message says why."""


def sgd(learning_rate: float) -> OptimizerFactory:
    """The optimizer every system trains with: SGD, momentum 0.9."""
    return lambda model: torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=0.9)


def adam(learning_rate: float) -> OptimizerFactory:
    """Adam with torch's defaults but the learning rate: twice the parameters in state, a longer step."""
    return lambda model: torch.optim.Adam(model.parameters(), lr=learning_rate)


OPTIMIZERS: dict[str, Callable[[float], OptimizerFactory]] = {"sgd": sgd, "adam": adam}
"""`ComparisonConfig.optimizer`'s choices, by name."""


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` that this rank holds (of an FSDP2 DTensor, its
    local shard only)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def build(system: System, model: nn.Module, workers: dist.ProcessGroup,
          make_optimizer: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model`` (a fresh copy, changed in place) wrapped for ``system`` on the ``workers`` group.

    Parameter-server systems use the default group (their servers are in it),
    the others ``workers``.
    """
    if isinstance(system, ComputeOnly):
        return model, make_optimizer(model)
    if isinstance(system, TorchDDP):
        wrapped = _ddp(system, model, workers)
        return wrapped, make_optimizer(wrapped)
    if isinstance(system, TorchFSDP2):
        _fully_shard(system, model, workers)
        return model, make_optimizer(model)
    group = None if system.num_servers else workers
    return commsched.prepare(model, make_optimizer(model), system.strategy, process_group=group)


def _ddp(system: TorchDDP, model: nn.Module, workers: dist.ProcessGroup) -> DistributedDataParallel:
    cap = {} if system.bucket_cap_mb is None else {"bucket_cap_mb": system.bucket_cap_mb}
    return DistributedDataParallel(model, process_group=workers, static_graph=system.static_graph,
                                   gradient_as_bucket_view=system.gradient_as_bucket_view, **cap)


def fsdp2_units(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP2 shards one by one, before the root takes the rest.

    A block is a module that holds parameters and is an element of an
    ``nn.Sequential`` or ``nn.ModuleList`` (outermost first: a block's own
    children are not blocks). Such elements are called as modules by their
    container, so FSDP2's hooks see their forward; a module called only
    through its weights (``F.linear(x, self.head.weight)``, attention's
    ``out_proj``) is never a block and is left to the root. For the bench
    models this shards per layer (MLP, VGG-like), per residual block
    (ResNet-like) and per encoder layer (Transformer-like).
    """
    units: list[nn.Module] = []

    def visit(module: nn.Module, in_container: bool) -> None:
        for child in module.children():
            if in_container and any(True for _ in child.parameters()):
                units.append(child)
            else:
                visit(child, isinstance(child, (nn.Sequential, nn.ModuleList)))

    visit(model, isinstance(model, (nn.Sequential, nn.ModuleList)))
    return units


def _fully_shard(system: TorchFSDP2, model: nn.Module, workers: dist.ProcessGroup) -> None:
    """Shard ``model`` in place: every block of `fsdp2_units`, then the root."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    try:
        mesh = DeviceMesh.from_group(workers, "cpu")
        for unit in fsdp2_units(model):
            fully_shard(unit, mesh=mesh, reshard_after_forward=system.reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=system.reshard_after_forward)
    except Exception as error:  # noqa: BLE001 - any refusal of torch's means: this peer cannot run it
        raise PeerUnavailable(f"{system.name} cannot shard {type(model).__name__}: "
                              f"{type(error).__name__}: {error}") from error

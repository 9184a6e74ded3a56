"""Parameter-server jobs in tests: one call that a worker and a server rank both make."""

from __future__ import annotations

import torch

import commsched
from commsched.ps.report import ServerReport


def prepare_or_serve(model: torch.nn.Module, optimizer: torch.optim.Optimizer, num_servers: int,
                     ps_mode: str = "sync", ps_max_staleness: int | None = None, block_mb: float | None = 0.5,
                     reports: list[ServerReport] | None = None, **strategy_fields: object):
    """``prepare()`` with the parameter-server backend on a worker (the model and optimizer back); on
    a server rank ``serve()`` until the workers finish, then None (its report appended to ``reports``)."""
    backend = commsched.ParameterServer(num_servers=num_servers, mode=ps_mode, max_staleness=ps_max_staleness,
                                        block_mb=block_mb)
    strategy = commsched.Strategy(backend=backend, **strategy_fields)
    if commsched.is_server_rank(num_servers):
        report = commsched.serve(model, optimizer, strategy)
        if reports is not None:
            reports.append(report)
        return None
    return commsched.prepare(model, optimizer, strategy)

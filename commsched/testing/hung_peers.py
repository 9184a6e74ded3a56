"""A peer that stops participating: where rank 1 stops, the timeout rank 0 must name, and the
small prepared model and training step both run (tests/distributed/test_misuse.py; tests/gpu
on CUDA).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _get_default_store

import commsched
from commsched.testing.models import ParityNet


def prepared(strategy=None, device="cpu"):
    torch.manual_seed(0)
    model = ParityNet().to(device)
    return commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)


def train_step(model, optimizer):
    device = next(model.parameters()).device
    x, y = torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


HANG_POINTS = {
    0: r"agreement on the parameter order .* within 2 s",  # the first forward pass
    1: r"all-reduce of gradient bucket \d+ .* within 2 s",
    3: r"broadcast of rank 0's choice of partitions .* within 2 s",  # the plan's collectives
}


def hung_peer(rank: int, world_size: int, hang_at: int, device: str = "cpu") -> float | None:
    """Rank 1 stops participating before iteration ``hang_at``; rank 0 must fail after
    Strategy.timeout_s, not hang."""
    import pytest

    store = _get_default_store()
    model, optimizer = prepared(commsched.Strategy(timeout_s=2.0), device)
    for _ in range(hang_at):
        train_step(model, optimizer)
    if rank == 1:
        store.wait(["rank 0 gave up"])
        # Rank 0 is leaving. Whether this rank's collective still completes (rank 0's
        # half may already sit in its socket) or fails is up to timing; it must not
        # hang, which the harness's timeout checks. Before the first forward pass, the
        # forward alone meets rank 0's collective: a backward after it would leave an
        # all-reduce that no rank ever joins in flight when rank 0's sockets close,
        # which gloo may answer by ending this process.
        try:
            if hang_at == 0:
                model(torch.randn(4, 8, device=device))
            else:
                train_step(model, optimizer)
        except commsched.CommunicationTimeout:
            pass
        store.set("rank 1 is done", "1")
        return None
    start = time.monotonic()
    try:
        with pytest.raises(commsched.CommunicationTimeout, match=HANG_POINTS[hang_at]):
            train_step(model, optimizer)
        return time.monotonic() - start
    finally:
        store.set("rank 0 gave up", "1")
        # Rank 1's late step completes the operations rank 0 left in flight; rank 0 must
        # not reach interpreter shutdown before they do (a completion arriving during
        # finalization aborts the process: see [Note: exit after a failure]).
        store.wait(["rank 1 is done"])

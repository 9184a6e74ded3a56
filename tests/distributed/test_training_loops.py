"""Training loops beyond the README's: each trains exactly like one process on the concatenated batch.

Activation checkpointing (both kinds, also where the first gradients come from
a nested backward pass), a ``step()`` without a backward pass, a penalty on the
parameters read before or after the forward pass, weight clipping and an EMA
right after ``step()``; on the all-reduce backend with and without forward
overlap, and on parameter servers.
"""

from __future__ import annotations

import pytest

import commsched
from commsched.testing import run_subtests
from commsched.testing.loops import LOOPS, case
from commsched.testing.servers import prepare_or_serve
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

def all_reduce(strategy):
    return lambda model, optimizer: commsched.prepare(model, optimizer, strategy)


def loops_on_all_reduce(rank: int, world_size: int) -> None:
    cases = {}
    for label, strategy in (("default", commsched.Strategy()),
                            ("no_overlap", commsched.Strategy(overlap_forward=False)),
                            ("no_priority", commsched.Strategy(priority=False))):
        prepare = all_reduce(strategy)
        for reentrant in (True, False):
            for checkpointed in ("middle", "last"):
                kind = "reentrant" if reentrant else "non_reentrant"
                cases[f"{label} {kind} checkpoint of {checkpointed}"] = case(
                    world_size, rank, "plain", "sgd_momentum", reentrant, checkpointed, prepare)
        for loop in LOOPS[1:]:
            cases[f"{label} {loop}"] = case(world_size, rank, loop, "sgd_momentum", prepare=prepare)
    default = all_reduce(commsched.Strategy())
    for loop in ("step_without_backward", "step_twice", "zero_grad_before_step", "penalty_before_forward"):
        cases[f"adam {loop}"] = case(world_size, rank, loop, "adam", prepare=default)
    cases["penalty before forward with reentrant checkpoints"] = case(
        world_size, rank, "penalty_before_forward", "sgd_momentum", True, "middle", default)
    run_subtests(cases)


@in_shared_ranks(loops_on_all_reduce, 2, timeout_s=400)
def test_training_loops_on_all_reduce(shared_ranks):
    shared_ranks.result()


def loops_on_parameter_servers(rank: int, world_size: int) -> None:
    workers = world_size - 1

    def prepare(model, optimizer):
        return prepare_or_serve(model, optimizer, num_servers=1)

    cases = {}
    for reentrant in (True, False):
        for checkpointed in ("middle", "last"):
            cases[f"{'reentrant' if reentrant else 'non_reentrant'} checkpoint of {checkpointed}"] = case(
                workers, rank, "plain", "sgd_momentum", reentrant, checkpointed, prepare)
    # A step after zero_grad() between backward() and step(), or twice on the same gradients, is
    # refused there (tests/distributed/test_ps.py); clipping weights on a worker is not supported.
    for loop in ("step_without_backward", "penalty_before_forward", "penalty_after_forward", "ema_after_step"):
        cases[loop] = case(workers, rank, loop, "adam", prepare=prepare)
    run_subtests(cases)


@in_shared_ranks(loops_on_parameter_servers, 3, timeout_s=400)
def test_training_loops_on_parameter_servers(shared_ranks):
    shared_ranks.result()

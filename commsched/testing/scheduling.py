"""The scheduling grid: every combination of priority, partitions, credit and forward overlap with
each optimizer, against one process (tests/distributed/test_scheduling.py; tests/gpu on CUDA),
and commsched's log records collected on a rank.
"""

from __future__ import annotations

import functools
import itertools
import logging

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing.parity import SCHEDULING_OPTIMIZERS, TINY_CREDIT_MB, TINY_PARTITION_MB, train_and_compare
from commsched.testing.subtests import run_subtests


ITERATIONS = WARMUP_ITERATIONS + 4  # several iterations with the plan and with overlap


def strategy_grid():
    for priority, partition, credit, overlap in itertools.product((False, True), repeat=4):
        name = f"priority={priority},partitions={partition},credit={credit},overlap={overlap}"
        yield name, commsched.Strategy(
            priority=priority,
            partition_mb=TINY_PARTITION_MB if partition else None,
            credit_mb=TINY_CREDIT_MB if credit else None,
            overlap_forward=overlap,
            bucket_cap_mb=0.004,
            first_bucket_mb=0.001,
            adaptive=False,  # these very partitions after warm-up (the cost model: test_partitioning_choice)
        )


def scheduling_grid(rank: int, world_size: int, device: str = "cpu") -> None:
    cases = {}
    for (name, strategy), optimizer_name in itertools.product(strategy_grid(), SCHEDULING_OPTIMIZERS):
        cases[f"{optimizer_name}/{name}"] = functools.partial(
            train_and_compare, rank, world_size, optimizer_name, strategy, device=device
        )
    run_subtests(cases)


class collected_logs:
    """Collects commsched's log records (pytest's caplog does not reach spawned ranks)."""

    def __enter__(self):
        self.records = []
        self.handler = logging.Handler()
        self.handler.emit = self.records.append
        logging.getLogger("commsched").addHandler(self.handler)
        return self.records

    def __exit__(self, *exc):
        logging.getLogger("commsched").removeHandler(self.handler)

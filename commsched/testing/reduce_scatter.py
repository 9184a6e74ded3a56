"""Reduce-scattered gradients (``AllReduce(shard_optimizer=True, reduce_scatter=True)``): the
strategies of its suite (tests/distributed/test_reduce_scatter.py) and the cases that take a
device (tests/gpu runs them on CUDA).
"""

from __future__ import annotations

import functools
import itertools

import commsched
from commsched.testing.join import batch_counts
from commsched.testing.parity import TINY_CREDIT_MB, TINY_PARTITION_MB, train_and_compare
from commsched.testing.sharded import case_uneven_inputs_under_join
from commsched.testing.subtests import run_subtests


SCATTERED = commsched.AllReduce(shard_optimizer=True, reduce_scatter=True)


def scattered(**fields) -> commsched.Strategy:
    return commsched.Strategy(backend=SCATTERED, **fields)


STRATEGIES = {
    "default": scattered(),
    "small_buckets": scattered(bucket_cap_mb=0.002, first_bucket_mb=0.0005, adaptive=False),
    "one_bucket_per_tensor": scattered(bucket_cap_mb=1e-6, first_bucket_mb=1e-6),
    "tiny_partitions_and_credit": scattered(bucket_cap_mb=0.004, first_bucket_mb=0.001,
                                            partition_mb=TINY_PARTITION_MB, credit_mb=TINY_CREDIT_MB, adaptive=False),
    "no_priority": scattered(priority=False, bucket_cap_mb=0.002, first_bucket_mb=0.0005),
    "no_overlap": scattered(overlap_forward=False, bucket_cap_mb=0.002, first_bucket_mb=0.0005, adaptive=False),
    "unfused": scattered(fuse_optimizer=False, bucket_cap_mb=0.002, first_bucket_mb=0.0005, adaptive=False),
}
"""Small buckets keep their layout (``adaptive=False``): the cost model would lay ParityNet out in
one bucket after warm-up, the first, which is all-reduced. "default" and "one_bucket_per_tensor"
keep the cost model's choice (the latter's layout is cut anew at the end of warm-up)."""


def assert_scattering(model) -> None:
    status = commsched.status(model)
    assert "reduce-scatter" in status.transport, status.transport


def reduce_scatter_on_device(rank: int, world_size: int, device: str) -> None:
    """The cases that take a device (tests/gpu runs them on CUDA)."""
    cases = {}
    for label, optimizer_name in itertools.product(("default", "tiny_partitions_and_credit", "no_overlap"),
                                                   ("sgd_nesterov", "adamw")):
        cases[f"{label}/{optimizer_name}"] = functools.partial(
            train_and_compare, rank, world_size, optimizer_name, STRATEGIES[label], device=device)
    cases["uneven inputs under Join"] = functools.partial(
        case_uneven_inputs_under_join, rank, world_size, "adam", STRATEGIES["default"], batch_counts, False, device,
        check_prepared=assert_scattering)
    run_subtests(cases)

"""The harness itself: results come back, and every kind of failure is reported, not hung."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from commsched.testing import RanksFailed, run_ranks

pytestmark = pytest.mark.distributed


def sum_of_ranks(rank: int, world_size: int, scale: int) -> int:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return int(t)


def rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")


def rank0_hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def rank1_dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)


def test_results_come_back_in_rank_order():
    assert run_ranks(sum_of_ranks, 3, 10, timeout_s=60) == [30, 30, 30]


def test_a_raising_rank_is_reported_with_its_traceback():
    with pytest.raises(RanksFailed, match=r"(?s)1 of 2 ranks failed.*rank 1.*deliberate failure on rank 1"):
        run_ranks(rank1_raises, 2, timeout_s=60)


def test_a_hanging_rank_is_killed_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"(?s)rank 0 -----\ndid not finish within the time limit"):
        run_ranks(rank0_hangs, 2, timeout_s=8)
    assert time.monotonic() - start < 30


def test_a_dying_rank_is_reported():
    with pytest.raises(RanksFailed, match=r"(?s)rank 1 -----\nprocess exited with code 3"):
        run_ranks(rank1_dies, 2, timeout_s=60)

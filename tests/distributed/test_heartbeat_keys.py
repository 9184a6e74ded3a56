"""Heartbeats live in the job's store under the job's prefix, as every other key of the job."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from commsched.comm.heartbeat import Heartbeat
from commsched.testing.launch import rank_store
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed


def heartbeat_keys(rank: int, world_size: int) -> bool:
    """Whether this rank's heartbeat shows in the bare store too, once it shows under the job's prefix."""
    beat = Heartbeat.of_group(dist.group.WORLD)
    try:
        key = f"commsched/heartbeat/{rank}"
        _get_default_store().wait([key], datetime.timedelta(seconds=5))  # through torch's prefix for the job
        return rank_store().check([key])
    finally:
        beat.stop()


@in_shared_ranks(heartbeat_keys, 2, timeout_s=60)
def test_heartbeats_are_written_under_the_jobs_prefix(shared_ranks):
    assert shared_ranks.result() == [False, False]

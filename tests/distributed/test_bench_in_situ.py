"""A bench cell's profile taken on its own hosts (`commsched.bench.in_situ`), here on two loopback ranks."""

from __future__ import annotations

import pytest

from commsched.bench.compare import ComparisonConfig
from commsched.bench.in_situ import profile_on_rank
from commsched.bench.models import WORKLOADS
from commsched.profiling.profile import Profile
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed


def profile_demo(rank: int, world_size: int) -> dict | None:
    return profile_on_rank(rank, world_size, ComparisonConfig(workload="demo-mlp", batch_size=16), iterations=2)


@in_shared_ranks(profile_demo, 2, timeout_s=240)
def test_rank_0_gets_the_profile_with_the_link_of_every_worker(shared_ranks):
    first, second = shared_ranks.result()
    assert second is None
    profile = Profile.from_dict(first)
    assert profile.model == "demo-mlp" and profile.batch_size == 16
    assert profile.link is not None and profile.link.world_size == 2
    trainable = [p for p in WORKLOADS["demo-mlp"].build().parameters() if p.requires_grad]
    assert [p.numel for p in profile.parameters] == [p.numel() for p in trainable]
    assert profile.forward_s > 0 and profile.backward_s > 0

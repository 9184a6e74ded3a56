"""Measuring a link (`commsched.profiling.link.measure_link`) on two real gloo ranks over loopback."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from commsched.profiling.link import measure_link, profile_on_group
from commsched.testing import run_subtests
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

SIZES = (2**12, 2**24, 2**26)
"""Far apart: on a shared host, loopback all-reduces below a few MiB take from 0.3 to 4 ms by the
scheduler's whim, so sizes closer together are not reliably ordered by their times."""


def busy() -> None:
    """A few milliseconds of matrix products on this rank's one thread."""
    a = torch.randn(192, 192)
    for _ in range(20):
        a = torch.tanh(a @ a)


def measure_on_rank(rank: int, world_size: int) -> dict:
    link = measure_link(dist.group.WORLD, "cpu", SIZES, repeats=5, compute=busy, timeout_s=60)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    profile = profile_on_group(model, lambda: (torch.randn(8, 16), torch.randint(4, (8,))), F.cross_entropy,
                               iterations=2, warmup=1, sizes_bytes=(2**12, 2**16), repeats=3, timeout_s=60)
    return {"link": link, "profile": profile}


@in_shared_ranks(measure_on_rank, 2, timeout_s=240)
def test_the_link_of_two_ranks(shared_ranks):
    first, second = shared_ranks.result()

    def same_on_every_rank():
        assert first["link"] == second["link"]
        assert first["profile"].link == second["profile"].link

    def sizes_and_times_grow_together():
        link = first["link"]
        assert link.world_size == 2
        assert [s.nbytes for s in link.samples] == list(SIZES)
        times = [s.seconds for s in link.samples]
        assert all(t > 0 for t in times) and times == sorted(times), times

    def the_fit_is_sane():
        link = first["link"]
        assert 0 < link.latency_s < link.samples[-1].seconds
        assert link.bytes_per_s > 0
        # The line passes near the largest sample (within a factor of two either way).
        assert 0.5 < link.duration_s(SIZES[-1]) / link.samples[-1].seconds < 2.0

    def gloo_runs_two_at_once():
        assert first["link"].in_flight == 2

    def a_slowdown_that_is_never_negative():
        assert 0.0 <= first["link"].compute_slowdown < 100.0
        assert 0.0 <= first["link"].collective_slowdown <= 19.0  # see [Note: slowdown of the all-reduces]

    def the_profile_of_a_group_carries_its_link():
        profile = first["profile"]
        assert profile.link is not None and profile.link.world_size == 2
        assert [s.nbytes for s in profile.link.samples] == [2**12, 2**16]
        assert profile.link.compute_slowdown >= 0.0
        assert len(profile.parameters) == 4

    run_subtests({name: case for name, case in locals().items() if callable(case)})


import pytest

from commsched.testing import run_ranks
from tests.shared_ranks import shared_ranks, shared_spawns  # noqa: F401 - fixtures, found here by pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "shared_ranks(group, world_size, tmp_dir): runs its ranks in a spawn shared with the "
                   "other tests of its world size (tests/shared_ranks.py)")


@pytest.fixture
def ranks():
    """``ranks(fn, world_size, *args, timeout_s=...)``: run ``fn`` on real gloo ranks."""
    return run_ranks

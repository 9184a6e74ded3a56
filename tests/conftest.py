import pytest

from commsched.testing import run_ranks
from tests import shared_ranks as spawns_module
from tests.shared_ranks import shared_ranks, shared_spawns  # noqa: F401 - fixtures, found here by pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "shared_ranks(group, world_size, tmp_dir): runs its ranks in a spawn shared with the "
                   "other tests of its world size (tests/shared_ranks.py)")


@pytest.fixture
def ranks():
    """``ranks(fn, world_size, *args, timeout_s=...)``: run ``fn`` on real gloo ranks."""
    return run_ranks


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """With ``--durations``, the slowest groups of the shared spawns too (tests/shared_ranks.py)."""
    durations = config.getoption("durations", None)
    spawns = config.stash.get(spawns_module.SHARED_SPAWNS_KEY, None)
    if durations is None or spawns is None or not spawns.outcomes:
        return
    terminalreporter.section("slowest groups of the shared spawns")
    for line in spawns_module.slowest_groups(spawns.outcomes, durations):
        terminalreporter.write_line(line)

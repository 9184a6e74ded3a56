import pytest

from commsched.testing import run_ranks
from commsched.testing.shared_ranks import SharedResult, SharedSpawns, slowest_groups

SHARED_SPAWNS_KEY = pytest.StashKey[SharedSpawns]()
"""Where the session's `SharedSpawns` is kept for the terminal summary."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "shared_ranks(group, world_size, tmp_dir): runs its ranks in a spawn shared with the "
                   "other tests of its world size (commsched/testing/shared_ranks.py)")


@pytest.fixture
def ranks():
    """``ranks(fn, world_size, *args, timeout_s=...)``: run ``fn`` on real gloo ranks."""
    return run_ranks


@pytest.fixture(scope="session")
def shared_spawns(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SharedSpawns:
    spawns = SharedSpawns(request.session, tmp_path_factory)
    request.config.stash[SHARED_SPAWNS_KEY] = spawns
    return spawns


@pytest.fixture
def shared_ranks(request: pytest.FixtureRequest, shared_spawns: SharedSpawns) -> SharedResult:
    """This test's group's outcome in the shared spawn of its world size (see `in_shared_ranks` in
    commsched/testing/shared_ranks.py)."""
    return shared_spawns.result_of(request.node)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """With ``--durations``, the slowest groups of the shared spawns too (commsched/testing/shared_ranks.py)."""
    durations = config.getoption("durations", None)
    spawns = config.stash.get(SHARED_SPAWNS_KEY, None)
    if durations is None or spawns is None or not spawns.outcomes:
        return
    terminalreporter.section("slowest groups of the shared spawns")
    for line in slowest_groups(spawns.outcomes, durations):
        terminalreporter.write_line(line)

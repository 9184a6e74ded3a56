import pytest

from commsched.testing import run_ranks


@pytest.fixture
def ranks():
    """``ranks(fn, world_size, *args, timeout_s=...)``: run ``fn`` on real gloo ranks."""
    return run_ranks

"""``Strategy(check_finite=...)``: one rank's inf or NaN skips the step on every rank, then warns or raises.

Rank 1 alone puts an inf into one parameter's gradient at some iterations, in
warm-up (no forward overlap) and after it (updates pending at the gates). The
run must end with the parameters of one process that skipped exactly those
steps, on every kernel path (torch's fused kernels take the verdict on the
device; the others skip on the host; an optimizer without per-bucket updates
steps itself), and name rank 1 and the parameter. Under a ``GradScaler`` the
scaler's verdict rules, and nothing is raised. ``tests/gpu/`` runs the same cases
on CUDA (one rank alone puts in the inf there: rank 0). The cases are in
`commsched.testing.check_finite`.
"""

from __future__ import annotations

import pytest

from commsched.testing.check_finite import check_finite
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed


@in_shared_ranks(check_finite, 2, timeout_s=240)
def test_check_finite(shared_ranks):
    shared_ranks.result()


@in_shared_ranks(check_finite, 1, timeout_s=240)
def test_check_finite_one_rank(shared_ranks):
    """The cases tests/gpu runs on one NCCL rank, here on CPU."""
    shared_ranks.result()

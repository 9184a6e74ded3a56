"""Helpers to test data-parallel code on real processes."""

from commsched.testing.groups import Group, GroupOutcome, run_groups
from commsched.testing.launch import RanksFailed, run_ranks
from commsched.testing.reference import (
    OPTIMIZERS,
    assert_equal_on_all_ranks,
    assert_same_parameters,
    one_process_backward,
    one_process_gradients_as_all_reduce,
    one_process_loss,
    one_process_step,
    reference_copy,
)
from commsched.testing.subtests import run_subtests

__all__ = [
    "OPTIMIZERS",
    "Group",
    "GroupOutcome",
    "RanksFailed",
    "assert_equal_on_all_ranks",
    "assert_same_parameters",
    "one_process_backward",
    "one_process_gradients_as_all_reduce",
    "one_process_loss",
    "one_process_step",
    "reference_copy",
    "run_groups",
    "run_ranks",
    "run_subtests",
]

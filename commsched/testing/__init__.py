"""Helpers to test data-parallel code on real processes."""

from commsched.testing.launch import RanksFailed, run_ranks
from commsched.testing.subtests import run_subtests

__all__ = ["RanksFailed", "run_ranks", "run_subtests"]

"""Helpers to test data-parallel code on real processes (see `run_ranks`)."""

from commsched.testing.harness import RanksFailed, run_ranks, run_subtests

__all__ = ["RanksFailed", "run_ranks", "run_subtests"]

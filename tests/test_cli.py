"""The ``commsched`` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "commsched.cli", *args],
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.distributed
def test_demo_prints_both_systems_with_equal_losses():
    done = run_cli("demo", "--iterations", "3", "--rounds", "2", "--warmup", "1", "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch DDP" in done.stdout and "commsched" in done.stdout and "commsched PS, 1 server" in done.stdout
    assert "losses agree to 4 decimals: yes" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["demo", "--world-size", "0"], "--world-size must be at least 1"),
    (["demo", "--ps-servers", "-1"], "--ps-servers must be at least 0"),
    (["demo", "--workload", "nope"], "invalid choice"),
    (["demo", "--bucket-cap-mb", "-1"], "Strategy.bucket_cap_mb must be finite and greater than 0"),
])
def test_bad_arguments_say_what_to_change(args, message):
    done = run_cli(*args, timeout=60)
    assert done.returncode != 0
    assert message in done.stderr

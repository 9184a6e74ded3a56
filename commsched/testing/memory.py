"""This process's memory, as the tests that bound it read it (Linux)."""

from __future__ import annotations

import os


def resident_mib() -> float:
    """This process's resident set size now, in MiB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

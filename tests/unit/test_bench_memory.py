"""The peak RSS measurement fixes glibc's mmap threshold (see commsched/bench/memory.py): blocks
freed go back to the system, instead of staying resident for reuse."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

RESIDENT_AFTER_FREEING = """
import ctypes, os, sys
from commsched.bench.memory import fix_mmap_threshold
if sys.argv[1] == "fixed":
    fix_mmap_threshold()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
MIB = 2**20
def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB
def touched(nbytes):
    block = libc.malloc(nbytes)
    ctypes.memset(block, 1, nbytes)
    return block
libc.free(touched(16 * MIB))  # with glibc's defaults, smaller blocks now come from the heap, kept
before = resident_mib()
blocks = [touched(6 * MIB) for _ in range(4)]
for block in blocks:
    libc.free(block)
print(resident_mib() - before)
"""


def resident_after_freeing_mib(allocator: str) -> float:
    out = subprocess.run([sys.executable, "-c", RESIDENT_AFTER_FREEING, allocator], check=True, timeout=120,
                         capture_output=True, text=True).stdout
    return float(out)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_blocks_leave_the_peak_only_with_the_threshold_fixed():
    # In processes of their own: the test process keeps its allocator as it is.
    assert resident_after_freeing_mib("defaults") > 16, "glibc's defaults no longer keep freed blocks"
    assert resident_after_freeing_mib("fixed") < 4

"""The bench's CPU guard: how busy the cores were while a cell ran, and whether they set its pace."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commsched.bench.cpu_guard import (
    CORES_BUSY_THRESHOLD,
    PROC_STAT,
    CpuSampler,
    cores_set_the_pace,
    percentile,
    read_cpu_times,
)

needs_proc_stat = pytest.mark.skipif(not PROC_STAT.exists(), reason="no /proc/stat on this platform")


def stat_text(busy: int, idle: int, iowait: int = 0) -> str:
    """A /proc/stat with the aggregate line only: ``busy`` jiffies split over user, system and softirq."""
    user, system = busy // 2, busy // 4
    softirq = busy - user - system
    return f"cpu  {user} 0 {system} {idle} {iowait} 0 {softirq} 0 0 0\nctxt 1\n"


def write(path: Path, text: str) -> None:
    """Replace ``path`` at once, so that a reader never sees half a file."""
    part = path.with_suffix(".part")
    part.write_text(text)
    os.replace(part, path)


def test_the_cores_set_the_pace_from_the_threshold_up():
    assert CORES_BUSY_THRESHOLD == 0.85
    assert cores_set_the_pace(0.85) and cores_set_the_pace(0.97) and cores_set_the_pace(1.0)
    assert not cores_set_the_pace(0.84) and not cores_set_the_pace(0.0)
    assert not cores_set_the_pace(None)  # not measured: never marked
    assert cores_set_the_pace(0.6, threshold=0.5) and not cores_set_the_pace(0.6, threshold=0.7)


def test_percentile_interpolates_between_the_nearest_two():
    assert percentile([0.5], 0.9) == 0.5
    assert percentile([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 0.0], 0.9) == pytest.approx(0.9)
    assert percentile([0.0, 1.0], 0.9) == pytest.approx(0.9)


def test_busy_is_everything_but_idle_and_iowait_over_the_cores_asked(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 50 800 40 3 2 10 7 1\n"
                    "cpu0 60 5 30 350 10 3 2 5 7 1\n"
                    "cpu1 40 0 20 450 30 0 0 5 0 0\n"
                    "intr 1 2 3\n")
    # guest and guest_nice (the last two) are already in user and nice: not counted twice
    assert read_cpu_times(stat) == (100 + 5 + 50 + 3 + 2 + 10, 1010)
    assert read_cpu_times(stat, {1}) == (65, 545)
    assert read_cpu_times(stat, {0, 1}) == (170, 1010)
    assert read_cpu_times(stat, {0, 7}) == (170, 1010)  # a CPU it does not list: every CPU
    assert read_cpu_times(tmp_path / "missing") is None


def test_the_sampler_gives_the_share_of_each_interval(tmp_path):
    """The counters advance 9 busy jiffies for each idle one: every sample reads 0.9."""
    stat = tmp_path / "stat"
    write(stat, stat_text(busy=1000, idle=1000))
    with CpuSampler(interval_s=0.02, path=stat) as sampler:
        for step in range(1, 11):
            time.sleep(0.03)
            write(stat, stat_text(busy=1000 + 90 * step, idle=1000 + 5 * step, iowait=5 * step))
        time.sleep(0.05)
    use = sampler.summary()
    assert use is not None and use.samples >= 3
    assert use.median == pytest.approx(0.9) and use.p90 == pytest.approx(0.9)
    assert use.cores_set_the_pace
    assert use.cores == (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())


def test_without_proc_stat_there_is_no_summary_and_no_mark(tmp_path):
    with CpuSampler(interval_s=0.01, path=tmp_path / "missing") as sampler:
        time.sleep(0.05)
    assert sampler.summary() is None
    assert not cores_set_the_pace(None)


@needs_proc_stat
def test_the_sampler_sees_a_busy_process():
    spin = "import time\nend = time.monotonic() + 1.0\nwhile time.monotonic() < end: pass\n"
    with CpuSampler(interval_s=0.1) as sampler:
        subprocess.run([sys.executable, "-c", spin], check=True, timeout=30)
    use = sampler.summary()
    assert use is not None and use.samples >= 5
    # one of the cores was spinning all along, whatever else the machine was doing
    assert use.median >= 0.8 / use.cores and use.p90 >= use.median
    assert 0 < use.median <= 1 and use.p90 <= 1


@needs_proc_stat
def test_the_sampler_works_while_the_machine_idles():
    with CpuSampler(interval_s=0.1) as sampler:
        time.sleep(0.5)
    use = sampler.summary()
    assert use is not None and use.samples >= 3
    assert 0 <= use.median <= use.p90 <= 1
    assert use.cores_set_the_pace == (use.median >= CORES_BUSY_THRESHOLD)

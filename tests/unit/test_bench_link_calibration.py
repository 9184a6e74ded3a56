"""benchmarks/link_calibration.py's table row and its refusal of a bad count (the cluster run needs root)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "link_calibration.py"


@pytest.fixture(scope="module")
def calibration():
    spec = importlib.util.spec_from_file_location("link_calibration_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_row_counts_the_calibrations_far_off(calibration):
    fixed_ms = [0.2] * 8 + [1.5, 4.0]
    samples = [{"round_trip_s": f / 1e3, "fixed_s": f / 1e3, "bytes_per_s": 119e6 + i * 1e5}
               for i, f in enumerate(fixed_ms)]
    row = calibration.summary(1.0, samples, far_ms=1.0)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:6] == ["1", "10", "0.200", "3.750", "4.000", "2"]
    assert cells[6:] == ["119.5", "119.0-119.9"]


def test_a_count_below_one_is_refused_before_any_cluster(calibration, capsys):
    with pytest.raises(SystemExit):
        calibration.main(["--calibrations", "0"])
    assert "--calibrations must be at least 1" in capsys.readouterr().err

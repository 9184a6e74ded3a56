"""The loopback comparison's arithmetic (commsched.bench.loopback): best DDP per repeat, the ratios
and the table row; its MLP."""

from __future__ import annotations

import pytest

from commsched.bench import loopback
from commsched.bench.models import WORKLOADS
from commsched.bench.repeats import Repeat


def repeat(ddp5: float, ddp25: float, ddp100: float, off: float, ours: float) -> Repeat:
    names = [system.name for system in (*loopback.DDP_SWEEP, loopback.OFF, loopback.OURS)]
    return Repeat(dict(zip(names, (ddp5, ddp25, ddp100, off, ours))))


def test_ratios_against_ddp_and_its_best_bucket_size():
    r = repeat(0.09, 0.10, 0.11, 0.1, 0.099)
    assert r.fastest(loopback.DDP_NAMES) == "torch DDP, bucket_cap_mb=5"
    assert r.ratio(loopback.OURS.name, loopback.DDP.name) == pytest.approx(0.99)
    assert r.ratio(loopback.OURS.name, loopback.DDP_NAMES) == pytest.approx(1.1)


def test_table_row_gives_medians_and_each_repeat():
    repeats = [repeat(0.09, 0.10, 0.11, 0.1, 0.099), repeat(0.12, 0.10, 0.13, 0.1, 0.08),
               repeat(0.2, 0.2, 0.1, 0.1, 0.1)]
    row = loopback.table_row("mlp", 4, 32, repeats)
    assert len(row) == len(loopback.COLUMNS)
    assert row[:4] == ["mlp", "4", "32", "100.0"]
    assert row[4] == "100.0 (5 25 100)"  # best DDP: 90, 100, 100 ms
    assert row[7] == "0.800 (0.990 0.800 0.500)"
    assert row[8] == "1.000 (1.100 0.800 1.000)"


def test_defaults_cover_two_and_four_ranks_and_three_models():
    args = loopback.build_parser().parse_args([])
    assert args.world_sizes == [2, 4] and args.models == ["mlp", "resnet-like", "transformer-like"]


def test_mlp_has_about_2_9_million_parameters():
    model = WORKLOADS["mlp"].build()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(2.9e6, rel=0.01)
    x, _ = next(WORKLOADS["mlp"].batches(2))
    assert model(x).shape == (2, 10)

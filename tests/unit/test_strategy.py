from __future__ import annotations

import dataclasses
import math

import pytest

from commsched import AllReduce, ParameterServer, Strategy
from commsched.strategy import MIB


def test_defaults_match_ddp():
    strategy = Strategy()
    assert strategy.bucket_cap_mb == 25.0
    assert strategy.first_bucket_mb == 1.0
    assert strategy.broadcast_buffers is True
    assert Strategy(partition_mb=None).bucket_size_limits_bytes == [1 * MIB, 25 * MIB]
    assert strategy.bucket_size_limits_bytes == [1 * MIB, int(strategy.partition_mb * MIB)]


@pytest.mark.parametrize("field", ["bucket_cap_mb", "first_bucket_mb", "timeout_s"])
@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, "25", None, True])
def test_bad_numbers_name_the_field_and_range(field, value):
    with pytest.raises(ValueError) as error:
        Strategy(**{field: value})
    message = str(error.value)
    assert f"Strategy.{field}" in message
    assert repr(value) in message
    assert "greater than 0" in message or "must be a number" in message


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_bad_flags_name_the_field(value):
    with pytest.raises(ValueError, match=r"Strategy.broadcast_buffers must be True or False"):
        Strategy(broadcast_buffers=value)


def test_frozen_and_keyword_only():
    strategy = Strategy(bucket_cap_mb=4)
    with pytest.raises(AttributeError):
        strategy.bucket_cap_mb = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        Strategy(4)  # type: ignore[misc]
    assert "bucket_cap_mb=4" in strategy.describe()


@pytest.mark.parametrize("field", ["partition_mb", "credit_mb"])
def test_optional_sizes_accept_none_and_reject_bad_values(field):
    assert getattr(Strategy(**{field: None}), field) is None
    with pytest.raises(ValueError, match=rf"Strategy.{field} must be None or finite and greater than 0, got -2"):
        Strategy(**{field: -2})
    with pytest.raises(ValueError, match=rf"Strategy.{field} must be a number or None, got '1'"):
        Strategy(**{field: "1"})


@pytest.mark.parametrize("field", ["priority", "overlap_forward", "fuse_optimizer"])
def test_scheduling_flags_must_be_bools(field):
    with pytest.raises(ValueError, match=rf"Strategy.{field} must be True or False"):
        Strategy(**{field: 1})


def test_parameter_server_config_is_validated():
    strategy = Strategy(backend=ParameterServer(num_servers=2, mode="async"))
    assert strategy.parameter_server and strategy.ps_block_bytes == MIB
    assert strategy.backend == ParameterServer(num_servers=2, mode="async", max_staleness=None)
    assert Strategy(backend=ParameterServer(), partition_mb=None, bucket_cap_mb=2).ps_block_bytes == 2 * MIB
    assert Strategy().backend == AllReduce() and not Strategy().parameter_server
    with pytest.raises(ValueError, match=r"Strategy.backend must be commsched.AllReduce\(\) or commsched.ParameterServer"):
        Strategy(backend=3)
    with pytest.raises(ValueError, match=r"ParameterServer.mode must be one of 'sync', 'async', got 'lazy'"):
        ParameterServer(mode="lazy")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"ParameterServer.num_servers must be an integer >= 1"):
            ParameterServer(num_servers=bad)
    assert ParameterServer(mode="async", max_staleness=0).max_staleness == 0
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"ParameterServer.max_staleness must be None or an integer >= 0"):
            ParameterServer(mode="async", max_staleness=bad)
    with pytest.raises(ValueError, match=r"ParameterServer.max_staleness applies to mode='async' only"):
        ParameterServer(max_staleness=2)
    with pytest.raises(ValueError, match=r"give them inside ParameterServer\(...\) only"):
        Strategy(backend=ParameterServer(), num_servers=2)


def test_replace_moves_between_backends():
    ps = Strategy(backend=ParameterServer(num_servers=2), bucket_cap_mb=4)
    assert dataclasses.replace(ps, bucket_cap_mb=8).backend == ParameterServer(num_servers=2)
    assert dataclasses.replace(ps, backend=AllReduce()).backend == AllReduce()
    assert "num_servers" not in Strategy().describe() and "backend=AllReduce()" in Strategy().describe()


def test_flat_parameter_server_fields_are_a_deprecated_spelling():
    with pytest.warns(DeprecationWarning, match=r"write Strategy\(backend=commsched.ParameterServer"):
        strategy = Strategy(backend="ps", num_servers=2, ps_mode="async")
    assert strategy.parameter_server and strategy.ps_block_bytes == MIB
    assert strategy.backend == ParameterServer(num_servers=2, mode="async")
    assert strategy.num_servers is None  # input only: the config holds the value
    with pytest.warns(DeprecationWarning):
        assert Strategy(backend="ps", partition_mb=None, bucket_cap_mb=2).ps_block_bytes == 2 * MIB
    with pytest.warns(DeprecationWarning):
        assert Strategy(backend="allreduce").backend == AllReduce()
    with pytest.raises(ValueError, match=r"Strategy.backend must be one of 'allreduce', 'ps', got 'nccl'"):
        Strategy(backend="nccl")
    with pytest.raises(ValueError, match=r"Strategy.ps_mode must be one of 'sync', 'async', got 'lazy'"):
        Strategy(backend="ps", ps_mode="lazy")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"Strategy.num_servers must be an integer >= 1"):
            Strategy(backend="ps", num_servers=bad)
    with pytest.raises(ValueError, match=r"apply to backend='ps' only"):
        Strategy(num_servers=2)
    with pytest.raises(ValueError, match=r"apply to backend='ps' only"):
        Strategy(ps_mode="async")


def test_flat_staleness_bound_is_validated():
    with pytest.warns(DeprecationWarning):
        assert Strategy(backend="ps", ps_mode="async", ps_max_staleness=0).backend.max_staleness == 0
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"Strategy.ps_max_staleness must be None or an integer >= 0"):
            Strategy(backend="ps", ps_mode="async", ps_max_staleness=bad)
    for sync in ({"backend": "ps"}, {}):
        with pytest.raises(ValueError, match=r"ps_max_staleness applies to backend='ps' with ps_mode='async'"):
            Strategy(ps_max_staleness=2, **sync)


def test_server_ranks_are_the_last_ones():
    from commsched.ps import is_server_rank, server_ranks

    assert server_ranks(5, 2) == [3, 4]
    assert is_server_rank(2, rank=4, world_size=5) and not is_server_rank(2, rank=2, world_size=5)
    with pytest.raises(ValueError, match=r"needs at least one worker besides the servers"):
        server_ranks(2, 2)

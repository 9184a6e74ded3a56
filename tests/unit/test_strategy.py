from __future__ import annotations

import dataclasses
import datetime
import math
import pathlib
import re
import threading
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched import AllReduce, ParameterServer, PowerSGD, Strategy
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
    assert strategy.parameter_server and strategy.ps_block_bytes == MIB // 2
    assert strategy.backend == ParameterServer(num_servers=2, mode="async", max_staleness=None, block_mb=0.5)
    unlimited = ParameterServer(block_mb=None)
    assert Strategy(backend=unlimited, partition_mb=None, bucket_cap_mb=2).ps_block_bytes == 2 * MIB
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


def test_parameter_server_blocks_are_cut_to_block_mb():
    """Partitions and buckets larger than ``block_mb`` are cut to it; smaller ones are kept."""
    default = Strategy(backend=ParameterServer())
    assert default.ps_block_bytes == MIB // 2 and default.bucket_size_limits_bytes == [MIB // 2, MIB // 2]
    small = Strategy(backend=ParameterServer(block_mb=0.25), partition_mb=0.001, first_bucket_mb=0.0005)
    assert small.ps_block_bytes == int(0.001 * MIB)
    assert small.bucket_size_limits_bytes == [int(0.0005 * MIB), int(0.001 * MIB)]
    whole = Strategy(backend=ParameterServer(block_mb=None), partition_mb=None, bucket_cap_mb=2, first_bucket_mb=1)
    assert whole.ps_block_bytes == 2 * MIB and whole.bucket_size_limits_bytes == [MIB, 2 * MIB]
    assert Strategy(backend=ParameterServer(block_mb=4)).ps_block_bytes == MIB  # the partition is smaller
    assert Strategy(partition_mb=1).bucket_size_limits_bytes == [MIB, MIB]  # all-reduce has no blocks
    for bad in (0, -1.0, float("nan"), float("inf"), 2.0**21, True, "1"):
        with pytest.raises(ValueError, match=r"ParameterServer.block_mb must be"):
            ParameterServer(block_mb=bad)


def test_replace_moves_between_backends():
    ps = Strategy(backend=ParameterServer(num_servers=2), bucket_cap_mb=4)
    assert dataclasses.replace(ps, bucket_cap_mb=8).backend == ParameterServer(num_servers=2)
    assert dataclasses.replace(ps, backend=AllReduce()).backend == AllReduce()
    assert "num_servers" not in Strategy().describe() and "backend=AllReduce()" in Strategy().describe()
    assert "backend=AllReduce(shard_optimizer=True)" in Strategy(backend=AllReduce(shard_optimizer=True)).describe()


def test_flat_parameter_server_fields_are_a_deprecated_spelling():
    with pytest.warns(DeprecationWarning, match=r"write Strategy\(backend=commsched.ParameterServer"):
        strategy = Strategy(backend="ps", num_servers=2, ps_mode="async")
    assert strategy.parameter_server and strategy.ps_block_bytes == MIB // 2
    assert strategy.backend == ParameterServer(num_servers=2, mode="async")
    assert strategy.num_servers is None  # input only: the config holds the value
    with pytest.warns(DeprecationWarning):
        assert Strategy(backend="ps", partition_mb=None, bucket_cap_mb=2).ps_block_bytes == MIB // 2
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


RANGES = {
    # field: (smallest, largest, the range as the error states it)
    "bucket_cap_mb": (1 / MIB, 1024 * 1024, "9.5367431640625e-07 to 1048576 MiB (1 byte to 1 TiB)"),
    "first_bucket_mb": (1 / MIB, 1024 * 1024, "9.5367431640625e-07 to 1048576 MiB (1 byte to 1 TiB)"),
    "partition_mb": (256 / MIB, 1024 * 1024, "0.000244140625 to 1048576 MiB (256 bytes to 1 TiB)"),
    "credit_mb": (256 / MIB, 1024 * 1024, "0.000244140625 to 1048576 MiB (256 bytes to 1 TiB)"),
    "timeout_s": (1.0, 7 * 24 * 3600.0, "1 to 604800 seconds (1 s to 7 days)"),
}


@pytest.mark.parametrize("field", sorted(RANGES))
def test_numbers_have_a_range_and_its_ends_are_allowed(field):
    low, high, allowed = RANGES[field]
    assert getattr(Strategy(**{field: low}), field) == low
    assert getattr(Strategy(**{field: high}), field) == high
    for outside in (low / 2, math.nextafter(low, 0), math.nextafter(high, math.inf), high * 2):
        with pytest.raises(ValueError) as error:
            Strategy(**{field: outside})
        assert str(error.value).startswith(f"Strategy.{field} must be ")
        assert f"{allowed}, got {outside!r}" in str(error.value)


@pytest.mark.parametrize("field", sorted(RANGES))
@pytest.mark.parametrize("value", [0, -1.0, math.inf, -math.inf, math.nan, "1"])
def test_invalid_numbers_state_the_range(field, value):
    with pytest.raises(ValueError, match=rf"Strategy\.{field} must be .*got {re.escape(repr(value))}.*; allowed: "
                                         rf"(None or )?{re.escape(RANGES[field][2])}$"):
        Strategy(**{field: value})


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(sorted(RANGES)), value=st.floats(allow_nan=False, allow_infinity=False))
def test_any_finite_number_is_either_in_range_or_refused_with_the_range(field, value):
    low, high, allowed = RANGES[field]
    if low <= value <= high:
        assert getattr(Strategy(**{field: value}), field) == value
        return
    with pytest.raises(ValueError) as error:
        Strategy(**{field: value})
    message = str(error.value)
    assert f"Strategy.{field}" in message and repr(value) in message and allowed in message


@pytest.mark.parametrize("kwargs, match", [
    ({"partition_mb": 1e-9}, r"Strategy.partition_mb must be None or from 0.000244140625 to 1048576 MiB"),
    ({"credit_mb": 1e-9}, r"Strategy.credit_mb must be None or from 0.000244140625 to 1048576 MiB"),
    ({"timeout_s": 1e15},
     r"Strategy.timeout_s must be from 1 to 604800 seconds \(1 s to 7 days\), got 1000000000000000.0"),
    ({"timeout_s": 1e-9}, r"Strategy.timeout_s must be from 1 to 604800 seconds \(1 s to 7 days\), got 1e-09"),
    ({"bucket_cap_mb": 1e-300}, r"Strategy.bucket_cap_mb must be from 9.5367431640625e-07 to 1048576 MiB"),
    ({"first_bucket_mb": 1e12}, r"Strategy.first_bucket_mb must be from .* \(1 byte to 1 TiB\), got 1000000000000.0"),
])
def test_values_that_used_to_fail_later_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Strategy(**kwargs)


def test_the_longest_timeout_fits_every_wait():
    """The bound is representable by each wait a Strategy.timeout_s reaches."""
    from commsched.strategy import MAX_TIMEOUT_S

    assert datetime.timedelta(seconds=MAX_TIMEOUT_S).total_seconds() == MAX_TIMEOUT_S
    assert MAX_TIMEOUT_S <= threading.TIMEOUT_MAX
    assert MAX_TIMEOUT_S * 1e9 < 2**63  # torch's durations are int64 nanoseconds
    event = threading.Event()
    event.set()
    assert event.wait(timeout=MAX_TIMEOUT_S)  # accepted (no OverflowError), returns at once: it is set


def test_trace_dir_must_be_a_usable_path_and_naming_one_creates_nothing(tmp_path, monkeypatch):
    for bad in ("", "   ", b"trace", "tr\0ace", 3, ["trace"]):
        with pytest.raises(ValueError, match=r"Strategy.trace_dir must be None or a directory path \(a str or "
                                             r"os.PathLike, not blank, without NUL\), got "):
            Strategy(trace_dir=bad)
    with pytest.raises(ValueError, match=r"got '' \(str\); an empty path would write into the working directory"):
        Strategy(trace_dir="")
    monkeypatch.chdir(tmp_path)
    for good in ("trace", "/tmp/commsched trace", pathlib.Path("trace/run1")):
        assert Strategy(trace_dir=good).trace_dir == good
    assert list(tmp_path.iterdir()) == []  # prepare() creates it, the Strategy only names it


def test_every_field_but_trace_dir_must_agree_across_ranks():
    """describe_setup is what ranks compare at prepare(): each field changes it, trace_dir never."""
    from commsched.comm.agreement import describe_setup

    model = torch.nn.Linear(2, 2)
    base = describe_setup(Strategy(), model, None)
    assert describe_setup(Strategy(trace_dir="rank-local/trace"), model, None) == base
    # numbers are compared by value: 25 and 25.0 agree
    assert describe_setup(Strategy(bucket_cap_mb=25, timeout_s=300), model, None) == base
    changed = {
        "bucket_cap_mb": 5, "first_bucket_mb": 0.5, "broadcast_buffers": False, "priority": False,
        "partition_mb": None, "credit_mb": None, "adaptive": False, "overlap_forward": False, "fuse_optimizer": False,
        "timeout_s": 60, "backend": ParameterServer(), "autotune": True, "autotune_iterations": 20,
        "autotune_trial_iterations": 2, "autotune_seed": 7, "reduce_dtype": torch.float32,
        "check_finite": "skip", "compression": PowerSGD(),
    }
    compared = {f.name for f in dataclasses.fields(Strategy)} - {"trace_dir", "num_servers", "ps_mode",
                                                                  "ps_max_staleness"}
    assert set(changed) == compared, "a new Strategy field: decide whether ranks must agree on it"
    for field, value in changed.items():
        entries = describe_setup(Strategy(**{field: value}), model, None)
        assert [e for e in entries if e not in base][0].startswith(f"Strategy.{field} = "), field
    ps = describe_setup(Strategy(backend=ParameterServer()), model, None)
    for field, value in {"num_servers": 2, "mode": "async"}.items():
        entries = describe_setup(Strategy(backend=ParameterServer(**{field: value})), model, None)
        assert [e for e in entries if e not in ps][0].startswith(f"Strategy.backend.{field} = "), field
    stale = describe_setup(Strategy(backend=ParameterServer(mode="async", max_staleness=3)), model, None)
    assert "Strategy.backend.max_staleness = 3" in stale


AUTOTUNE_RANGES = {"autotune_iterations": (4, 100_000), "autotune_trial_iterations": (1, 100),
                   "autotune_seed": (0, 2**32 - 1)}


@pytest.mark.parametrize("field", sorted(AUTOTUNE_RANGES))
def test_autotune_numbers_are_integers_in_range(field):
    low, high = AUTOTUNE_RANGES[field]
    assert getattr(Strategy(**{field: low}), field) == low
    assert getattr(Strategy(**{field: high}), field) == high
    for bad in (low - 1, high + 1, 2.0, "3", None, True):
        with pytest.raises(ValueError, match=rf"^Strategy\.{field} must be an integer from {low} to {high}, "
                                             rf"got {re.escape(repr(bad))}$"):
            Strategy(**{field: bad})


def test_autotune_must_be_a_bool():
    with pytest.raises(ValueError, match=r"Strategy.autotune must be True or False"):
        Strategy(autotune=1)


def test_autotune_is_refused_with_parameter_servers_and_without_priority():
    with pytest.raises(ValueError, match=r"parameter-server backend keeps its blocks.*use backend=AllReduce\(\) "
                                         r"to tune, or autotune=False"):
        Strategy(autotune=True, backend=ParameterServer())
    with pytest.raises(ValueError, match=r"autotune=True\) needs priority=True.*set priority=True or "
                                         r"autotune=False"):
        Strategy(autotune=True, priority=False)
    assert Strategy(autotune=False, backend=ParameterServer(), autotune_iterations=4).autotune is False


def test_the_autotune_budget_must_hold_two_settings():
    with pytest.raises(ValueError, match=r"autotune_iterations=7 leaves room for fewer than two settings of 4 "
                                         r"iterations each .* give at least 8 iterations"):
        Strategy(autotune=True, autotune_iterations=7)
    assert Strategy(autotune=True, autotune_iterations=8).autotune_iterations == 8


def test_autotune_without_optuna_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    with pytest.raises(ImportError, match=r"pip install commsched\[tune\]"):
        Strategy(autotune=True)
    assert Strategy(autotune=False).autotune is False


# ---------------------------------------------------------------------------- reduce_dtype
def test_reduce_dtype_takes_float32_bfloat16_float16_or_none():
    assert Strategy().reduce_dtype is None
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        strategy = Strategy(reduce_dtype=dtype)
        assert strategy.reduce_dtype is dtype
        assert f"reduce_dtype={dtype}" in strategy.describe()
        assert dataclasses.replace(strategy, priority=False).reduce_dtype is dtype


@pytest.mark.parametrize("value", [torch.float64, torch.int8, "float32", "torch.bfloat16", "bf16",
                                   1, True])
def test_bad_reduce_dtypes_name_the_field_and_the_choices(value):
    with pytest.raises(ValueError) as error:
        Strategy(reduce_dtype=value)
    message = str(error.value)
    assert message.startswith(f"Strategy.reduce_dtype must be None or one of torch.float32, torch.bfloat16, "
                              f"torch.float16, got {value!r}")
    if value in ("float32", "torch.bfloat16"):  # what was meant is named
        assert f"write torch.{value.removeprefix('torch.')} (a torch.dtype, not a string)" in message


def test_reduce_dtype_is_refused_with_parameter_servers():
    for backend in (ParameterServer(), "ps"):
        with pytest.raises(ValueError, match=r"Strategy.reduce_dtype=torch.bfloat16 applies to the all-reduce "
                                             r"backend.*leave reduce_dtype at None with ParameterServer"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                Strategy(reduce_dtype=torch.bfloat16, backend=backend)


def test_reduce_dtype_widens_16_bit_gradients_and_narrows_float32_ones_only():
    from commsched.comm.reduce_dtype import wire_dtype

    f64, f32, bf16, f16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
    assert [wire_dtype(d, f32) for d in (f64, f32, bf16, f16)] == [f64, f32, f32, f32]
    assert [wire_dtype(d, bf16) for d in (f64, f32, bf16, f16)] == [f64, bf16, bf16, f16]
    assert [wire_dtype(d, f16) for d in (f64, f32, bf16, f16)] == [f64, f16, bf16, f16]
    assert [wire_dtype(d, None) for d in (f64, f32, bf16, f16)] == [f64, f32, bf16, f16]


def _bucket(dtype: torch.dtype, values: torch.Tensor, flags: int = 0):
    from commsched.layout.buckets import Bucket

    param = torch.nn.Parameter(torch.zeros(len(values), dtype=dtype))
    bucket = Bucket(0, [param], tail_numel=flags)
    bucket.grad_views[0].copy_(values)
    return bucket


def test_a_float32_gradient_goes_on_the_wire_divided_then_rounded_once():
    """Divided in float32 and rounded once (DDP's bf16_compress_hook rounds, then divides in
    bfloat16: twice); the sum comes back into the float32 bucket, the flags ride in the wire."""
    from commsched.comm.reduce_dtype import average_onto_wire, copy_back

    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    bucket = _bucket(torch.float32, values, flags=3)
    bucket.reduce_in(torch.bfloat16)
    assert bucket.wire.dtype == torch.bfloat16 and bucket.wire_nbytes * 2 == bucket.nbytes
    assert bucket.tail.data_ptr() == bucket.wire[1000:].data_ptr()
    average_onto_wire(bucket, 3)
    assert torch.equal(bucket.wire[:1000], (values / 3).to(torch.bfloat16))
    assert not torch.equal(bucket.wire[:1000], values.to(torch.bfloat16) / 3)  # the hook's double rounding
    bucket.wire[:1000].mul_(3)  # as if summed over three equal ranks
    version = bucket.flat._version
    copy_back(bucket, 0, bucket.wire.numel())
    assert torch.equal(bucket.grad_views[0], ((values / 3).to(torch.bfloat16) * 3).float())
    assert bucket.flat._version == version, "a transport's write counted as the user's"


def test_a_bfloat16_gradient_is_summed_in_float32_and_rounded_once_back():
    from commsched.comm.reduce_dtype import average_onto_wire, copy_back

    values = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bucket = _bucket(torch.bfloat16, values)
    bucket.reduce_in(torch.float32)
    assert bucket.grad_views[0].dtype == torch.bfloat16 and bucket.wire.dtype == torch.float32
    average_onto_wire(bucket, 3)
    assert torch.equal(bucket.wire, values.float() / 3)
    bucket.wire.mul_(3)
    copy_back(bucket, 0, 600)  # a partition: only its elements come back
    assert torch.equal(bucket.grad_views[0][:600], (values.float() / 3 * 3).to(torch.bfloat16)[:600])
    assert torch.equal(bucket.grad_views[0][600:], values[600:])


@pytest.mark.parametrize("value", [True, "warn", 1])
def test_check_finite_names_its_modes(value):
    with pytest.raises(ValueError, match=r"Strategy.check_finite must be one of 'skip', 'raise', got"):
        Strategy(check_finite=value)


def test_check_finite_is_refused_with_parameter_servers():
    assert Strategy(check_finite="raise").check_finite == "raise"
    with pytest.raises(ValueError, match=r"check_finite='skip' applies to the all-reduce backend"):
        Strategy(check_finite="skip", backend=ParameterServer())


def test_the_choice_is_measured_where_nothing_else_measures():
    assert Strategy().measures_its_choice
    assert not Strategy(adaptive=False).measures_its_choice
    assert not Strategy(autotune=True).measures_its_choice  # the auto-tuner measures anyway
    assert Strategy(backend=AllReduce(shard_optimizer=True)).measures_its_choice  # resharded a bucket at a time


def test_powersgd_takes_torch_powersgd_states_settings_and_defaults():
    """The names and defaults of torch's PowerSGDState, so that a DDP user's settings carry over."""
    import inspect

    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    torch_defaults = {name: p.default for name, p in inspect.signature(PowerSGDState).parameters.items()
                      if name not in ("process_group", "compression_stats_logging_frequency")}
    ours = {f.name: f.default for f in dataclasses.fields(PowerSGD)}
    assert ours == torch_defaults
    assert repr(PowerSGD()) == "PowerSGD()"
    assert repr(PowerSGD(matrix_approximation_rank=2, warm_start=False)) == (
        "PowerSGD(matrix_approximation_rank=2, warm_start=False)")


@pytest.mark.parametrize(("field", "value", "match"), [
    ("matrix_approximation_rank", 0, r"PowerSGD.matrix_approximation_rank must be an integer from 1 to"),
    ("matrix_approximation_rank", 1.5, r"PowerSGD.matrix_approximation_rank must be an integer"),
    ("start_powerSGD_iter", -1, r"PowerSGD.start_powerSGD_iter must be an integer from 0 to"),
    ("random_seed", 2**32, r"PowerSGD.random_seed must be an integer from 0 to 4294967295"),
    ("min_compression_rate", 0, r"PowerSGD.min_compression_rate must be a finite number above 0, got 0"),
    ("min_compression_rate", math.inf, r"PowerSGD.min_compression_rate must be a finite number above 0"),
    ("orthogonalization_epsilon", -1e-8,
     r"PowerSGD.orthogonalization_epsilon must be a finite number of at least 0"),
    ("orthogonalization_epsilon", math.nan, r"PowerSGD.orthogonalization_epsilon must be a finite number"),
    ("warm_start", 1, r"PowerSGD.warm_start must be True or False, got 1 \(int\)"),
    ("use_error_feedback", None, r"PowerSGD.use_error_feedback must be True or False"),
])
def test_bad_powersgd_settings_name_the_field_and_range(field, value, match):
    with pytest.raises(ValueError, match=match):
        PowerSGD(**{field: value})


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(compression="powersgd"),
     r"Strategy.compression must be None or commsched.PowerSGD\(...\), got 'powersgd'"),
    (dict(backend=ParameterServer()),
     r"does not go with backend=ParameterServer.*use backend=AllReduce\(\) to compress"),
    (dict(backend=AllReduce(shard_optimizer=True)), r"does not go with backend=AllReduce\(shard_optimizer=True\)"),
    (dict(reduce_dtype=torch.bfloat16), r"does not go with reduce_dtype=torch.bfloat16: .*leave reduce_dtype at None"),
    (dict(check_finite="raise"), r"does not go with check_finite='raise': .*leave check_finite at None"),
])
def test_compression_refuses_what_it_cannot_do_naming_the_fix(kwargs, match):
    kwargs.setdefault("compression", PowerSGD())
    with pytest.raises(ValueError, match=match):
        Strategy(**kwargs)


def test_compression_of_gradients_off_the_host_is_refused_before_any_collective():
    """No process group exists here: the refusal comes before prepare() talks to any rank."""
    import commsched

    model = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match=r"compresses gradients in host memory only for now, and this model's are "
                                         r"on meta"):
        commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), Strategy(compression=PowerSGD()))

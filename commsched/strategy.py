"""`Strategy`: every knob of commsched in one validated object, and its backend configs."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields

import torch

from commsched.validation import (
    Range,
    check_bool,
    check_choice,
    check_directory,
    check_dtype,
    check_in_range,
    check_int,
    check_servers,
    check_staleness,
)

MIB = 1024 * 1024

MIN_BUCKET_MB = 1 / MIB
"""Smallest bucket limit, one byte: limits are whole bytes, and a tensor larger
than the limit gets a bucket of its own (one bucket per tensor)."""

MIN_PARTITION_MB = 256 / MIB
"""Smallest partition and credit window, 256 bytes: each partition costs a
collective and a scheduling decision, so smaller ones only add overhead."""

MAX_SIZE_MB = 1024 * 1024
"""Largest size in MiB (1 TiB): more than any bucket, partition or window can hold."""

MIN_TIMEOUT_S = 1.0
"""Shortest timeout: the collectives at prepare() and in the first iterations
take a good fraction of a second on a busy host, and a timeout below a
millisecond would round to none at all."""

MAX_AUTOTUNE_ITERATIONS = 100_000
"""Longest search: beyond it the run would be mostly measuring."""

REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What `Strategy.reduce_dtype` may name besides None: summing 16-bit gradients in float32, or
sending float32 ones as bfloat16 (which has float32's range, so scaled gradients do not overflow)
or as float16 (torch DDP's ``fp16_compress_hook``: more precision, a range that can overflow)."""

CHECK_FINITE_MODES = ("skip", "raise")
"""What `Strategy.check_finite` may be besides None."""

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest timeout, a week: far beyond any real wait, and representable by
every wait commsched makes (``datetime.timedelta``, ``threading``'s
``TIMEOUT_MAX`` and torch's nanosecond durations)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AllReduce:
    """Every rank trains; gradients are averaged over the process group with all-reduce."""

    shard_optimizer: bool = False
    """Keep the optimizer's state sharded (ZeRO-1): each rank holds the state of, and
    updates, 1/N of every bucket, and the updated parts are all-gathered into every
    rank's parameters (at the next forward pass's gates, with forward overlap). Adam's
    state per rank drops from twice the parameters to twice 1/N of them; the wire
    carries an all-gather of the parameters besides the all-reduce. Gradients are
    averaged whole, so every loop stays exact. SGD, Adam and AdamW only; see
    docs/guide.md, "Sharded optimizer state"."""

    reduce_scatter: bool = False
    """With ``shard_optimizer``: reduce-scatter the gradients instead of all-reducing
    them (ZeRO-2), so each rank receives only the averaged chunk it updates and the
    wire carries the bytes of an all-reduce, not one and a half times them (with NCCL;
    gloo's reduce-scatter is no faster than its all-reduce). ``param.grad`` then holds
    the average only on this rank's chunk; elsewhere it reads NaN. Loops that change the
    gradients before ``step()`` (clipping) or use a ``GradScaler`` need them whole: when
    warm-up sees one, gradients stay all-reduced; see docs/guide.md, "Sharded optimizer state"."""

    all_to_all_mb: float | str | None = "auto"
    """On gloo among 3 or more ranks, all-reduce in two all-to-alls rather than by gloo's ring,
    whose 2(N-1) steps in a row make small collectives slow among many hosts (see [Note: an
    all-reduce in two steps] in `commsched.comm.two_step`). ``"auto"``: the bucket the next
    forward pass needs first, the one it waits for at the end of backward, goes in two steps if,
    timed both ways at the end of warm-up behind an all-reduce of the largest other bucket (as
    in training), they took at most 0.9 of the ring's time (needs
    ``priority=True``, which warm-up profiles for; else the ring throughout). A number: every
    partition of at most this many MiB, from the start (the ring carries bulk better where
    many partitions are in flight: measure before setting it). None or 0: the ring throughout.
    Other backends keep their own all-reduce."""

    schedule_one_rank: bool = False
    """At world size 1, run the whole schedule anyway: every bucket goes through a real all-reduce
    of the one rank, in the agreed order, within the credit window, with per-bucket updates and
    forward overlap as among several ranks (see [Note: stream-ordered waits] in
    commsched/device.py). For tests, and to check a setup on one GPU before scaling out; it costs
    the collectives' launches. False: one rank sends nothing and updates each bucket at
    ``step()``. No effect at two ranks or more."""

    def __repr__(self) -> str:
        """Only what differs from the default, as it would be written."""
        fields = []
        if self.shard_optimizer:
            fields.append("shard_optimizer=True")
        if self.reduce_scatter:
            fields.append("reduce_scatter=True")
        if self.all_to_all_mb != "auto":
            fields.append(f"all_to_all_mb={self.all_to_all_mb!r}")
        if self.schedule_one_rank:
            fields.append("schedule_one_rank=True")
        return f"AllReduce({', '.join(fields)})"

    def __post_init__(self) -> None:
        for name in ("shard_optimizer", "reduce_scatter", "schedule_one_rank"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"AllReduce.{name} must be True or False, got {value!r} ({type(value).__name__})")
        size = self.all_to_all_mb
        if not (size is None or size == "auto" or (isinstance(size, int | float) and not isinstance(size, bool)
                                                   and 0 <= size <= MAX_SIZE_MB)):
            raise ValueError(
                f"AllReduce.all_to_all_mb must be \"auto\", None, or a size in MiB from 0 to {MAX_SIZE_MB}, got "
                f"{size!r} ({type(size).__name__})"
            )
        if self.reduce_scatter and not self.shard_optimizer:
            raise ValueError(
                "AllReduce(reduce_scatter=True) hands each rank only the chunk of the gradients whose optimizer "
                "state it keeps, so it needs that state sharded: use AllReduce(shard_optimizer=True, "
                "reduce_scatter=True), or AllReduce() to keep all-reducing"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterServer:
    """The last ``num_servers`` ranks of the world serve; the others train.

    Workers push gradient blocks to the servers, which run the optimizer and
    send the new values back (see docs/parameter_server.md).
    """

    num_servers: int = 1
    """How many ranks serve (the last ones of the world)."""

    mode: str = "sync"
    """``"sync"`` waits for every worker's gradient of a block, averages and updates
    once (the same parameters as single-process training); ``"async"`` applies
    each worker's gradient (divided by the number of workers) as it arrives, and
    workers pull whatever is newest."""

    max_staleness: int | None = None
    """With ``mode="async"``: how many iterations a worker may run ahead of the
    slowest worker still training. A worker further ahead gets its new values
    only when the others catch up, so its next forward pass waits (stale
    synchronous parallel). None: unbounded, the staleness is only reported."""

    block_mb: float | None = 0.5
    """Largest block, in MiB: the unit a worker pushes and pulls and a server
    updates. Partitions (`Strategy.partition_mb`) larger than this are cut to it,
    and buckets are capped at it. A block's round trip (every worker's push, the
    update, the pulls) is serial, so smaller blocks let one block's pull overlap
    the next one's push, and the next forward pass waits less for the first block
    and for the last; each block costs a message and an update on the server,
    though, which competes for CPU where computation sets the pace (see
    docs/parameter_server.md for the measurements behind the default). ``None``:
    blocks as large as the partitions. From 256 bytes to 1 TiB."""

    def __post_init__(self) -> None:
        check_servers("ParameterServer.num_servers", self.num_servers)
        check_in_range("block_mb", self.block_mb, _PARTITION_MB, optional=True, owner="ParameterServer")
        check_choice("ParameterServer.mode", self.mode, ("sync", "async"))
        check_staleness("ParameterServer.max_staleness", self.max_staleness)
        if self.max_staleness is not None and self.mode != "async":
            raise ValueError(
                f"ParameterServer.max_staleness applies to mode='async' only, got mode={self.mode!r}; "
                "set mode='async' or leave max_staleness at None"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class PowerSGD:
    """Low-rank gradient compression with error feedback (Vogels et al.), for links that set the pace.

    The settings, their names and defaults are torch DDP's ``PowerSGDState``'s, so that a
    ``powerSGD_hook`` configuration carries over: ``Strategy(compression=PowerSGD(
    matrix_approximation_rank=2, start_powerSGD_iter=10))``. Each bucket's gradients of two or
    more dimensions that are worth it go as two thin matrices ``P`` and ``Q``, each all-reduced,
    and every other element of the bucket uncompressed with the ``P``; the unit on the wire is
    the bucket, in the priority order, under the credit window. See [Note: PowerSGD under the
    schedule] in `commsched.comm.powersgd` and docs/guide.md, "Compression"."""

    matrix_approximation_rank: int = 1
    """The rank of the approximation: each ``n x m`` gradient goes as ``(n + m) * rank`` numbers.
    Higher is closer to the gradient and costs more bytes; 1 to 4 is the usual range. From 1."""

    start_powerSGD_iter: int = 1_000
    """Synchronised iterations all-reduced uncompressed before compression starts (as the hook,
    with the same default): early training is the most sensitive to the approximation. From 0."""

    min_compression_rate: float = 2.0
    """A gradient goes compressed only if that makes it at least this many times smaller; 1-D
    gradients (biases, norms) never are. Above 0."""

    use_error_feedback: bool = True
    """Add what the approximation left out to the next iteration's gradient (each rank its own),
    so that over iterations nothing is lost."""

    warm_start: bool = True
    """Start each iteration's power step from the last iteration's ``Q`` rather than a random one."""

    orthogonalization_epsilon: float = 0.0
    """Added to each column's norm when it is normalised, as the hook's; 0: none (a column of
    zeros then stays zeros, where the hook gives NaN). From 0."""

    random_seed: int = 0
    """Seed of the random first ``Q``, drawn bucket by bucket as the hook draws them. 0 to 2**32 - 1."""

    batch_tensors_with_same_shape: bool = False
    """The hook's option to batch same-shaped gradients: here it only orders the random draws as
    the hook's do (commsched multiplies each gradient in place, without copies)."""

    def __post_init__(self) -> None:
        for name, low, high in (("matrix_approximation_rank", 1, 2**31 - 1), ("start_powerSGD_iter", 0, 2**62),
                                ("random_seed", 0, 2**32 - 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"PowerSGD.{name} must be an integer from {low} to {high}, got {value!r}")
        for name, above_zero in (("min_compression_rate", True), ("orthogonalization_epsilon", False)):
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
            if not number or value < 0 or (above_zero and value == 0):
                bound = "above 0" if above_zero else "of at least 0"
                raise ValueError(f"PowerSGD.{name} must be a finite number {bound}, got {value!r}")
        for name in ("use_error_feedback", "warm_start", "batch_tensors_with_same_shape"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"PowerSGD.{name} must be True or False, got {value!r} ({type(value).__name__})")

    def __repr__(self) -> str:
        """Only what differs from the default, as it would be written."""
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if getattr(self, f.name) != f.default]
        return f"PowerSGD({', '.join(changed)})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """How commsched buckets and communicates gradients.

    Built once and validated at construction: a bad value raises ``ValueError``
    naming the field, the value received and the allowed range.
    """

    bucket_cap_mb: float = 25.0
    """Size limit of a gradient bucket, in MiB (as torch DDP's ``bucket_cap_mb``).
    Larger buckets mean fewer, larger all-reduces; smaller ones start
    communication earlier in the backward pass. From one byte (`MIN_BUCKET_MB`)
    to 1 TiB."""

    first_bucket_mb: float = 1.0
    """Size limit of the first bucket, in MiB: the gradients produced first in the
    backward pass go out in a small bucket so communication starts early. From
    one byte to 1 TiB."""

    broadcast_buffers: bool = True
    """Broadcast the module's buffers (e.g. BatchNorm running statistics) from
    rank 0 at the start of every forward pass that records gradients, as torch
    DDP does. Turn off when buffers are kept in sync by other means."""

    priority: bool = True
    """Send what the next forward pass needs first: partitions are issued by the
    position of their parameters in the forward execution order recorded in the
    first iteration (nearest the input most urgent), instead of in the order
    gradients become ready."""

    partition_mb: float | None = 1.0
    """The unit on the wire, in MiB: buckets are cut into zero-copy slices of about
    this size (at most 1.5 times it) so an urgent partition can overtake a large
    bucket between two of its slices. ``None`` sends each bucket whole. From 256
    bytes (`MIN_PARTITION_MB`) to 1 TiB."""

    credit_mb: float | None = 4.0
    """Most bytes in flight during the backward pass, in MiB: a partition is
    issued only if it fits (one larger than the window goes alone), which keeps
    the queue short enough for urgent partitions to overtake. ``None`` issues
    everything as soon as the agreed order allows. From 256 bytes to 1 TiB."""

    adaptive: bool = True
    """Let the warm-up's measurements decide the partitioning: at the end of
    warm-up, rank 0 predicts the cost of the configured ``partition_mb`` and
    ``credit_mb``, of partitions four times as large, and of whole buckets on
    its own timeline and the measured link, and every rank uses the cheapest
    (`commsched.status` says which and why). Where communication hides behind
    compute anyway, fewer and larger collectives cost less; for many hosts,
    whole buckets without the small first one, or four times as large, are
    candidates too. Unless it chose the configured buckets sent whole, its
    choice, its runner-up and its cheapest whole buckets of another size are
    then measured against them on the next 16-32 iterations, in turn, and the
    fastest kept only if measurably faster (see [Note:
    confirming the choice] in `commsched.tuning.confirmation`). ``False`` keeps
    exactly the configured values. Applies to the all-reduce backend with
    ``priority=True``; the parameter-server backend keeps its blocks."""

    overlap_forward: bool = True
    """Let the next forward pass start before all reductions are done:
    ``optimizer.step()`` returns at once, each bucket is updated when its
    reduction completes, and each module waits only for its own parameters.
    Switched off automatically when gradients are modified between
    ``backward()`` and ``step()`` (``clip_grad_norm_``, AMP unscaling), or when
    the optimizer has no per-bucket update (only SGD, Adam and AdamW do)."""

    fuse_optimizer: bool = True
    """Update SGD, Adam and AdamW parameters bucket by bucket with torch's fused
    kernels (``fused=True``) instead of the optimizer's own per-tensor loop."""

    reduce_dtype: torch.dtype | None = None
    """The dtype gradients are summed in across ranks (the name and meaning of torch FSDP2's
    ``MixedPrecisionPolicy.reduce_dtype``). None: each gradient in its parameter's dtype.

    ``torch.float32``: bfloat16 and float16 gradients are summed in float32, as Megatron-LM's
    ``grad_reduce_in_fp32``: each bucket is copied into a float32 buffer of its own (4 bytes
    per element more), divided by the world size there and all-reduced, and the sum is
    rounded once into ``param.grad``, which keeps the parameter's dtype (torch.optim's Adam
    refuses float32 gradients on a bfloat16 parameter), so the update is torch.optim's on
    that gradient. Micro-batches under ``no_sync()`` accumulate in ``param.grad``, as
    autograd accumulates them in one process.

    ``torch.bfloat16``: float32 gradients go on the wire as bfloat16, half the bytes (torch
    DDP's ``bf16_compress_hook``). Each rank divides its gradient by the world size in
    float32 and rounds it once to bfloat16 (the hook rounds first and divides in bfloat16);
    the sum on the wire is bfloat16, as the hook's (gloo and NCCL add in the dtype they
    are given); the result is written back into the float32 bucket, so ``param.grad``,
    accumulation under ``no_sync()`` and the update stay float32. Each rounding is within
    2**-9 of the value rounded (docs/records/2026-11-25-reduce-dtype.md measures what that does to training).

    ``torch.float16``: the same as bfloat16 with float16 on the wire, torch DDP's
    ``fp16_compress_hook``: three more bits of precision, but a gradient share above 65504 becomes
    inf (bfloat16 is the safer choice unless a measurement says otherwise).

    Other dtypes are never changed (float64 gradients stay float64). All-reduce backend
    only. ``commsched.status(model)`` shows each bucket's dtype on the wire."""

    check_finite: str | None = None
    """Check each bucket's gradients for inf and NaN on every rank before they go on the
    wire, where one rank's would spread to all (torch DDP sends them on). None: no check.
    ``"skip"``: a step where some rank found one changes nothing, on every rank (parameters
    and optimizer state, as a ``GradScaler`` skips a step), and a warning names the ranks
    and the parameters. ``"raise"``: the same step is skipped, then `NonFiniteGradients`
    is raised at the next synchronisation (the next backward pass, ``optimizer.synchronize()``,
    or ``step()`` without forward overlap). The check runs on the device, without waiting
    for it; the verdict travels in the last bucket's collective, so every update waits for
    that bucket's reduction. Under a ``GradScaler`` its own check rules. All-reduce backend only.
    See [Note: non-finite gradients] in commsched/engine/finite.py."""

    compression: PowerSGD | None = None
    """Compress gradients on the wire: ``PowerSGD(...)`` (torch DDP's ``powerSGD_hook``, under the
    schedule). None: every gradient goes whole, in its dtype or ``reduce_dtype``. All-reduce
    backend, optimizer state unsharded, without ``reduce_dtype`` and ``check_finite``; see
    `PowerSGD`."""

    trace_dir: str | None = None
    """Write a timeline per rank (``rank<N>.json``, Chrome trace format) into this
    directory: forward and backward per module, per partition its queue and wire
    time, per bucket its update, and every wait on communication. Read it with
    ``commsched trace-report DIR`` or Perfetto. Off (None) it costs nothing.
    A non-empty path (``str`` or ``os.PathLike``), created by ``prepare()`` if
    missing. The only field that may differ across ranks (e.g. a local disk per
    host); every other one must be equal on every rank, which ``prepare()``
    checks."""

    timeout_s: float = 300.0
    """Longest wait, in seconds, for one gradient reduction (or for one of the few
    collectives that agree on the order and the plan). A peer that died or
    stopped participating gives a ``CommunicationTimeout`` naming what was
    waited for instead of a hang. From 1 s to a week (`MIN_TIMEOUT_S`,
    `MAX_TIMEOUT_S`)."""

    backend: AllReduce | ParameterServer | str = AllReduce()
    """What carries the gradients: ``AllReduce()`` (every rank trains, gradients
    are averaged with all-reduce) or ``ParameterServer(num_servers=..., mode=...,
    max_staleness=...)`` (the last ``num_servers`` ranks of the world serve;
    workers push gradient blocks to them, the servers apply the optimizer and
    workers pull the new values; see docs/parameter_server.md). The strings
    ``"allreduce"`` and ``"ps"`` are the deprecated spelling."""

    num_servers: int | None = None
    """Deprecated input, with ``backend="ps"``: ``ParameterServer(num_servers=...)``.
    Always None once built; read ``backend.num_servers``."""

    ps_mode: str | None = None
    """Deprecated input, with ``backend="ps"``: ``ParameterServer(mode=...)``. Always None once built."""

    ps_max_staleness: int | None = None
    """Deprecated input, with ``backend="ps"``: ``ParameterServer(max_staleness=...)``. Always None once built."""

    autotune: bool = False
    """Tune the layout on measured iteration times: after warm-up, rank 0 tries
    settings of ``partition_mb``, ``credit_mb``, ``bucket_cap_mb``,
    ``first_bucket_mb`` and forward overlap (where it is on) for a few
    iterations each, starting from the cost model's choice, with a Bayesian
    optimiser (optuna, ``pip install commsched[tune]``), and every rank adopts
    the fastest; a later change of iteration time of more than 20% starts a new
    search (see [Note: auto-tuning] in commsched/tuning/__init__.py). The values given
    here are the starting point when ``adaptive=False``. Needs the all-reduce
    backend and ``priority=True``."""

    autotune_iterations: int = 50
    """Iterations one search may take (the first, after warm-up; a re-tune takes at
    most 100), each setting ``autotune_trial_iterations`` of them plus one to settle.
    From 4 to 100000."""

    autotune_trial_iterations: int = 3
    """Iterations measured per setting tried (their median counts). From 1 to 100."""

    autotune_seed: int = 0
    """Seed of the optimiser on rank 0: the same measurements give the same settings. 0 to 2**32 - 1."""

    def __post_init__(self) -> None:
        check_in_range("bucket_cap_mb", self.bucket_cap_mb, _BUCKET_MB)
        check_in_range("first_bucket_mb", self.first_bucket_mb, _BUCKET_MB)
        check_in_range("timeout_s", self.timeout_s, _TIMEOUT_S)
        check_in_range("partition_mb", self.partition_mb, _PARTITION_MB, optional=True)
        check_in_range("credit_mb", self.credit_mb, _PARTITION_MB, optional=True)
        check_directory("trace_dir", self.trace_dir)
        check_dtype("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        for name in ("broadcast_buffers", "priority", "adaptive", "overlap_forward", "fuse_optimizer", "autotune"):
            check_bool(name, getattr(self, name))
        check_int("autotune_iterations", self.autotune_iterations, 4, MAX_AUTOTUNE_ITERATIONS)
        check_int("autotune_trial_iterations", self.autotune_trial_iterations, 1, 100)
        check_int("autotune_seed", self.autotune_seed, 0, 2**32 - 1)
        self._normalize_backend()
        if self.check_finite is not None:
            check_choice("Strategy.check_finite", self.check_finite, CHECK_FINITE_MODES)
            if self.parameter_server:
                raise ValueError(
                    f"Strategy.check_finite={self.check_finite!r} applies to the all-reduce backend; with "
                    "ParameterServer(...) leave it at None (the servers sum what the workers push)"
                )
        if self.reduce_dtype is not None and self.parameter_server:
            raise ValueError(
                f"Strategy.reduce_dtype={self.reduce_dtype} applies to the all-reduce backend; parameter "
                "servers sum each gradient in its parameter's dtype: leave reduce_dtype at None with "
                "ParameterServer(...), or use backend=AllReduce()"
            )
        if self.compression is not None:
            self._check_compression()
        if self.autotune:
            self._check_autotune()

    def _check_compression(self) -> None:
        if not isinstance(self.compression, PowerSGD):
            raise ValueError(f"Strategy.compression must be None or commsched.PowerSGD(...), got "
                             f"{self.compression!r} ({type(self.compression).__name__})")
        refusals = (
            (self.parameter_server, f"backend={self.backend!r}",
             "the parameter servers sum and update what workers push, uncompressed; use backend=AllReduce() to "
             "compress, or compression=None with ParameterServer(...)"),
            (self.shards_optimizer, f"backend={self.backend!r}",
             "sharded optimizer state updates each rank's chunk of the exact average, which a low-rank "
             "approximation does not give; use AllReduce(shard_optimizer=False) to compress, or compression=None "
             "to shard"),
            (self.reduce_dtype is not None, f"reduce_dtype={self.reduce_dtype}",
             "reduce_dtype changes the dtype on the wire, which compression already sets; leave reduce_dtype at "
             "None to compress, or compression=None to send gradients in reduce_dtype"),
            (self.check_finite is not None, f"check_finite={self.check_finite!r}",
             "check_finite skips a step where a gradient is not finite, but the compression's error feedback "
             "would keep it for the next ones; leave check_finite at None to compress (a GradScaler is refused "
             "likewise), or compression=None"),
        )
        for refused, setting, why in refusals:
            if refused:
                raise ValueError(f"Strategy(compression={self.compression!r}) does not go with {setting}: {why}")

    def _check_autotune(self) -> None:
        if self.parameter_server:
            raise ValueError(
                "Strategy(autotune=True) tunes the all-reduce backend's partitions, credit window and buckets; "
                "the parameter-server backend keeps its blocks as configured (each server owns its blocks); use "
                "backend=AllReduce() to tune, or autotune=False with ParameterServer(...)"
            )
        if not self.priority:
            raise ValueError(
                "Strategy(autotune=True) needs priority=True: the tuner plans each setting it tries from the "
                "warm-up's timeline, which is recorded only with priority; set priority=True or autotune=False"
            )
        per_trial = 1 + self.autotune_trial_iterations
        if self.autotune_iterations < 2 * per_trial:
            raise ValueError(
                f"Strategy.autotune_iterations={self.autotune_iterations} leaves room for fewer than two settings "
                f"of {per_trial} iterations each (autotune_trial_iterations={self.autotune_trial_iterations} "
                f"plus one to settle); give at least {2 * per_trial} iterations"
            )
        require_optuna()

    def _normalize_backend(self) -> None:
        """Turn the deprecated flat spelling into a backend config.

        ``Strategy(backend="ps", num_servers=2, ps_mode="async")`` means
        ``Strategy(backend=ParameterServer(num_servers=2, mode="async"))``. The flat
        fields are input only: afterwards they are None and ``backend`` holds the
        config, so `dataclasses.replace` works in every direction.
        """
        flat = {"num_servers": self.num_servers, "ps_mode": self.ps_mode, "ps_max_staleness": self.ps_max_staleness}
        given = any(value is not None for value in flat.values())
        if isinstance(self.backend, str) or (given and isinstance(self.backend, AllReduce)):
            name = self.backend if isinstance(self.backend, str) else "allreduce"
            backend = _backend_from_flat_fields(name, **flat)
            warnings.warn(
                "Strategy(backend='ps', num_servers=..., ps_mode=..., ps_max_staleness=...) is deprecated; "
                "write Strategy(backend=commsched.ParameterServer(num_servers=..., mode=..., max_staleness=...)), "
                "or leave backend at its default, commsched.AllReduce()",
                DeprecationWarning, stacklevel=4,
            )
        elif isinstance(self.backend, ParameterServer):
            if given:
                raise ValueError(
                    f"Strategy got backend={self.backend!r} and the deprecated fields "
                    + ", ".join(f"{name}={value!r}" for name, value in flat.items() if value is not None)
                    + "; give them inside ParameterServer(...) only"
                )
            backend = self.backend
        elif isinstance(self.backend, AllReduce):
            backend = self.backend
        else:
            raise ValueError(
                f"Strategy.backend must be commsched.AllReduce() or commsched.ParameterServer(...), got "
                f"{self.backend!r} ({type(self.backend).__name__})"
            )
        object.__setattr__(self, "backend", backend)
        for name in flat:
            object.__setattr__(self, name, None)

    @property
    def shards_optimizer(self) -> bool:
        """True with ``backend=AllReduce(shard_optimizer=True)``."""
        return isinstance(self.backend, AllReduce) and self.backend.shard_optimizer

    @property
    def reduce_scatters(self) -> bool:
        """True with ``backend=AllReduce(shard_optimizer=True, reduce_scatter=True)``."""
        return isinstance(self.backend, AllReduce) and self.backend.reduce_scatter

    @property
    def parameter_server(self) -> bool:
        """True with ``backend=ParameterServer(...)``."""
        return isinstance(self.backend, ParameterServer)

    @property
    def cost_model_picks_partitioning(self) -> bool:
        """Whether a run lets its cost model pick the partitioning at the end of warm-up
        (see ``adaptive``: the all-reduce backend with priority only)."""
        return self.adaptive and self.priority and not self.parameter_server

    @property
    def measures_its_choice(self) -> bool:
        """Whether a run measures the cost model's choice against the configured buckets sent whole
        after warm-up (see ``adaptive``): not with the auto-tuner, which measures anyway. With sharded
        optimizer state too: each change of buckets reshards the state one bucket at a time (see
        [Note: resharding one bucket at a time] in `commsched.update.resharding`), and the cost model,
        which knows nothing of the all-gathers, needs the check more there."""
        return self.cost_model_picks_partitioning and not self.autotune

    @property
    def bucket_size_limits_bytes(self) -> list[int]:
        """Bucket size limits in the form `compute_bucket_assignment_by_size` takes.

        With partitions, a bucket is also the unit of update and of gating, so it
        is capped at the partition size: small tensors still travel together,
        large ones get a bucket of their own and are cut, and an urgent layer is
        never held back by a large, late one sharing its bucket. The same holds for
        a parameter server's blocks (`ParameterServer.block_mb`).
        """
        return bucket_size_limits_bytes(self.bucket_cap_mb, self.first_bucket_mb, self.partition_mb, self._block_mb)

    @property
    def partition_bytes(self) -> int | None:
        return size_bytes(self.partition_mb)

    @property
    def ps_block_bytes(self) -> int:
        """Target size of a parameter-server block: a partition (a whole bucket without
        partitions), cut to ``ParameterServer.block_mb``."""
        unit = self.partition_bytes or int(self.bucket_cap_mb * MIB)
        return unit if self._block_mb is None else min(unit, max(1, int(self._block_mb * MIB)))

    @property
    def _block_mb(self) -> float | None:
        """The parameter-server backend's largest block (None with all-reduce or no limit)."""
        return self.backend.block_mb if isinstance(self.backend, ParameterServer) else None

    @property
    def credit_bytes(self) -> int | None:
        return size_bytes(self.credit_mb)

    def describe(self) -> str:
        """One line with every field, for logs (the deprecated inputs left out)."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name not in _FLAT_FIELDS)


_FLAT_FIELDS = ("num_servers", "ps_mode", "ps_max_staleness")


def size_bytes(mb: float | None) -> int | None:
    """A size in MiB as whole bytes, at least one (None stays None: no limit)."""
    return None if mb is None else max(1, int(mb * MIB))


def bucket_size_limits_bytes(
    bucket_cap_mb: float, first_bucket_mb: float, partition_mb: float | None, block_mb: float | None = None
) -> list[int]:
    """The first bucket's and every other bucket's size limit, in bytes: the caps, each
    cut to the unit on the wire (the partition, a parameter server's block) where set.
    See `Strategy.bucket_size_limits_bytes`."""
    unit_mb = [mb for mb in (partition_mb, block_mb) if mb is not None]
    cap_mb = min([bucket_cap_mb, *unit_mb])
    first_mb = min(first_bucket_mb, cap_mb)
    return [int(first_mb * MIB), int(cap_mb * MIB)]


def _backend_from_flat_fields(
    backend: str, num_servers: int | None, ps_mode: str | None, ps_max_staleness: int | None
) -> AllReduce | ParameterServer:
    """The deprecated ``backend="allreduce"|"ps"`` spelling, validated under the names the caller used."""
    check_choice("Strategy.backend", backend, ("allreduce", "ps"))
    if ps_mode is not None:
        check_choice("Strategy.ps_mode", ps_mode, ("sync", "async"))
    if num_servers is not None:
        check_servers("Strategy.num_servers", num_servers)
    if backend != "ps" and (num_servers not in (None, 1) or ps_mode not in (None, "sync")):
        raise ValueError(
            f"Strategy.num_servers and Strategy.ps_mode apply to backend='ps' only, got "
            f"backend={backend!r} with num_servers={num_servers!r}, ps_mode={ps_mode!r}; set "
            "backend='ps' or leave them at their defaults"
        )
    if ps_max_staleness is not None:
        check_staleness("Strategy.ps_max_staleness", ps_max_staleness)
        if backend != "ps" or ps_mode != "async":
            raise ValueError(
                f"Strategy.ps_max_staleness applies to backend='ps' with ps_mode='async' only, got "
                f"backend={backend!r}, ps_mode={ps_mode!r}; set both or leave ps_max_staleness at None"
            )
    if backend == "allreduce":
        return AllReduce()
    return ParameterServer(num_servers=1 if num_servers is None else num_servers,
                           mode=ps_mode or "sync", max_staleness=ps_max_staleness)


_BUCKET_MB = Range(MIN_BUCKET_MB, MAX_SIZE_MB, f"{MIN_BUCKET_MB!r} to {MAX_SIZE_MB} MiB (1 byte to 1 TiB)")
_PARTITION_MB = Range(MIN_PARTITION_MB, MAX_SIZE_MB, f"{MIN_PARTITION_MB!r} to {MAX_SIZE_MB} MiB (256 bytes to 1 TiB)")
_TIMEOUT_S = Range(MIN_TIMEOUT_S, MAX_TIMEOUT_S, f"{MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} seconds (1 s to 7 days)")


def require_optuna():  # noqa: ANN201 - the module, imported only when tuning
    """optuna, or an ImportError that says how to install it."""
    try:
        import optuna
    except ImportError as error:
        raise ImportError(
            "Strategy(autotune=True) needs optuna, which commsched's 'tune' extra installs: "
            "pip install commsched[tune]"
        ) from error
    return optuna



"""Rank 0 chooses the partitioning and plans the issue order from warm-up's timeline; every rank gets both.

See [Note: the agreed order] in `commsched.layout.partitions` and [Note: the cost
model] in `commsched.planning.cost_model`. The collectives here run at agreed
points, on every rank, so that they line up: the choice and the plan at the
start of the first backward pass after warm-up (and at each of the
auto-tuner's switch points).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commsched.errors import wait_or_raise
from commsched.layout.grad_layout import GradLayout
from commsched.layout.partitions import Partition, Plan
from commsched.layout.setting import LayoutSetting
from commsched.planning.calibration import Calibration
from commsched.planning.cost_model import Choice, Setting, Timeline, choose
from commsched.planning.schedule import LinkModel, arrival_order, robust_plan, simulate_schedule

BOUNDING_SHARE = 0.5
"""The least share of an iteration's bytes the link's last busy period must carry for the
iteration to tell its bandwidth; see `wire_bytes_per_s`."""


def wire_bytes_per_s(issued: Sequence[tuple[float, int]], done_s: float, latency_s: float,
                     idle_bytes_per_s: float | None = None) -> float | None:
    """The bandwidth ``b`` with which reductions issued at ``issued`` (time, bytes),
    each taking ``latency_s + bytes / b`` one after the other, all finish at ``done_s``.

    The finish time falls as ``b`` grows, so ``b`` is found by bisection on
    ``1 / b``. None where even an infinite bandwidth would not finish before
    ``done_s`` (the observation says nothing about the bandwidth), or where, at
    the idle link's speed (``idle_bytes_per_s``, where measured; else at ``b``),
    the link's last busy period carries less than `BOUNDING_SHARE` of the bytes.

    Only the last busy period binds ``b``. Where computation sets the pace, that
    period is the input-side bucket alone, issued on an idle link as backward
    ends: a few hundred KB whose time is mostly fixed costs the model does not
    see (a thread waking, a callback, the link's round trips). A few ms there
    read as a link several times slower: on 2 emulated hosts at 1 Gbit/s (idle
    link: 119 MB/s) iterations read 55-60 MB/s or 150-300, and a plan made for
    the slow reading held the forward pass's second bucket behind the last one
    while the link idled 60 ms.
    """
    if not issued:
        return None
    in_order = sorted(issued)

    def finish_s(seconds_per_byte: float) -> float:
        free_at = 0.0
        for at, nbytes in in_order:
            free_at = max(free_at, at) + latency_s + nbytes * seconds_per_byte
        return free_at

    if finish_s(0.0) >= done_s:
        return None
    low, high = 0.0, done_s / max(1, sum(nbytes for _, nbytes in in_order))  # finish_s(high) >= done_s
    for _ in range(60):
        middle = (low + high) / 2
        if finish_s(middle) < done_s:
            low = middle
        else:
            high = middle
    judged_at = high if idle_bytes_per_s is None else 1.0 / idle_bytes_per_s
    if _last_busy_bytes(in_order, latency_s, judged_at) < BOUNDING_SHARE * sum(nbytes for _, nbytes in in_order):
        return None
    return 1.0 / high


def _last_busy_bytes(in_order: Sequence[tuple[float, int]], latency_s: float, seconds_per_byte: float) -> int:
    """The bytes of the reductions from the last one issued on an idle link to the end."""
    free_at, busy = 0.0, 0
    for at, nbytes in in_order:
        if at >= free_at:
            busy = 0
        busy += nbytes
        free_at = max(free_at, at) + latency_s + nbytes * seconds_per_byte
    return busy


def bucket_ready_s(slot_ready_s: Sequence[float], layout: GradLayout, held: frozenset[int]) -> list[float]:
    """When each bucket of ``layout`` is ready: its last gradient, or the end of the
    backward pass for the flags bucket and ``held`` ones (issued only then)."""
    end = max(slot_ready_s, default=0.0)
    return [
        end if b == layout.flags_bucket or b in held else max((slot_ready_s[s] for s in slots), default=0.0)
        for b, slots in enumerate(layout.bucket_slots)
    ]


def choose_on_rank0(
    layout: GradLayout,
    warmup: WarmupTimeline,
    calibration: Calibration,
    setting: LayoutSetting,
    priority: bool,
    control_group: dist.ProcessGroup,
    timeout_s: float,
) -> tuple[Choice, Timeline | None]:
    """Rank 0 runs the cost model; every rank gets its setting. See [Note: the cost model].

    Collective: the choice goes out on ``control_group``. ``calibration`` must
    hold the link (`calibrate` with ``with_link``). Returns rank 0's `Choice`
    (on other ranks, its setting only), and on rank 0 the timeline the cost
    model saw (None elsewhere).
    """
    if calibration.link is None:
        raise ValueError("the cost model needs the link: calibrate(..., with_link=True)")
    choice = timeline = None
    message = torch.zeros(_SETTING_FLOATS + 2 * _OPTIONAL_FLOATS, dtype=torch.float64)
    if dist.get_rank(control_group) == 0:
        timeline = Timeline(warmup.slot_ready_s, warmup.forward_s, calibration.link, calibration.transport_cpu_share)
        choice = choose(setting, priority, layout.params, layout.forward_order, timeline)
        message = torch.tensor([*_encode(choice.setting), *_encode_optional(choice.runner_up),
                                *_encode_optional(choice.best_whole)], dtype=torch.float64)
    if dist.get_world_size(control_group) > 1:
        work = dist.broadcast(message, group=control_group, group_src=0, async_op=True)
        wait_or_raise(work, timeout_s, "the broadcast of rank 0's choice of partitions")
    if choice is None:
        n, m = _SETTING_FLOATS, _OPTIONAL_FLOATS
        choice = Choice(_decode(message[:n]), (), _decode_optional(message[n:n + m]), _decode_optional(message[n + m:]))
    return choice, timeline


_SETTING_FLOATS = 4
"""A `Setting` on the wire: its partition, credit, bucket and first bucket sizes."""


_OPTIONAL_FLOATS = _SETTING_FLOATS + 1
"""A `Setting` or None on the wire: the setting (any, for None), then 1 if there is one."""


def _encode(setting: Setting) -> list[float]:
    values = (setting.partition_mb, setting.credit_mb, setting.bucket_cap_mb, setting.first_bucket_mb)
    return [_encode_mb(v) for v in values]


def _decode(values: torch.Tensor) -> Setting:
    return Setting(*(_decode_mb(v) for v in values))


def _encode_optional(setting: Setting | None) -> list[float]:
    return [*_encode(setting or Setting(None, None)), float(setting is not None)]


def _decode_optional(values: torch.Tensor) -> Setting | None:
    return _decode(values[:_SETTING_FLOATS]) if values[_SETTING_FLOATS] > 0 else None


def _encode_mb(value: float | None) -> float:
    return -1.0 if value is None else value


def _decode_mb(value: torch.Tensor) -> float | None:
    return None if float(value) < 0 else float(value)


def planning_bytes_per_s(warmup: WarmupTimeline) -> float:
    """The bandwidth plans assume: the one seen while training, never above the idle
    link's (where measured); unbounded if neither is known.

    [Note: no margin on the planning link] Plans once assumed a link 0.8 times as fast as
    this, on the view that a partition planned too late costs a little idle link time. It
    costs more: `robust_plan` sends what its simulation does not start during the backward
    pass after the input side's bucket, most urgent first, so such a partition waits behind
    every more urgent one and can miss its own layer in the next forward pass, while the
    link idles before the backward pass ends. Which partitions that is turns on the
    bandwidth, in steps, and the margin put one cell's planning link on such a step, where
    its plan flipped between a fast one and a slow one: VGG16 at 4 emulated hosts took
    229-236 ms or 253-267 with the margin, 233-234 without it
    (docs/records/2026-11-28-planning-link-margin.md). The bandwidth is already the lower
    of what training saw and what the idle link did.
    """
    bytes_per_s = warmup.loaded_bytes_per_s
    if warmup.idle_link is not None:
        bytes_per_s = min(bytes_per_s or math.inf, warmup.idle_link.bytes_per_s)
    return bytes_per_s or 1e12


def plan_order(
    partitions: Sequence[Partition], bucket_ready: Sequence[float], warmup: WarmupTimeline, credit_bytes: int | None,
    overlapping: bool = True,
) -> list[int]:
    """Rank 0's plan: priority scheduling simulated on its timeline, hardened by `robust_plan`; without
    forward overlap (``overlapping`` False), the order the buckets become ready (`arrival_order`)."""
    if not overlapping:
        return arrival_order(partitions, bucket_ready)
    link = LinkModel(latency_s=warmup.latency_s, bytes_per_s=planning_bytes_per_s(warmup))
    schedule = simulate_schedule(partitions, bucket_ready, link, credit_bytes, by_priority=True)
    return robust_plan(partitions, schedule, max(bucket_ready, default=0.0))


def plan_on_rank0(
    partitions: Sequence[Partition],
    bucket_ready: Sequence[float],
    warmup: WarmupTimeline,
    credit_bytes: int | None,
    group: dist.ProcessGroup,
    timeout_s: float,
    overlapping: bool = True,
) -> Plan:
    """Simulate priority scheduling on rank 0's timeline; broadcast rank 0's plan (`plan_order`:
    ``overlapping`` False, where every reduction is awaited at once, the order of readiness).

    Collective: every rank calls it at the same point; a peer that does not
    raises `CommunicationTimeout` after ``timeout_s``. The link is modelled by
    the measured latency and the bandwidth seen while training
    (`planning_bytes_per_s`); if the link is
    faster than that, non-urgent partitions merely go a little later, never
    ahead of urgent ones; the plan keeps the link busy to the end of the
    backward pass (see `robust_plan`).
    """
    plan = torch.tensor(plan_order(partitions, bucket_ready, warmup, credit_bytes, overlapping), dtype=torch.int64)
    if dist.get_world_size(group) > 1:
        work = dist.broadcast(plan, group=group, group_src=0, async_op=True)
        wait_or_raise(work, timeout_s, "the broadcast of rank 0's plan")
    return Plan(tuple(partitions), tuple(plan.tolist()), credit_bytes, agreed=True, by_readiness=not overlapping)


@dataclass(frozen=True)
class WarmupTimeline:
    """What a plan for any layout needs from warm-up, kept when the profile is dropped
    (the auto-tuner plans each setting it tries from it)."""

    slot_ready_s: tuple[float, ...]
    loaded_bytes_per_s: float | None
    latency_s: float
    forward_s: float = 0.0
    idle_link: LinkModel | None = None
    """The link as the cost model measured it, idle (rank 0, when it ran)."""

"""Measure a link's all-reduce costs among the ranks of a group (`measure_link`), and a whole
`Profile` on a group (`profile_on_group`: the model's timeline with the link attached)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from commsched.errors import wait_or_raise
from commsched.profiling.model import as_batch, call_model, clock, profile_model
from commsched.profiling.profile import LinkProfile, LinkSample, Profile, fit_link

DEFAULT_LINK_SIZES = (2**16, 2**20, 2**23)
"""All-reduce sizes `measure_link` times, in bytes: 64 KiB, 1 MiB, 8 MiB."""


IN_FLIGHT = {"gloo": 2}
"""Collectives a backend runs at once on one process group: gloo's process group has two worker
threads; NCCL, and any backend not named, one (see [Note: two collectives at once] in
`commsched.planning.wire`)."""


def collectives_in_flight(group: dist.ProcessGroup | None, device: torch.device) -> int:
    """How many collectives of ``group`` on tensors on ``device`` run at once (`IN_FLIGHT`); tensors
    off the host keep one."""
    return IN_FLIGHT.get(str(dist.get_backend(group)), 1) if torch.device(device).type == "cpu" else 1

MAX_BESIDE_COLLECTIVES = 64
"""Most all-reduces `measure_link` runs back to back beside one ``compute()`` call."""


def measure_link(
    group: dist.ProcessGroup | None,
    device: torch.device | str,
    sizes_bytes: Sequence[int] = DEFAULT_LINK_SIZES,
    repeats: int = 5,
    compute: Callable[[], None] | None = None,
    timeout_s: float = 300.0,
) -> LinkProfile:
    """Time all-reduces of ``sizes_bytes`` (float32) among ``group``'s ranks, with tensors on ``device``.

    Collective: every rank of ``group`` calls it with the same sizes and
    repeats, and with or without ``compute``. Per size, the median of
    ``repeats`` all-reduces (after one untimed; the sizes take turns); the fit ``latency_s + n /
    bytes_per_s`` is a least-squares line through them, its latency never
    below a one-element all-reduce (and, if the times do not grow with the
    size, the bandwidth of the largest alone). With ``compute`` (a
    function that computes, e.g. one forward and backward pass),
    ``compute_slowdown`` is the median time of ``compute()`` while all-reduces
    of the largest size run beside it (enough back to back to cover it, at
    most `MAX_BESIDE_COLLECTIVES`) over its median time alone, minus one,
    at least 0; ``collective_slowdown`` is how much the computation slows those
    all-reduces ([Note: slowdown of the all-reduces]); ``in_flight`` is what the group's backend
    runs at once (`collectives_in_flight`). Every rank gets the same result: each figure is the largest any
    rank measured. A rank that does not join raises `CommunicationTimeout` after ``timeout_s``.
    """
    device = torch.device(device)
    sizes = sorted({max(4, int(size)) // 4 * 4 for size in sizes_bytes})
    if len(sizes) < 2:
        raise ValueError(f"measure_link needs at least two different sizes to fit a line, got {list(sizes_bytes)}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    now = clock(device)
    world_size = dist.get_world_size(group)
    what = "an all-reduce of the link measurement (commsched.profiling.link.measure_link)"

    def timed(buffer: torch.Tensor) -> float:
        start = now()
        wait_or_raise(dist.all_reduce(buffer, group=group, async_op=True), timeout_s, what)
        return now() - start

    buffers = [torch.zeros(1, dtype=torch.float32, device=device)]
    buffers += [torch.zeros(size // 4, dtype=torch.float32, device=device) for size in sizes]
    for buffer in buffers:
        timed(buffer)  # the first of a size may set up connections or buffers
    # Sizes take turns, so a slow spell of the host slows every size alike.
    times = [[timed(buffer) for buffer in buffers] for _ in range(repeats)]
    floor_s, *medians = (statistics.median(column) for column in zip(*times))
    figures = _largest_over_ranks([floor_s, *medians], group, device, timeout_s)
    floor_s, medians = figures[0], figures[1:]
    slowdown = collective_slowdown = 0.0
    if compute is not None:
        slowdown, collective_slowdown = _slowdowns(compute, buffers[-1], medians[-1], group, device, repeats,
                                                   timeout_s, now)
    latency_s, bytes_per_s = fit_link(sizes, medians, floor_s)
    return LinkProfile(
        world_size=world_size,
        samples=tuple(LinkSample(nbytes=n, seconds=s) for n, s in zip(sizes, medians)),
        latency_s=latency_s,
        bytes_per_s=bytes_per_s,
        compute_slowdown=slowdown,
        collective_slowdown=collective_slowdown,
        in_flight=collectives_in_flight(group, device),
    )


def _largest_over_ranks(
    values: Sequence[float], group: dist.ProcessGroup | None, device: torch.device, timeout_s: float
) -> list[float]:
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
    wait_or_raise(work, timeout_s, "the agreement on the link measurement (commsched.profiling.link.measure_link)")
    return tensor.tolist()


def _slowdowns(
    compute: Callable[[], None],
    buffer: torch.Tensor,
    collective_s: float,
    group: dist.ProcessGroup | None,
    device: torch.device,
    repeats: int,
    timeout_s: float,
    now: Callable[[], float],
) -> tuple[float, float]:
    """``(compute_slowdown, collective_slowdown)``; see `measure_link`. Collective; every rank runs
    the same number of all-reduces.

    [Note: slowdown of the all-reduces] The all-reduces issued beside
    ``compute()`` run at a rate ``1 / (1 + y)`` while it runs and at full rate
    after. With ``W`` their time alone (the same all-reduces issued at once
    without the computation: as many as two run at a time where the transport
    overlaps them, see ``in_flight``, so not count x ``collective_s``), ``T`` the
    computation's time beside them and ``total`` the time until the last one
    completes: if they finish within ``T``, ``total = W (1 + y)``; otherwise
    ``total = W + T y / (1 + y)``. Either gives ``y``.
    """
    what = "an all-reduce beside computation (commsched.profiling.link.measure_link)"

    def run_compute() -> float:
        start = now()
        compute()
        return now() - start

    run_compute()  # warm
    alone_s = statistics.median(run_compute() for _ in range(repeats))
    alone_s = _largest_over_ranks([alone_s], group, device, timeout_s)[0]
    count = max(1, min(MAX_BESIDE_COLLECTIVES, math.ceil(alone_s / max(collective_s, 1e-9))))

    def issue_all() -> list[dist.Work]:
        return [dist.all_reduce(buffer, group=group, async_op=True) for _ in range(count)]

    def wait_all(works: list[dist.Work]) -> None:
        for work in works:
            wait_or_raise(work, timeout_s, what)

    def collectives_alone() -> float:
        issued = now()
        wait_all(issue_all())
        return now() - issued

    collectives_alone()  # warm
    alone, collectives, beside, totals = [], [], [], []
    for _ in range(repeats):
        alone.append(run_compute())
        collectives.append(collectives_alone())
        issued = now()
        works = issue_all()
        beside.append(run_compute())
        wait_all(works)
        totals.append(now() - issued)
    work_s = statistics.median(collectives)
    stretched = []
    for total_s, beside_s in zip(totals, beside, strict=True):
        if total_s <= beside_s:
            stretched.append(total_s / max(work_s, 1e-12) - 1.0)
        else:
            share = min(0.95, max(0.0, (total_s - work_s) / max(beside_s, 1e-12)))
            stretched.append(share / (1.0 - share))
    ratio = statistics.median(beside) / max(statistics.median(alone), 1e-12) - 1.0
    compute_slowdown, collective_slowdown = _largest_over_ranks(
        [ratio, statistics.median(stretched)], group, device, timeout_s)
    return max(0.0, compute_slowdown), max(0.0, collective_slowdown)


def profile_on_group(
    model: nn.Module,
    make_batch: Callable[[], tuple],
    loss_fn: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    iterations: int = 5,
    warmup: int = 2,
    name: str = "model",
    *,
    group: dist.ProcessGroup | None = None,
    batch_size: int | None = None,
    sizes_bytes: Sequence[int] = DEFAULT_LINK_SIZES,
    repeats: int = 5,
    timeout_s: float = 300.0,
) -> Profile:
    """`profile_model`, with the link of ``group`` (default: the world) attached when it has several ranks.

    Collective when a process group is initialised with more than one rank:
    every rank profiles its own model, then `measure_link` runs on ``group``
    with tensors on the model's device and one forward and backward pass of
    the model as the computation beside the all-reduces. Each rank returns its
    own timeline with the same link.
    """
    profile = profile_model(model, make_batch, loss_fn, optimizer, iterations, warmup, name, batch_size=batch_size)
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        return profile
    device = next(p.device for p in model.parameters() if p.requires_grad)

    def compute() -> None:
        batch = as_batch(make_batch())
        loss_fn(call_model(model, batch[0]), *batch[1:]).backward()
        model.zero_grad(set_to_none=True)

    link = measure_link(group, device, sizes_bytes, repeats, compute, timeout_s)
    return profile.with_link(link)

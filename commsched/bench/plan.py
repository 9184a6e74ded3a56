"""``commsched plan``: what torch DDP, commsched's defaults and the best `Strategy` would take on
clusters you do not have, from one profile of your model.

The model is profiled here, in one process (`commsched.profiling.model.profile_model`),
or a profile saved earlier (``--save-profile`` on the machine that trains) is
loaded with ``--profile``. Then, for every number of workers and link rate
asked for, the simulator (`commsched.simulator`) replays one steady-state
iteration of torch DDP with its defaults, of ``Strategy()`` as a run would
adopt it (its cost model's choice of partitions for that cluster,
`commsched.simulator.adoption.as_run`) and of every candidate of `strategy_space`,
and the table shows each, the bound no system beats, and the fastest
Strategy as the code to write.

MODEL is one of:

- a bench workload (``demo-mlp``, ``resnet-like``, ...): its model, its
  synthetic batches and cross-entropy;
- a torchvision model name (``resnet50``, ``vgg16``; torchvision must be
  installed), built without weights;
- an import path ``package.module:factory``: ``factory()`` returns the model
  (the working directory is importable).

For the last two the input is a batch of ``--input-shape`` Gaussian values
(default 3 224 224 for torchvision) and the loss is cross-entropy against
fixed labels when the output is 2-D (a batch of logits), else the mean square
of the output; a model with several outputs sums that loss over them.

``--compute-scale X`` multiplies every compute time of the profile by X
(`commsched.profiling.model.scaled_compute`; ``--save-profile`` writes it unscaled):
a profile taken on a CPU, scaled by 0.02, stands for a device 50 times faster.

The cluster: ``--latency-us`` per hop, the ``--algorithm`` of the
all-reduce, and no fixed host cost per collective, unless the profile carries
a measured link (`commsched.profiling.link.profile_on_group`): then its fixed cost
beyond the hop latency is the per-collective host cost and its measured
``compute_slowdown`` slows computation beside communication, at every link rate
asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

from commsched.profiling.model import profile_model, scaled_compute
from commsched.profiling.profile import Profile
from commsched.simulator import Cluster, DDPConfig, best_strategy, bound_s, simulate
from commsched.simulator.adoption import as_run
from commsched.strategy import Strategy

DEFAULT_WORKERS = (2, 8, 16, 32, 64)
DEFAULT_GBIT = (1.0, 10.0, 100.0)
DEFAULT_IMAGE_SHAPE = (3, 224, 224)
"""Input of a torchvision model when ``--input-shape`` is not given."""
WARMUP_ITERATIONS = 2
"""Iterations `profile_model` runs before the measured ones."""


class PlanError(Exception):
    """A user error ``commsched plan`` reports in one line (exit code 2)."""


# ------------------------------------------------------------------ the model
@dataclass(frozen=True)
class Measurable:
    """What `profile_model` needs, for one MODEL argument."""

    name: str
    model: nn.Module
    make_batch: Callable[[], tuple]
    loss_fn: Callable[..., torch.Tensor]


def resolve_model(spec: str, batch_size: int, input_shape: Sequence[int] | None, device: torch.device) -> Measurable:
    """The model, batches and loss for MODEL ``spec``; `PlanError` naming the fix if it names nothing."""
    from commsched.bench.models import WORKLOADS

    if spec in WORKLOADS:
        if input_shape is not None:
            raise PlanError(f"--input-shape applies to torchvision models and import paths; the workload {spec!r} "
                            "has its own inputs")
        workload = WORKLOADS[spec]
        batches = workload.batches(batch_size)

        def make_batch() -> tuple:
            x, y = next(batches)
            return x.to(device), y.to(device)

        return Measurable(spec, workload.build().to(device), make_batch, F.cross_entropy)
    if ":" in spec:
        model = _from_import_path(spec)
        if input_shape is None:
            raise PlanError(f"give the input of {spec} with --input-shape (one example's shape, without the batch)")
    else:
        model = _torchvision_model(spec, WORKLOADS)
        input_shape = DEFAULT_IMAGE_SHAPE if input_shape is None else input_shape
    shape = (batch_size, *input_shape)
    return Measurable(spec, model.to(device), lambda: (torch.randn(shape, device=device),), generic_loss)


def generic_loss(output: Any) -> torch.Tensor:
    """Cross-entropy against fixed labels for 2-D float outputs, else the mean square; summed over outputs."""
    outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not outputs:
        raise PlanError(f"the model's output holds no floating-point tensor to make a loss of "
                        f"({type(output).__name__}); plan with a profile saved by profile_model and your own loss")
    total = None
    for out in outputs:
        if out.dim() == 2 and out.shape[1] > 1:
            labels = torch.arange(out.shape[0], device=out.device) % out.shape[1]
            loss = F.cross_entropy(out.float(), labels)
        else:
            loss = out.float().pow(2).mean()
        total = loss if total is None else total + loss
    return total


def _from_import_path(spec: str) -> nn.Module:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise PlanError(f"{spec!r} is not an import path; write package.module:factory")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise PlanError(f"cannot import {module_name!r} for {spec!r} ({error}); check the spelling and that it is "
                        "importable from here (PYTHONPATH)") from error
    factory = module
    for part in attribute.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise PlanError(f"{module_name} has no {attribute!r} (from {spec!r}); name a function that returns the "
                            "model")
    model = factory() if callable(factory) and not isinstance(factory, nn.Module) else factory
    if not isinstance(model, nn.Module):
        raise PlanError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module; name a function that "
                        "returns the model")
    return model


def _torchvision_model(name: str, workloads: dict) -> nn.Module:
    known = ", ".join(sorted(workloads))
    try:
        import torchvision
    except ImportError as error:
        raise PlanError(
            f"{name!r} is not a bench workload ({known}) nor an import path (module:factory), and torchvision, "
            f"which would build it, is not installed: pip install torchvision=={torchvision_version()} "
            "(the release that matches this torch), or plan from a saved profile with --profile FILE"
        ) from error
    except Exception as error:  # noqa: BLE001 - a torchvision built for another torch fails in many ways
        raise PlanError(
            f"torchvision, which would build {name!r}, does not load with torch {torch.__version__} ({error}): "
            f"pip install torchvision=={torchvision_version()} (the release that matches this torch), or plan "
            "from a saved profile with --profile FILE"
        ) from error
    if name not in torchvision.models.list_models():
        raise PlanError(f"unknown model {name!r}: not a bench workload ({known}), not a torchvision model "
                        "(resnet50, vgg16, ...), not an import path (module:factory)")
    return torchvision.models.get_model(name, weights=None)


def torchvision_version(torch_version: str = torch.__version__) -> str:
    """The torchvision release built for ``torch_version`` (torch 2.m.p goes with torchvision 0.(m+15).p)."""
    release = torch_version.split("+")[0].split(".")
    try:
        major, minor, patch = int(release[0]), int(release[1]), int("".join(c for c in release[2] if c.isdigit()))
    except (IndexError, ValueError):
        return "<the release matching torch " + torch_version + ">"
    if major != 2:
        return "<the release matching torch " + torch_version + ">"
    return f"0.{minor + 15}.{patch}"


def measure(spec: str, batch_size: int, input_shape: Sequence[int] | None, iterations: int,
            device: torch.device) -> Profile:
    """Profile MODEL ``spec`` here, in one process."""
    target = resolve_model(spec, batch_size, input_shape, device)
    return profile_model(target.model, target.make_batch, target.loss_fn, iterations=iterations,
                         warmup=WARMUP_ITERATIONS, name=target.name, batch_size=batch_size)


def load_profile(path: Path) -> Profile:
    try:
        return Profile.load(path)
    except FileNotFoundError as error:
        raise PlanError(f"no profile at {path}; save one with --save-profile FILE") from error
    except ValueError as error:
        raise PlanError(f"{path}: {error}") from error


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class PlanRow:
    """One cluster: each system's simulated iteration time, the bound, and the fastest strategy."""

    workers: int
    gbit_s: float
    ddp_s: float
    default_s: float
    best_s: float
    bound_s: float
    best: Strategy

    @property
    def speedup(self) -> float:
        """The best strategy's speedup over torch DDP with its defaults."""
        return self.ddp_s / self.best_s


def cluster_for(profile: Profile, workers: int, gbit_s: float, latency_s: float, algorithm: str,
                servers: int) -> Cluster:
    """The cluster of one cell; with a measured link in ``profile``, its host cost and slowdown too."""
    link = profile.link
    if link is not None and link.world_size >= 2 and link.bytes_per_s > 0:
        cluster = Cluster.from_link(link, workers, gbit_s, algorithm, latency_s=latency_s)
        return dataclasses.replace(cluster, servers=servers)
    return Cluster(workers, gbit_s, latency_s=latency_s, algorithm=algorithm, servers=servers)


def plan(profile: Profile, workers: Sequence[int], gbits: Sequence[float], latency_s: float = 25e-6,
         algorithm: str = "ring", servers: int = 0) -> list[PlanRow]:
    """Simulate every cell of ``workers`` x ``gbits``; see the module's docstring."""
    rows = []
    for count in workers:
        for gbit in gbits:
            cluster = cluster_for(profile, count, gbit, latency_s, algorithm, servers)
            best, result = best_strategy(profile, cluster)
            bound = bound_s(profile, cluster)
            if servers:  # the all-reduce systems are candidates too
                bound = min(bound, bound_s(profile, dataclasses.replace(cluster, servers=0)))
            rows.append(PlanRow(
                workers=count, gbit_s=gbit,
                ddp_s=simulate(profile, cluster, DDPConfig()).iteration_s,
                default_s=simulate(profile, cluster, as_run(Strategy(), profile, cluster)).iteration_s,
                best_s=result.iteration_s, bound_s=bound, best=best,
            ))
    return rows


def strategy_code(strategy: Strategy) -> str:
    """``strategy`` as the Python that builds it, naming only what differs from ``Strategy()``.

    Bucket limits that the partition size overrides (buckets are capped at it)
    are left at their defaults, so the code says only what matters.
    """
    default = Strategy()
    for name in ("bucket_cap_mb", "first_bucket_mb"):
        simpler = dataclasses.replace(strategy, **{name: getattr(default, name)})
        if (simpler.bucket_size_limits_bytes == strategy.bucket_size_limits_bytes
                and simpler.ps_block_bytes == strategy.ps_block_bytes):
            strategy = simpler
    return _code(strategy)


def _code(value: object) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        try:
            default = type(value)()
        except TypeError:  # no defaults to differ from
            return repr(value)
        changed = [
            f"{field.name}={_code(getattr(value, field.name))}"
            for field in dataclasses.fields(value)
            if getattr(value, field.name) != getattr(default, field.name)
        ]
        return f"{type(value).__name__}({', '.join(changed)})"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value)


# -------------------------------------------------------------- the output
HEADERS = ("workers", "Gbit/s", "DDP ms", "commsched default ms", "best ms", "bound ms", "best vs DDP",
           "recommended")


def table_cells(rows: Sequence[PlanRow]) -> list[tuple[str, ...]]:
    return [
        (str(r.workers), f"{r.gbit_s:g}", f"{r.ddp_s * 1e3:.2f}", f"{r.default_s * 1e3:.2f}",
         f"{r.best_s * 1e3:.2f}", f"{r.bound_s * 1e3:.2f}", f"{r.speedup:.2f}x", strategy_code(r.best))
        for r in rows
    ]


def describe_profile(profile: Profile, scale: float) -> str:
    scaled = f", compute times x{scale:g}" if scale != 1 else ""
    link = ""
    if profile.link is not None:
        link = (f"; measured link among {profile.link.world_size}: {profile.link.latency_s * 1e6:.0f} us + "
                f"n / {profile.link.bytes_per_s * 8 / 1e9:.2f} Gbit/s, computation {profile.link.compute_slowdown:.0%}"
                " slower beside it")
    return (
        f"{profile.model} on {profile.device}, batch {profile.batch_size} per worker: forward "
        f"{profile.forward_s * 1e3:.2f} ms, backward {profile.backward_s * 1e3:.2f} ms, update "
        f"{profile.update_s * 1e3:.2f} ms{scaled}; {len(profile.parameters)} gradients, "
        f"{profile.gradient_bytes / 2**20:.1f} MiB{link}"
    )


def render(rows: Sequence[PlanRow], title: str, notes: Sequence[str] = ()) -> str:
    """The table as text (with rich where it is installed, plain columns otherwise), then ``notes``."""
    cells = table_cells(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return _plain(cells, title, notes)
    table = Table(title=title, title_justify="left")
    for header in HEADERS:
        table.add_column(header, justify="left" if header == "recommended" else "right",
                         no_wrap=header == "recommended")
    for row in cells:
        table.add_row(*row)
    width = sum(max(len(h), *(len(c[i]) for c in cells)) + 3 for i, h in enumerate(HEADERS)) + 1
    out = io.StringIO()
    console = Console(file=out, width=max(width, 100))
    console.print(table)
    return "".join(line.rstrip() + "\n" for line in [*out.getvalue().splitlines(), *notes])


def _plain(cells: Sequence[Sequence[str]], title: str, notes: Sequence[str]) -> str:
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(HEADERS)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == len(widths) - 1 else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    return "\n".join([title, line(HEADERS), *(line(c) for c in cells), *notes]) + "\n"


def plot(rows: Sequence[PlanRow], path: Path, title: str) -> Path:
    """Speedup of the best strategy over torch DDP against the number of workers, one line per link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for gbit in sorted({r.gbit_s for r in rows}):
        mine = sorted((r for r in rows if r.gbit_s == gbit), key=lambda r: r.workers)
        ax.plot([r.workers for r in mine], [r.speedup for r in mine], "o-", label=f"{gbit:g} Gbit/s")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    counts = sorted({r.workers for r in rows})
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.minorticks_off()
    ax.set_xlabel("workers")
    ax.set_ylabel("best Strategy's speedup over torch DDP")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------ the command
def check_arguments(args: Any) -> None:
    """What argparse cannot check; `PlanError` naming the option."""
    if any(n < 1 for n in args.workers):
        raise PlanError(f"--workers must all be at least 1, got {' '.join(map(str, args.workers))}")
    if any(not (math.isfinite(g) and g > 0) for g in args.gbit):
        raise PlanError(f"--gbit must all be link rates > 0, got {' '.join(f'{g:g}' for g in args.gbit)}")
    if not (math.isfinite(args.latency_us) and args.latency_us >= 0):
        raise PlanError(f"--latency-us must be a finite number >= 0, got {args.latency_us:g}")
    if args.servers < 0:
        raise PlanError(f"--servers must be at least 0, got {args.servers}")
    if not (math.isfinite(args.compute_scale) and args.compute_scale > 0):
        raise PlanError(f"--compute-scale must be a finite number > 0, got {args.compute_scale:g}")
    if args.input_shape is not None and any(n < 1 for n in args.input_shape):
        raise PlanError(f"--input-shape must be sizes >= 1, got {' '.join(map(str, args.input_shape))}")


def run(args: Any) -> int:
    """``commsched plan`` with parsed arguments (see `commsched.cli`); raises `PlanError` on user errors."""
    check_arguments(args)
    if args.profile is not None:
        profile = load_profile(args.profile)
        if args.model is not None and args.model != profile.model:
            raise PlanError(f"{args.profile} is a profile of {profile.model!r}, not {args.model!r}; leave MODEL out "
                            "to plan with it, or leave --profile out to measure MODEL")
    elif args.model is None:
        raise PlanError("give MODEL to measure, or --profile FILE to plan from a saved profile")
    else:
        device = torch.device(args.device) if args.device else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        try:
            profile = measure(args.model, args.batch_size, args.input_shape, args.iterations, device)
        except ValueError as error:  # e.g. a model without trainable parameters
            raise PlanError(f"cannot profile {args.model}: {error}") from error
        if args.save_profile is not None:
            profile.save(args.save_profile)
            print(f"saved the profile to {args.save_profile}")
    scale = args.compute_scale
    planned = scaled_compute(profile, scale) if scale != 1 else profile
    rows = plan(planned, args.workers, args.gbit, args.latency_us * 1e-6, args.algorithm, args.servers)
    servers = f", {args.servers} parameter servers" if args.servers else ""
    bound = "max(computation, one all-reduce of every gradient)"
    if args.servers:
        bound += " or, if less, max(computation without the update, the busiest server's link)"
    notes = [
        f"Simulated: {args.algorithm} all-reduce, {args.latency_us:g} us per hop{servers}.",
        f"best: the fastest of strategy_space(){' on both backends' if args.servers else ''}; bound: {bound}; "
        "best vs DDP: DDP ms / best ms.",
    ]
    print(render(rows, describe_profile(profile, scale), notes), end="")
    if args.plot is not None:
        scaled = f", compute x{scale:g}" if scale != 1 else ""
        title = f"{profile.model}, batch {profile.batch_size} per worker{scaled}"
        print(f"plot: {plot(rows, args.plot, title)}")
    return 0

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
beyond the hop latency is the per-collective host cost, its measured
``compute_slowdown`` slows computation beside communication, at every link rate
asked for, and its backend says how many collectives run at once (gloo two).
``--in-flight N`` sets that instead: 2 for gloo, 1 for NCCL ([Note: two
collectives at once] in `commsched.planning.wire`).
"""

from __future__ import annotations

import dataclasses
import importlib
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

from commsched.bench.plan_output import PlanRow, describe_profile, plot, render
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


def cluster_for(profile: Profile, workers: int, gbit_s: float, latency_s: float, algorithm: str,
                servers: int, in_flight: int | None = None, all_to_all: bool = False) -> Cluster:
    """The cluster of one cell; with a measured link in ``profile``, its host cost, slowdown and
    collectives in flight too (``in_flight``, where given, replaces the last); ``all_to_all``:
    the transport may all-reduce in two all-to-alls (`Cluster.all_to_all`)."""
    link = profile.link
    if link is not None and link.world_size >= 2 and link.bytes_per_s > 0:
        cluster = Cluster.from_link(link, workers, gbit_s, algorithm, latency_s=latency_s)
        cluster = dataclasses.replace(cluster, servers=servers)
    else:
        cluster = Cluster(workers, gbit_s, latency_s=latency_s, algorithm=algorithm, servers=servers)
    cluster = dataclasses.replace(cluster, all_to_all=all_to_all)
    return cluster if in_flight is None else dataclasses.replace(cluster, in_flight=in_flight)


def plan(profile: Profile, workers: Sequence[int], gbits: Sequence[float], latency_s: float = 25e-6,
         algorithm: str = "ring", servers: int = 0, in_flight: int | None = None,
         all_to_all: bool = False) -> list[PlanRow]:
    """Simulate every cell of ``workers`` x ``gbits``; see the module's docstring."""
    rows = []
    for count in workers:
        for gbit in gbits:
            cluster = cluster_for(profile, count, gbit, latency_s, algorithm, servers, in_flight, all_to_all)
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
    if args.in_flight is not None and args.in_flight < 1:
        raise PlanError(f"--in-flight must be at least 1, got {args.in_flight}")
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
    rows = plan(planned, args.workers, args.gbit, args.latency_us * 1e-6, args.algorithm, args.servers,
                args.in_flight, args.all_to_all)
    servers = f", {args.servers} parameter servers" if args.servers else ""
    bound = "max(computation, one all-reduce of every gradient)"
    if args.servers:
        bound += " or, if less, max(computation without the update, the busiest server's link)"
    in_flight = args.in_flight or (profile.link.in_flight if profile.link is not None else 1)
    at_once = "one collective at a time" if in_flight == 1 else f"{in_flight} collectives at once"
    if args.all_to_all:
        at_once += ", commsched's first bucket in two all-to-alls where warm-up would send it so"
    notes = [
        f"Simulated: {args.algorithm} all-reduce, {args.latency_us:g} us per hop, {at_once}{servers}.",
        f"best: the fastest of strategy_space(){' on both backends' if args.servers else ''}; bound: {bound}; "
        "best vs DDP: DDP ms / best ms.",
    ]
    print(render(rows, describe_profile(profile, scale), notes), end="")
    if args.plot is not None:
        scaled = f", compute x{scale:g}" if scale != 1 else ""
        title = f"{profile.model}, batch {profile.batch_size} per worker{scaled}"
        print(f"plot: {plot(rows, args.plot, title)}")
    return 0

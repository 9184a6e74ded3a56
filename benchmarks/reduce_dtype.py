"""Strategy(reduce_dtype=...): what summing gradients in another dtype costs in accuracy and buys in time.

    .venv/bin/python benchmarks/reduce_dtype.py error --json results/reduce_dtype_error.json
    .venv/bin/python benchmarks/reduce_dtype.py convergence --json results/reduce_dtype_convergence.json \\
        --plot docs/img/reduce_dtype_loss.png
    sudo .venv/bin/python benchmarks/reduce_dtype.py speed --json results/reduce_dtype_speed.json

Two features, each against what it replaces:

- *float32 parameters, bfloat16 on the wire*: commsched with
  ``Strategy(reduce_dtype=torch.bfloat16)`` against commsched in float32 (one
  process's parameters, to float tolerance) and torch DDP with
  ``bf16_compress_hook`` (float32 cast to bfloat16, divided, all-reduced in
  bfloat16, cast back);
- *bfloat16 parameters summed in float32*: commsched with
  ``Strategy(reduce_dtype=torch.float32)`` against commsched summing them in
  bfloat16 (the default).

``error`` (loopback, 2 and 4 ranks): for each model, the first step's averaged
gradient against the exact average of the same ranks' gradients (computed in
float64 from each rank's own gradient: what the reduction alone adds), and the
parameters after ``--steps`` steps against one process training in float32 on
the concatenated batch (relative to how far that process moved them).

``convergence`` (loopback, 2 ranks or ``--world-sizes N``): the loss curve of each system over
``--steps`` steps, from the same weights on the same batches: the bench models
(`commsched.bench.models`) with SGD and momentum, and a small GPT (next-token
prediction on sequences of a fixed random Markov chain) with AdamW. The loss of
a step is the mean over ranks. Reported: the mean loss over the last tenth of
the steps, the largest gap between a system's curve (smoothed over 10 steps)
and float32's, and the loss on a held-out batch at the end.

``speed`` (emulated hosts, root): 2 hosts at 0.25 and 1 Gbit/s, the bench
models; in each of ``--repeats`` fresh clusters per cell the systems train
side by side in interleaved rounds (as `commsched.bench.compare`: a lead-in
iteration, then measured ones, then what is in flight is finished outside
the timed span). Reported: each system's median iteration time on rank 0
(the median over repeats of each repeat's median), and the ratios (the
median over repeats of each repeat's ratio).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from commsched.bench import runner
from commsched.bench.repeats import Repeat, median_s, ratios
from commsched.bench.tasks import (
    BATCH,
    Host,
    Task,
    flat_parameters,
    interleaved_rounds,
    plot_losses,
    release,
    smoothed,
    task,
)

FP32_SYSTEMS = ("commsched, float32", "commsched, bf16 on the wire", "DDP, bf16_compress_hook")
BF16_SYSTEMS = ("commsched, bf16 params", "commsched, bf16 params, fp32 sum")
SPEED_SYSTEMS = ("DDP", "DDP, bf16_compress_hook", "commsched, float32", "commsched, bf16 on the wire")
BENCH_MODELS = ("resnet-like", "vgg-like", "transformer-like")
# -------------------------------------------------------------------------- systems
def build(system: str, base: nn.Module, make_optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``system`` (a name of `FP32_SYSTEMS`, `BF16_SYSTEMS` or `SPEED_SYSTEMS`) on a copy of ``base``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel

    import commsched

    model = copy.deepcopy(base)
    if "bf16 params" in system:
        model.to(torch.bfloat16)
    if system.startswith("DDP"):
        model = DistributedDataParallel(model)
        if "bf16_compress_hook" in system:
            # DDP refuses the hook by its name unless NCCL >= 2.10 or XCCL runs it; gloo sums bfloat16
            # too, so it is registered under another name, unchanged.
            def compress(state, bucket):
                return bf16_compress_hook(state, bucket)

            model.register_comm_hook(None, compress)
        return model, make_optimizer(model)
    reduce_dtype = {"commsched, bf16 on the wire": torch.bfloat16,
                    "commsched, bf16 params, fp32 sum": torch.float32}.get(system)
    return commsched.prepare(model, make_optimizer(model), commsched.Strategy(reduce_dtype=reduce_dtype))


def flat_gradients(model: nn.Module) -> torch.Tensor:
    module = getattr(model, "module", model)
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).double().reshape(-1)
                      for p in module.parameters()])


# ---------------------------------------------------------------------------- error
def error_on_rank(rank: int, world_size: int, models: list[str], steps: int) -> dict | None:
    """Per model and system: the first step's gradient error, the parameters' error after ``steps``."""
    results: dict = {}
    for name in models:
        t = task(name)
        torch.manual_seed(0)
        base = t.build()
        batch = BATCH[name]
        mine = slice(rank * batch, (rank + 1) * batch)
        reference = None
        if rank == 0:  # one process in float32 on the concatenated batch
            model = copy.deepcopy(base)
            optimizer = t.optimizer(model)
            stream = t.batches(batch * world_size, 1)
            for _ in range(steps):
                x, y = next(stream)
                sum(t.loss(model, x[r * batch:(r + 1) * batch], y[r * batch:(r + 1) * batch])
                    for r in range(world_size)).div(world_size).backward()
                optimizer.step()
                optimizer.zero_grad()
            reference = flat_parameters(model)
        initial = flat_parameters(base)
        results[name] = {}
        for system in (*FP32_SYSTEMS, *BF16_SYSTEMS):
            model, optimizer = build(system, base, t.optimizer)
            stream = t.batches(batch * world_size, 1)
            gradient_error = math.nan
            for step in range(steps):
                x, y = next(stream)
                t.loss(model, x[mine], y[mine]).backward()
                if step == 0:
                    gradient_error = _gradient_error(model, t, base, system, x, y, batch, rank, world_size)
                optimizer.step()
                optimizer.zero_grad()
            final = flat_parameters(model)
            release(model)
            if rank == 0:
                results[name][system] = {
                    "gradient_error": gradient_error,
                    "parameter_error": float((final - reference).norm() / (reference - initial).norm()),
                }
        dist.barrier()
    return results if rank == 0 else None


def _gradient_error(model, t: Task, base, system: str, x, y, batch: int, rank: int, world_size: int) -> float:
    """The reduced gradient against the exact (float64) average of every rank's own gradient (collective)."""
    local = copy.deepcopy(base)
    if "bf16 params" in system:
        local.to(torch.bfloat16)
    t.loss(local, x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]).backward()
    exact = flat_gradients(local)
    dist.all_reduce(exact)
    exact /= world_size
    if hasattr(model, "_commsched_reducer"):
        model._commsched_reducer.synchronize()
    return float((flat_gradients(model) - exact).norm() / exact.norm())


# ---------------------------------------------------------------------- convergence
def convergence_on_rank(rank: int, world_size: int, models: list[str], steps: int, bf16_params: bool) -> dict | None:
    """Per model and system: the loss of every step (mean over ranks) and the held-out loss at the end."""
    results: dict = {}
    for name in models:
        t = task(name)
        torch.manual_seed(0)
        base = t.build()
        batch = BATCH[name]
        mine = slice(rank * batch, (rank + 1) * batch)
        held_out = next(t.batches(256 if name != "gpt" else 64, 12345))
        results[name] = {}
        for system in (*FP32_SYSTEMS, *(BF16_SYSTEMS if bf16_params else ())):
            model, optimizer = build(system, base, t.optimizer)
            stream = t.batches(batch * world_size, 1)
            losses = torch.zeros(steps, dtype=torch.float64)
            started = time.perf_counter()
            for step in range(steps):
                x, y = next(stream)
                loss = t.loss(model, x[mine], y[mine])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses[step] = loss.item()
            dist.all_reduce(losses)
            losses /= world_size
            flat_parameters(model)
            with torch.no_grad():
                held_out_loss = float(t.loss(getattr(model, "module", model).eval(), *held_out))
            release(model)
            if rank == 0:
                results[name][system] = {"losses": losses.tolist(), "held_out": held_out_loss,
                                         "seconds": time.perf_counter() - started}
                print(f"{name}, {system}: {steps} steps in {time.perf_counter() - started:.0f} s, "
                      f"last loss {losses[-1]:.4f}", flush=True)
    return results if rank == 0 else None


def convergence_rows(results: dict) -> list[str]:
    """Every system against float32 training (`FP32_SYSTEMS`' first, one process's to float tolerance)."""
    baseline = FP32_SYSTEMS[0]
    rows = ["| model | system | loss, last tenth | / float32's | largest gap to float32 (smoothed) | held-out loss |",
            "|---|---|---|---|---|---|"]
    for name, systems in results.items():
        base = systems[baseline]["losses"]
        tail = max(1, len(base) // 10)
        base_tail = statistics.fmean(base[-tail:])
        for system, data in systems.items():
            losses = data["losses"]
            last = statistics.fmean(losses[-tail:])
            gap = max(abs(a - b) for a, b in zip(smoothed(losses), smoothed(base), strict=True))
            rows.append(f"| {name} | {system} | {last:.4f} | {last / base_tail:.4f} | {gap:.4f} | "
                        f"{data['held_out']:.4f} |")
    return rows


def plot(results: dict, path: Path) -> None:
    plot_losses({name: {system: data["losses"] for system, data in systems.items()}
                 for name, systems in results.items()}, path)


# ---------------------------------------------------------------------------- speed
def speed_worker(spec_path: Path, out_path: Path) -> None:
    """One host of the emulated cluster: every system side by side in interleaved rounds."""
    spec = json.loads(spec_path.read_text())
    host = Host.join(spec["model"], spec["batch"])
    t, base, mine, rank = host.task, host.base, host.mine, host.rank
    runs = []
    for system in spec["systems"]:
        model, optimizer = build(system, base, host.task.optimizer)
        runs.append((system, model, optimizer, host.stream()))

    times = interleaved_rounds(runs, t, mine, {system: spec["warmup"] for system in spec["systems"]},
                               spec["rounds"], spec["iterations"])
    for _, model, *_ in runs:
        release(model)
    if rank == 0:
        out_path.write_text(json.dumps(times))
    dist.destroy_process_group()


def speed_cell(model: str, rate_gbit: float, settings: dict, port: int) -> dict[str, list[float]]:
    """Every system's iteration times (rank 0) in one fresh cluster of 2 emulated hosts."""
    return runner.on_emulated_hosts(__file__, 2, rate_gbit, {"model": model, "batch": BATCH[model], **settings},
                                    settings["timeout_s"], f"{model} at {rate_gbit:g} Gbit/s", port=port)


RATIOS = (("commsched, bf16 on the wire", "commsched, float32"),
          ("commsched, bf16 on the wire", "DDP, bf16_compress_hook"),
          ("DDP, bf16_compress_hook", "DDP"), ("commsched, float32", "DDP"))
"""The ratios the speed table gives (numerator, denominator)."""


def speed_rows(cells: list[dict]) -> list[str]:
    names = list(SPEED_SYSTEMS)
    short = {"commsched, bf16 on the wire": "bf16 wire", "commsched, float32": "float32",
             "DDP, bf16_compress_hook": "DDP hook", "DDP": "DDP"}
    rows = ["| model | link | " + " | ".join(f"{n} (ms)" for n in names) + " | "
            + " | ".join(f"{short[a]} / {short[b]}" for a, b in RATIOS) + " |",
            "|---|---|" + "---|" * (len(names) + len(RATIOS))]
    for cell in cells:
        repeats = [Repeat.of(times) for times in cell["repeats"]]
        medians = {n: median_s(repeats, n) * 1e3 for n in names}
        paired = [statistics.median(ratios(repeats, a, b)) for a, b in RATIOS]
        rows.append(f"| {cell['model']} | {cell['rate_gbit']:g} Gbit/s | "
                    + " | ".join(f"{medians[n]:.1f}" for n in names) + " | "
                    + " | ".join(f"{ratio:.3f}" for ratio in paired) + " |")
    return rows


# ----------------------------------------------------------------------------- main
def error_rows(results: dict, steps: int) -> list[str]:
    """Two tables, systems side by side: the first gradient's error, the parameters' after ``steps``."""
    systems = (*FP32_SYSTEMS, *BF16_SYSTEMS)
    rows = []
    for key, title in (("gradient_error", "first step's averaged gradient against the exact average"),
                       ("parameter_error", f"parameters after {steps} steps against one float32 process")):
        rows += [f"{title}:", "", "| model | ranks | " + " | ".join(systems) + " |",
                 "|---|---|" + "---|" * len(systems)]
        for world_size, models in results.items():
            for name, data in models.items():
                rows.append(f"| {name} | {world_size} | " + " | ".join(f"{data[s][key]:.2e}" for s in systems) + " |")
        rows.append("")
    return rows


def load(path: Path) -> dict:
    """A run saved with ``--json``: its fields, and its rows as ``results`` (as runs saved before)."""
    saved = json.loads(path.read_text())
    return {**saved, "results": saved["rows"]} if "rows" in saved else saved


def report(out: dict) -> list[str]:
    """The tables of a run (``--json``'s contents, `load`ed)."""
    if out["part"] == "error":
        return error_rows(out["results"], out["steps"])
    if out["part"] == "convergence":
        return convergence_rows(out["results"])
    return speed_rows(out["results"])


def main(argv: list[str] | None = None) -> int:
    parser = runner.make_parser(__doc__, summary_only=True)
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("part", nargs="?", choices=("error", "convergence", "speed"))
    parser.add_argument("--models", nargs="+", help="default: error: mlp, transformer-like, gpt; convergence: "
                        "the bench models and gpt; speed: the bench models")
    runner.add_world_sizes(parser, default=None, help="error: 2 4; convergence: 2 (the first is used)")
    parser.add_argument("--steps", type=int, help="error: 30; convergence: 300")
    parser.add_argument("--bf16-params", action="store_true", help="convergence: also bfloat16 parameters")
    runner.add_rates_gbit(parser, default=[0.25, 1.0], help="speed only")
    runner.add_repeats(parser, default=3, help="speed: fresh clusters per cell")
    parser.add_argument("--rounds", type=int, default=3, help="speed only")
    parser.add_argument("--iterations", type=int, default=5, help="speed: measured per system per round")
    parser.add_argument("--warmup", type=int, default=6, help="speed: unmeasured iterations per system")
    runner.add_timeout(parser, default=3600.0)
    runner.add_json(parser, help="write the run here")
    parser.add_argument("--plot", type=Path, help="convergence: the loss curves (also with --report)")
    parser.add_argument("--report", type=Path, metavar="JSON", help="print the tables of a run saved with --json")
    args = parser.parse_args(argv)
    if args.worker:
        speed_worker(*args.worker)
        return 0
    runner.refuse_below_one(parser, args, "repeats", "rounds", "iterations", "steps")
    if args.report:
        saved = load(args.report)
        print("\n".join(report(saved)))
        if args.plot and saved["part"] == "convergence":
            plot(saved["results"], args.plot)
        return 0
    if args.part is None:
        parser.error("name a part (error, convergence or speed), or --report a saved run")
    from commsched.testing import run_ranks

    out: dict = {"part": args.part}
    if args.part == "error":
        models, out["steps"] = args.models or ["mlp", "transformer-like", "gpt"], args.steps or 30
        out["results"] = {world_size: run_ranks(error_on_rank, world_size, models, out["steps"],
                                                timeout_s=args.timeout_s)[0]
                          for world_size in args.world_sizes or [2, 4]}
    elif args.part == "convergence":
        models, steps = args.models or ["resnet-like", "vgg-like", "transformer-like", "gpt"], args.steps or 300
        out["world_size"] = (args.world_sizes or [2])[0]
        out["results"] = run_ranks(convergence_on_rank, out["world_size"], models, steps, args.bf16_params,
                                   timeout_s=args.timeout_s)[0]
        if args.plot:
            plot(out["results"], args.plot)
    else:
        models = args.models or list(BENCH_MODELS)
        settings = {"systems": list(SPEED_SYSTEMS), "rounds": args.rounds, "iterations": args.iterations,
                    "warmup": args.warmup, "timeout_s": args.timeout_s}
        out["results"] = []
        port = 29711
        for model in models:
            for rate in args.rates_gbit:
                cell = {"model": model, "rate_gbit": rate, "repeats": []}
                for repeat in range(args.repeats):
                    started = time.monotonic()
                    times = speed_cell(model, rate, settings, port=port)
                    port += 1
                    cell["repeats"].append(times)
                    print(f"{model} at {rate:g} Gbit/s, repeat {repeat + 1}: " + ", ".join(
                        f"{n} {statistics.median(v) * 1e3:.1f} ms" for n, v in times.items())
                        + f" [{time.monotonic() - started:.0f} s]", flush=True)
                out["results"].append(cell)
    print("\n".join(report(out)))
    runner.write_json(args.json, out["results"], **{k: v for k, v in out.items() if k not in ("results", "argv")})
    return 0


if __name__ == "__main__":
    sys.exit(main())

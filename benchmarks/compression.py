"""Strategy(compression=PowerSGD(...)) against torch DDP with ``powerSGD_hook``: the same parameters, more speed.

    .venv/bin/python benchmarks/compression.py equality --json results/compression_equality.json
    sudo .venv/bin/python benchmarks/compression.py speed --json results/compression_speed.json
    .venv/bin/python benchmarks/compression.py convergence --json results/compression_convergence.json \\
        --plot docs/img/compression_loss.png

``equality`` (loopback, 2 and 3 ranks, float32): torch DDP with ``powerSGD_hook`` and
commsched with the same settings (rank 1 and 4, compression from iteration 3) train the
same model on the same batches for ``--steps`` steps, SGD with momentum and AdamW; reported:
the largest difference of a parameter between the two, relative to how far DDP moved it.
DDP's buckets must be commsched's for the first random ``Q`` to match (one bucket: on gloo, DDP
with the hook and several buckets stops on a collective mismatch; see docs/guide.md,
"Compression"). tests/distributed/test_powersgd.py asserts the same in float64.

``speed`` (emulated hosts, root): 2 and 4 hosts at 0.1 and 0.25 Gbit/s, the bench models; in
each of ``--repeats`` fresh clusters per cell the systems train side by side in interleaved
rounds, after their warm-up (commsched's layout settled, compression started): each rank on
its own (compute alone), each rank on its own with DDP's hook on a group of its own (the
computation and the compression's arithmetic on the same core, nothing on the wire), torch DDP
with ``powerSGD_hook`` (one bucket, the only layout gloo runs it with), commsched with
``PowerSGD``. Rank 0 also times what the compressed all-reduces of the whole model take alone
(the rest and the ``P``, then the ``Q``: one all-reduce each). Reported: each system's median
iteration on rank 0 (median over repeats), commsched over DDP with the hook, commsched over the
bound max(compute alone, compressed all-reduces alone), and DDP's and commsched's time over the
bound with the arithmetic, max(compute and arithmetic, compressed all-reduces alone): where the
arithmetic shares the cores with the backward pass, no schedule hides it.

``convergence`` (loopback, 2 ranks): the loss curves of uncompressed training, PowerSGD of rank
1 and 4, bfloat16 on the wire, and torch DDP with ``powerSGD_hook`` of rank 1 beside them, over
``--steps`` steps of the small GPT and the ResNet-like model, from the same weights on the same
batches; compression from iteration 10.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from commsched.bench import runner
from commsched.bench.compare import SETTLED_AFTER
from commsched.bench.repeats import Repeat, median_s, ratios
from commsched.bench.tasks import BATCH, Host, flat_parameters, interleaved_rounds, plot_losses, release, task

BENCH_MODELS = ("vgg-like", "resnet-like", "transformer-like")
COMPUTE, DDP_HOOK, COMMSCHED = "compute only", "DDP, powerSGD_hook", "commsched, PowerSGD"
ARITHMETIC = "compute + compression arithmetic"
"""torch DDP with ``powerSGD_hook`` on a group of this rank alone: the same computation and the same
compression arithmetic (and error feedback) on the same core as in training, nothing on the wire."""
SPEED_SYSTEMS = (COMPUTE, ARITHMETIC, DDP_HOOK, COMMSCHED)
ONE_BUCKET_MB = 4096.0
"""DDP's bucket cap for the hook: every model here in one bucket."""


# -------------------------------------------------------------------------- systems
def build(system: str, base: nn.Module, make_optimizer, rank: int, start: int,
          alone: dist.ProcessGroup | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``system`` on a copy of ``base``. System names: ``compute only``, ``DDP``, ``DDP, powerSGD_hook[ rank R]``,
    ``commsched``, ``commsched, PowerSGD[ rank R]``, ``commsched, bf16 on the wire``, and `ARITHMETIC` (on
    ``alone``, a group of this rank only)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    import commsched

    model = copy.deepcopy(base)
    approximation_rank = int(system.rsplit(" rank ", 1)[1]) if " rank " in system else rank
    if system == COMPUTE:
        return model, make_optimizer(model)
    if system == ARITHMETIC:
        model = DistributedDataParallel(model, bucket_cap_mb=ONE_BUCKET_MB, process_group=alone)
        model.register_comm_hook(powerSGD_hook.PowerSGDState(
            alone, matrix_approximation_rank=approximation_rank, start_powerSGD_iter=start),
            powerSGD_hook.powerSGD_hook)
        return model, make_optimizer(model)
    if system.startswith("DDP"):
        hooked = "powerSGD_hook" in system
        model = DistributedDataParallel(model, bucket_cap_mb=ONE_BUCKET_MB if hooked else None)
        if hooked:
            model.register_comm_hook(powerSGD_hook.PowerSGDState(
                None, matrix_approximation_rank=approximation_rank, start_powerSGD_iter=start),
                powerSGD_hook.powerSGD_hook)
        return model, make_optimizer(model)
    compression = None
    if "PowerSGD" in system:
        compression = commsched.PowerSGD(matrix_approximation_rank=approximation_rank, start_powerSGD_iter=start)
    reduce_dtype = torch.bfloat16 if "bf16" in system else None
    return commsched.prepare(model, make_optimizer(model),
                             commsched.Strategy(compression=compression, reduce_dtype=reduce_dtype))


def compressed_sizes(model: nn.Module, approximation_rank: int) -> tuple[int, int]:
    """The elements of the whole model's two compressed all-reduces: the rest and the ``P``, then the ``Q``."""
    first = second = 0
    for p in model.parameters():
        rows = p.shape[0] if p.dim() else 1
        columns = p.numel() // max(rows, 1)
        rank = min(rows, columns, approximation_rank)
        if p.dim() >= 1 and (rows + columns) * rank * 2 < rows * columns:
            first, second = first + rows * rank, second + columns * rank
        else:
            first += p.numel()
    return first, second


# ---------------------------------------------------------------------------- equality
def equality_on_rank(rank: int, world_size: int, model_name: str, steps: int) -> dict | None:
    """Per optimizer and rank of the approximation: DDP's and commsched's parameters after ``steps``."""
    t = task(model_name)
    torch.manual_seed(0)
    base = t.build()
    batch = BATCH[model_name]
    mine = slice(rank * batch, (rank + 1) * batch)
    optimizers = {"sgd_momentum": t.optimizer,
                  "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)}
    results = {}
    for optimizer_name, make_optimizer in optimizers.items():
        for approximation_rank in (1, 4):
            finals = {}
            for system in ("DDP, powerSGD_hook", "commsched, PowerSGD, one bucket"):
                model, optimizer = _equality_system(system, base, make_optimizer, approximation_rank)
                stream = t.batches(batch * world_size, 1)
                for _ in range(steps):
                    x, y = next(stream)
                    t.loss(model, x[mine], y[mine]).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                finals[system] = flat_parameters(model)
                release(model)
            ddp, ours = finals.values()
            moved = (ddp - flat_parameters(base)).abs().max()
            results[f"{optimizer_name}, rank {approximation_rank}"] = float((ours - ddp).abs().max() / moved)
    return results if rank == 0 else None


def _equality_system(system: str, base: nn.Module, make_optimizer, approximation_rank: int):
    import commsched

    if system.startswith("DDP"):
        return build(f"DDP, powerSGD_hook rank {approximation_rank}", base, make_optimizer, approximation_rank, 3)
    model = copy.deepcopy(base)
    strategy = commsched.Strategy(
        compression=commsched.PowerSGD(matrix_approximation_rank=approximation_rank, start_powerSGD_iter=3),
        bucket_cap_mb=ONE_BUCKET_MB, first_bucket_mb=ONE_BUCKET_MB, partition_mb=None, adaptive=False)
    return commsched.prepare(model, make_optimizer(model), strategy)


# ---------------------------------------------------------------------------- speed
def speed_worker(spec_path: Path, out_path: Path) -> None:
    """One host of the emulated cluster: every system side by side in interleaved rounds."""
    spec = json.loads(spec_path.read_text())
    host = Host.join(spec["model"], spec["batch"])
    t, base, mine, rank = host.task, host.base, host.mine, host.rank
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    runs = []
    for system in spec["systems"]:
        model, optimizer = build(system, base, host.task.optimizer, spec["rank"], start=2, alone=alone)
        runs.append((system, model, optimizer, host.stream()))

    warmups = {system: SETTLED_AFTER if system.startswith("commsched") else spec["warmup"]
               for system in spec["systems"]}
    times = interleaved_rounds(runs, t, mine, warmups, spec["rounds"], spec["iterations"])
    times["compressed all-reduces alone"] = _compressed_all_reduces_alone(base, spec["rank"], spec["iterations"])
    for _, model, *_ in runs:
        release(model)
    if rank == 0:
        out_path.write_text(json.dumps(times))
    dist.destroy_process_group()


def _compressed_all_reduces_alone(model: nn.Module, approximation_rank: int, count: int) -> list[float]:
    """What the whole model's two compressed all-reduces take, one after the other, nothing beside them."""
    first, second = (torch.zeros(n) for n in compressed_sizes(model, approximation_rank))
    took = []
    for _ in range(count + 1):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(first)
        dist.all_reduce(second)
        took.append(time.perf_counter() - started)
    return took[1:]


def speed_rows(cells: list[dict]) -> list[str]:
    """Per cell: medians over repeats, and per repeat the ratios (their medians). The bound is
    max(compute alone, compressed all-reduces alone); where the run timed `ARITHMETIC`, the bound
    with the compression's arithmetic is max(that, compressed all-reduces alone)."""
    with_arithmetic = all(ARITHMETIC in times for cell in cells for times in cell["repeats"])
    rows = ["| model | hosts | link | compute alone (ms) | "
            + ("compute + compression arithmetic (ms) | " if with_arithmetic else "")
            + "compressed all-reduces alone (ms) | DDP + hook (ms) | commsched (ms) | commsched vs DDP + hook | "
            "commsched / bound |" + (" DDP + hook / bound with arithmetic | commsched / bound with arithmetic |"
                                     if with_arithmetic else ""),
            "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if with_arithmetic else "")]
    for cell in cells:
        repeats = [Repeat.of(times) for times in cell["repeats"]]
        compute, alone = median_s(repeats, COMPUTE), median_s(repeats, "compressed all-reduces alone")
        speedup = statistics.median(1 / r for r in ratios(repeats, COMMSCHED, DDP_HOOK))

        def over(system: str, floor: str) -> float:
            return statistics.median(r.medians_s[system] / max(r.medians_s[floor],
                                                               r.medians_s["compressed all-reduces alone"])
                                     for r in repeats)

        arithmetic = f"{median_s(repeats, ARITHMETIC) * 1e3:.0f} | " if with_arithmetic else ""
        tail = (f" {over(DDP_HOOK, ARITHMETIC):.2f} | {over(COMMSCHED, ARITHMETIC):.2f} |"
                if with_arithmetic else "")
        rows.append(f"| {cell['model']} | {cell['hosts']} | {cell['rate_gbit']:g} Gbit/s | {compute * 1e3:.0f} | "
                    f"{arithmetic}{alone * 1e3:.0f} | {median_s(repeats, DDP_HOOK) * 1e3:.0f} | "
                    f"{median_s(repeats, COMMSCHED) * 1e3:.0f} | {speedup:.2f}x | {over(COMMSCHED, COMPUTE):.2f} |"
                    f"{tail}")
    return rows


# ---------------------------------------------------------------------- convergence
CONVERGENCE_SYSTEMS = ("commsched", "commsched, PowerSGD rank 1", "commsched, PowerSGD rank 4",
                       "commsched, bf16 on the wire", "DDP, powerSGD_hook rank 1")


def convergence_on_rank(rank: int, world_size: int, models: list[str], steps: int) -> dict | None:
    """Per model and system: the loss of every step (mean over ranks)."""
    results: dict = {}
    for name in models:
        t = task(name)
        torch.manual_seed(0)
        base = t.build()
        batch = BATCH[name]
        mine = slice(rank * batch, (rank + 1) * batch)
        results[name] = {}
        for system in CONVERGENCE_SYSTEMS:
            model, optimizer = build(system, base, t.optimizer, 1, start=10)
            stream = t.batches(batch * world_size, 1)
            losses = torch.zeros(steps, dtype=torch.float64)
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
            release(model)
            if rank == 0:
                results[name][system] = losses.tolist()
                print(f"{name}, {system}: last loss {losses[-1]:.4f}", flush=True)
    return results if rank == 0 else None


def convergence_rows(results: dict) -> list[str]:
    rows = ["| model | system | loss, last tenth | / uncompressed |", "|---|---|---|---|"]
    for name, systems in results.items():
        tail = max(1, len(systems["commsched"]) // 10)
        base = statistics.fmean(systems["commsched"][-tail:])
        for system, losses in systems.items():
            last = statistics.fmean(losses[-tail:])
            rows.append(f"| {name} | {system} | {last:.4f} | {last / base:.3f} |")
    return rows


# ----------------------------------------------------------------------------- main
def report(out: dict) -> list[str]:
    if out["part"] == "equality":
        rows = ["| model | ranks | optimizer, rank of the approximation | largest difference / largest move |",
                "|---|---|---|---|"]
        for world_size, per_setting in out["results"].items():
            rows += [f"| {out['model']} | {world_size} | {setting} | {value:.1e} |"
                     for setting, value in per_setting.items()]
        return rows
    if out["part"] == "convergence":
        return convergence_rows(out["results"])
    return speed_rows(out["results"])


def main(argv: list[str] | None = None) -> int:
    parser = runner.make_parser(__doc__, summary_only=True)
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("part", nargs="?", choices=("equality", "speed", "convergence"))
    parser.add_argument("--models", nargs="+", help="equality: mlp; speed: the bench models; convergence: gpt "
                        "and resnet-like")
    runner.add_hosts(parser, default=[2, 4], help="speed only")
    runner.add_rates_gbit(parser, default=[0.1, 0.25], help="speed only")
    parser.add_argument("--rank", type=int, default=1, help="speed: the approximation's rank (default 1)")
    parser.add_argument("--steps", type=int, help="equality: 50; convergence: 300")
    runner.add_repeats(parser, default=3, help="speed: fresh clusters per cell")
    parser.add_argument("--rounds", type=int, default=3, help="speed only")
    parser.add_argument("--iterations", type=int, default=4, help="speed: measured per system per round")
    parser.add_argument("--warmup", type=int, default=4, help="speed: unmeasured iterations of DDP and of "
                        "compute alone (commsched's: until its layout is settled)")
    runner.add_timeout(parser, default=3600.0)
    runner.add_json(parser, help="write the run here")
    parser.add_argument("--plot", type=Path, help="convergence: the loss curves (also with --report)")
    parser.add_argument("--report", type=Path, metavar="JSON", help="print the tables of a run saved with --json")
    args = parser.parse_args(argv)
    if args.worker:
        speed_worker(*args.worker)
        return 0
    runner.refuse_below_one(parser, args, "repeats", "rounds", "iterations", "steps", "rank")
    if args.report:
        saved = json.loads(args.report.read_text())
        saved["results"] = saved.pop("rows")
        print("\n".join(report(saved)))
        if args.plot and saved["part"] == "convergence":
            plot_losses(saved["results"], args.plot)
        return 0
    if args.part is None:
        parser.error("name a part (equality, speed or convergence), or --report a saved run")
    from commsched.testing import run_ranks

    out: dict = {"part": args.part}
    if args.part == "equality":
        out["model"], steps = (args.models or ["mlp"])[0], args.steps or 50
        out["results"] = {world_size: run_ranks(equality_on_rank, world_size, out["model"], steps,
                                                timeout_s=args.timeout_s)[0] for world_size in (2, 3)}
    elif args.part == "convergence":
        out["results"] = run_ranks(convergence_on_rank, 2, args.models or ["gpt", "resnet-like"],
                                   args.steps or 300, timeout_s=args.timeout_s)[0]
        if args.plot:
            plot_losses(out["results"], args.plot)
    else:
        settings = {"systems": list(SPEED_SYSTEMS), "rounds": args.rounds, "iterations": args.iterations,
                    "warmup": args.warmup, "rank": args.rank}
        out["results"], port = [], 29811
        for hosts in args.hosts:
            for model in args.models or list(BENCH_MODELS):
                for rate in args.rates_gbit:
                    cell = {"model": model, "hosts": hosts, "rate_gbit": rate, "repeats": []}
                    for repeat in range(args.repeats):
                        started = time.monotonic()
                        times = runner.on_emulated_hosts(
                            __file__, hosts, rate, {"model": model, "batch": BATCH[model], **settings},
                            args.timeout_s, f"{model} on {hosts} hosts at {rate:g} Gbit/s", port=port)
                        port += 1
                        cell["repeats"].append(times)
                        print(f"{model}, {hosts} hosts at {rate:g} Gbit/s, repeat {repeat + 1}: " + ", ".join(
                            f"{n} {statistics.median(v) * 1e3:.0f} ms" for n, v in times.items())
                            + f" [{time.monotonic() - started:.0f} s]", flush=True)
                    out["results"].append(cell)
    print("\n".join(report(out)))
    runner.write_json(args.json, out["results"], **{k: v for k, v in out.items() if k != "results"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

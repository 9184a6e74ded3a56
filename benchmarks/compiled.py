"""Compiled models under commsched and torch DDP: does compiling keep its speed, and commsched its lead?

    .venv/bin/python benchmarks/compiled.py --json results/compiled.json
    sudo .venv/bin/python benchmarks/compiled.py --rates-gbit 0.25 1 --json results/compiled_emulated.json

On 2 ranks (``--hosts``), for each model (``--models``: nanoGPT's model at 4 layers of width 192,
the ResNet-like, the ViT-like), six systems train side by side in interleaved rounds from the same weights on
the same batches: torch DDP and commsched on the model as it is, and on the model compiled the
way nanoGPT does it (``torch.compile(model)`` before wrapping or ``prepare()``; inductor by
default, ``--backend``), and the model alone, eager and compiled, each rank on its own (the
computation the bound counts). Then every gradient byte is all-reduced alone, in one collective. Without ``--rates-gbit`` the ranks are local processes on loopback; with
it, emulated hosts whose links run at each rate (root). Each system trains its warm-up unmeasured
(compiling included; commsched until its layout is settled), then ``--rounds`` rounds of
``--iterations`` measured iterations. ``--repeats`` fresh process groups per cell.

Reported per cell: each system's median iteration on rank 0 (median over repeats), commsched over
DDP compiled and eager (above 1: commsched is faster), how many graphs each compiled system's
rank 0 compiled (dynamo's; commsched cuts each into pieces at its buckets, listed per graph), and
whether any function reached dynamo's recompile limit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import commsched
from commsched.bench import runner
from commsched.bench.compare import SETTLED_AFTER
from commsched.bench.repeats import Repeat, median_s, ratios
from commsched.bench.tasks import BATCH, Host, interleaved_rounds, release

MODELS = ("nanogpt", "resnet-like", "vit-like")
DDP_EAGER, CS_EAGER, DDP_COMPILED, CS_COMPILED = "DDP", "commsched", "DDP, compiled", "commsched, compiled"
COMPUTE, COMPUTE_COMPILED = "compute alone", "compute alone, compiled"
"""The model trained on its own, nothing on the wire: what the bound counts of the computation."""
SYSTEMS = (DDP_EAGER, CS_EAGER, DDP_COMPILED, CS_COMPILED, COMPUTE, COMPUTE_COMPILED)
ALL_REDUCE = "all-reduce alone"
"""Every gradient byte in one all-reduce, nothing beside it: what the bound counts of the wire."""


def build(system: str, base: nn.Module, make_optimizer, backend: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``system`` on a copy of ``base``, compiled first where its name says so (nanoGPT's order)."""
    import copy

    model = copy.deepcopy(base)
    optimizer = make_optimizer(model)
    if system.endswith("compiled"):
        model = torch.compile(model, backend=backend)
    if system.startswith("compute"):
        return model, optimizer
    if system.startswith("DDP"):
        return nn.parallel.DistributedDataParallel(model), optimizer
    return commsched.prepare(model, optimizer)


def worker(spec_path: Path, out_path: Path) -> None:
    """One rank: every system side by side in interleaved rounds."""
    from torch._dynamo.utils import counters

    spec = json.loads(spec_path.read_text())
    host = Host.join(spec["model"], spec["batch"])
    runs, graphs = [], {}
    for system in SYSTEMS:
        model, optimizer = build(system, host.base, host.task.optimizer, spec["backend"])
        runs.append((system, model, optimizer, host.stream()))
    warmups = {system: SETTLED_AFTER if system.startswith("commsched") else spec["warmup"] for system in SYSTEMS}
    for name, model, optimizer, stream in runs:  # each compiled system's graphs, counted alone
        before = counters["stats"]["unique_graphs"]
        interleaved_rounds([(name, model, optimizer, stream)], host.task, host.mine, warmups, 0, 0)
        graphs[name] = counters["stats"]["unique_graphs"] - before
        warmups[name] = 0
    times = interleaved_rounds(runs, host.task, host.mine, warmups, spec["rounds"], spec["iterations"])
    times[ALL_REDUCE] = _all_reduce_alone(host.base, spec["rounds"] * spec["iterations"])
    pieces = commsched.status(next(model for name, model, *_ in runs if name == CS_COMPILED)).compiled_pieces
    limits = sum(n for reason, n in counters["frames"].items() if "limit" in reason)
    for _, model, *_ in runs:
        release(model)
    if host.rank == 0:
        out_path.write_text(json.dumps({"times": times, "graphs": graphs, "pieces": list(pieces),
                                        "recompile_limit_hits": limits}))
    dist.destroy_process_group()


def _all_reduce_alone(model: nn.Module, count: int) -> list[float]:
    """What all-reducing every gradient byte takes, in one collective, nothing beside it."""
    flat = torch.zeros(sum(p.numel() for p in model.parameters() if p.requires_grad))
    took = []
    for _ in range(count + 1):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(flat)
        took.append(time.perf_counter() - started)
    return took[1:]


def on_loopback(spec: dict, hosts: int, timeout_s: float, port: int) -> dict:
    """The worker on ``hosts`` local processes (torchrun, loopback)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={hosts}",
                        f"--master_port={port}", __file__, "--worker", str(spec_path), str(out_path)],
                       check=True, timeout=timeout_s, env=env, stdout=subprocess.DEVNULL)
        return json.loads(out_path.read_text())


def rows(cells: list[dict]) -> list[str]:
    """Per cell: medians over repeats, per repeat the ratios (their medians), and commsched's time over
    the bound max(compute alone, all-reduce alone), eager and compiled (each with its own computation)."""
    table = ["| model | link | " + " | ".join(f"{s} (ms)" for s in (*SYSTEMS, ALL_REDUCE))
             + " | commsched compiled vs DDP compiled | commsched eager vs DDP eager | commsched / bound (eager, "
             "compiled) | graphs (DDP, commsched) | commsched's pieces | recompile limit hit |",
             "|---|---|" + "---|" * (len(SYSTEMS) + 7)]
    for cell in cells:
        repeats = [Repeat.of(r["times"]) for r in cell["repeats"]]
        wire = median_s(repeats, ALL_REDUCE)
        over = [median_s(repeats, system) / max(median_s(repeats, compute), wire)
                for system, compute in ((CS_EAGER, COMPUTE), (CS_COMPILED, COMPUTE_COMPILED))]
        compiled = statistics.median(1 / r for r in ratios(repeats, CS_COMPILED, DDP_COMPILED))
        eager = statistics.median(1 / r for r in ratios(repeats, CS_EAGER, DDP_EAGER))
        graphs = ", ".join(str(cell["repeats"][0]["graphs"][s]) for s in (DDP_COMPILED, CS_COMPILED))
        hits = sum(r["recompile_limit_hits"] for r in cell["repeats"])
        pieces = "+".join(str(n) for n in cell["repeats"][0].get("pieces", [])) or "-"
        table.append(f"| {cell['model']} | {cell['link']} | "
                     + " | ".join(f"{median_s(repeats, s) * 1e3:.0f}" for s in (*SYSTEMS, ALL_REDUCE))
                     + f" | {compiled:.2f}x | {eager:.2f}x | {over[0]:.2f}, {over[1]:.2f} | {graphs} | {pieces} "
                     f"| {hits} |")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = runner.make_parser(__doc__, summary_only=True)
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--hosts", type=int, default=2, help="ranks (default 2)")
    runner.add_rates_gbit(parser, default=None, help="emulated hosts at these link rates (root); loopback without")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (default inductor)")
    runner.add_repeats(parser, default=3, help="fresh process groups per cell")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=5, help="measured per system per round")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured iterations of DDP (commsched's: until "
                        "its layout is settled), compiling included")
    runner.add_timeout(parser, default=1800.0)
    runner.add_json(parser, help="write the run here")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    runner.refuse_below_one(parser, args, "repeats", "rounds", "iterations", "hosts")
    if args.rates_gbit and (problem := runner.cluster_problem("compiled.py")) is not None:
        return problem
    cells, port = [], 29871
    for model in args.models:
        for rate in args.rates_gbit or [None]:
            link = "loopback" if rate is None else f"{rate:g} Gbit/s"
            cell = {"model": model, "link": link, "repeats": []}
            spec = {"model": model, "batch": BATCH[model], "backend": args.backend, "rounds": args.rounds,
                    "iterations": args.iterations, "warmup": args.warmup}
            for repeat in range(args.repeats):
                started = time.monotonic()
                if rate is None:
                    result = on_loopback(spec, args.hosts, args.timeout_s, port)
                else:
                    result = runner.on_emulated_hosts(__file__, args.hosts, rate, spec, args.timeout_s,
                                                      f"{model} on {args.hosts} hosts at {link}", port=port)
                port += 1
                cell["repeats"].append(result)
                print(f"{model}, {link}, repeat {repeat + 1}: " + ", ".join(
                    f"{n} {statistics.median(v) * 1e3:.0f} ms" for n, v in result["times"].items())
                    + f"; graphs {result['graphs']}, pieces {result['pieces']} [{time.monotonic() - started:.0f} s]",
                    flush=True)
            cells.append(cell)
    print("\n".join(rows(cells)))
    runner.write_json(args.json, cells, hosts=args.hosts, backend=args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())

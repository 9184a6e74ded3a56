"""What commsched costs on one GPU: torchvision ResNet-50 and ViT-B/16 at world 1 on NCCL.

    python benchmarks/gpu_world1.py --json results/gpu_world1.json          # a CUDA GPU, about 4 minutes
    python benchmarks/gpu_world1.py --profile results/gpu_timeline.json     # adds a torch.profiler timeline

One rank has nothing to communicate, so this measures the wrapper's own cost
on the hot path (hooks, bookkeeping, per-bucket updates, forward gates) against
the same model trained without a wrapper (with torch's default optimizer kernels,
and with its fused ones) and with torch DDP. Every system
trains its own copy of the model on the same synthetic batch with bf16
autocast; systems take turns in interleaved rounds (the order rotates), each
round one unmeasured iteration and then ``--iterations`` timed ones between
two ``torch.cuda.synchronize()`` (so a host that waits on the GPU each
iteration shows, and one that runs ahead does not hide GPU work). Reported: the
median over rounds of each system's time per iteration, its ratio to no wrapper
and to DDP, and its peak CUDA memory, measured in a fresh process of its own
(``torch.cuda.max_memory_allocated`` over warm-up and five iterations).

``--profile`` records a few iterations of commsched's default with
torch.profiler and writes a compact timeline (per iteration, when the CPU
launched it and when the GPU ran it; every host-blocking CUDA call), which
``benchmarks/gpu_timeline_figure.py`` draws. ``--host-profile`` runs each
system under cProfile (first model) and writes the functions that took the
host's time, with each system's host time per iteration beside its time with
the GPU waited for: where the two are equal the host sets the pace.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commsched
from commsched.bench import runner
from commsched.strategy import AllReduce, Strategy

MODELS = {
    # name: (torchvision constructor, batch size, optimizer)
    "resnet50": ("resnet50", 64, "sgd"),
    "vit_b_16": ("vit_b_16", 32, "adamw"),
}
SYSTEMS = {
    "no wrapper": None,
    "no wrapper, fused optimizer": "fused",
    "DDP": "ddp",
    "commsched": Strategy(),
    "commsched, forced schedule": Strategy(backend=AllReduce(schedule_one_rank=True)),
    "commsched, overlap off": Strategy(overlap_forward=False),
    "commsched, priority off": Strategy(priority=False),
    "commsched, unfused": Strategy(overlap_forward=False, fuse_optimizer=False),
    "commsched, scheduling off": Strategy(
        priority=False, partition_mb=None, credit_mb=None, overlap_forward=False, fuse_optimizer=False),
}
HOST_BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls that make the host wait for the GPU (``cudaMemcpy`` without ``Async``)."""


def build_model(name: str) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, MODELS[name][0])(num_classes=1000).cuda()


def make_optimizer(name: str, model: torch.nn.Module, fused: bool | None = None) -> torch.optim.Optimizer:
    """torch's default kernels (foreach on CUDA), or its fused ones with ``fused=True``."""
    if MODELS[name][2] == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4, fused=fused)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=fused)


@dataclass
class Trained:
    """One system's model and optimizer, and its step."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def drain(self) -> None:
        """Finish what the system still has in flight (commsched's deferred updates)."""
        synchronize = getattr(self.optimizer, "synchronize", None)
        if synchronize is not None:
            synchronize()
        torch.cuda.synchronize()


def build_system(system: str, model_name: str, base: torch.nn.Module) -> Trained:
    model = copy.deepcopy(base)
    choice = SYSTEMS[system]
    if choice == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
        return Trained(system, model, make_optimizer(model_name, model))
    optimizer = make_optimizer(model_name, model, fused=True if choice == "fused" else None)
    if isinstance(choice, Strategy):
        model, optimizer = commsched.prepare(model, optimizer, choice)
    return Trained(system, model, optimizer)


def batch(model_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(1)
    size = MODELS[model_name][1]
    x = torch.randn(size, 3, 224, 224, device="cuda", generator=generator)
    y = torch.randint(0, 1000, (size,), device="cuda", generator=generator)
    return x, y


def init_group() -> None:
    torch.cuda.set_device(0)
    with tempfile.NamedTemporaryFile(delete=False) as store:
        path = store.name
    os.unlink(path)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))


def time_rounds(model_name: str, systems: list[str], rounds: int, iterations: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per iteration, per round, by system (interleaved; the order rotates each round)."""
    base = build_model(model_name)
    x, y = batch(model_name)
    trained = [build_system(name, model_name, base) for name in systems]
    for run in trained:
        for _ in range(warmup):
            run.step(x, y)
        run.drain()
    times: dict[str, list[float]] = {run.name: [] for run in trained}
    for r in range(rounds):
        order = trained[r % len(trained):] + trained[: r % len(trained)]
        for run in order:
            run.step(x, y)  # lead-in: the first timed iteration pays for its predecessor, as in a long run
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(iterations):
                run.step(x, y)
            torch.cuda.synchronize()
            times[run.name].append((time.perf_counter() - started) / iterations)
            run.drain()
    return times


def peak_memory(model_name: str, system: str, iterations: int = 5, warmup: int = 5) -> int:
    """Peak CUDA memory (bytes) of ``system`` alone in this process, from its model's creation on."""
    torch.cuda.reset_peak_memory_stats()
    base_bytes = torch.cuda.memory_allocated()
    base = build_model(model_name)
    x, y = batch(model_name)
    run = build_system(system, model_name, base)
    del base
    for _ in range(warmup + iterations):
        run.step(x, y)
    run.drain()
    return torch.cuda.max_memory_allocated() - base_bytes


def peak_memory_in_child(model_name: str, system: str) -> int:
    """`peak_memory` in a fresh process, so no other system's memory or caches count."""
    out = subprocess.run([sys.executable, __file__, "--peak-memory-of", system, "--models", model_name],
                         check=True, capture_output=True, text=True, timeout=600)
    return int(out.stdout.strip().splitlines()[-1])


def profile_timeline(model_name: str, iterations: int = 6, system: str = "commsched") -> dict:
    """``system`` for ``iterations`` iterations under torch.profiler, as a compact timeline."""
    from torch.profiler import ProfilerActivity, profile, record_function

    base = build_model(model_name)
    x, y = batch(model_name)
    run = build_system(system, model_name, base)
    for _ in range(8):
        run.step(x, y)
    run.drain()
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = os.path.join(tmp, "trace.json")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(iterations):
                with record_function(f"iteration {i}"):
                    run.step(x, y)
            torch.cuda.synchronize()
        prof.export_chrome_trace(trace_path)
        with open(trace_path) as f:
            events = json.load(f)["traceEvents"]
    return timeline_of(events, iterations)


def timeline_of(events: list[dict], iterations: int) -> dict:
    """Per iteration: the CPU's span and the GPU's (kernels launched inside it); host-blocking calls."""
    spans = {e["name"]: e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("iteration ")}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    origin = min(float(e["ts"]) for e in spans.values())
    rows = []
    for i in range(iterations):
        span = spans[f"iteration {i}"]
        start, end = float(span["ts"]), float(span["ts"]) + float(span["dur"])
        mine = [k for k in kernels
                if (launch := launches.get(k["args"].get("correlation"))) is not None
                and start <= float(launch["ts"]) <= end]
        gpu_start = min(float(k["ts"]) for k in mine)
        gpu_end = max(float(k["ts"]) + float(k["dur"]) for k in mine)
        rows.append({"iteration": i, "cpu_start_ms": (start - origin) / 1e3, "cpu_end_ms": (end - origin) / 1e3,
                     "gpu_start_ms": (gpu_start - origin) / 1e3, "gpu_end_ms": (gpu_end - origin) / 1e3,
                     "kernels": len(mine)})
    blocking = [{"name": e["name"], "at_ms": (float(e["ts"]) - origin) / 1e3, "dur_ms": float(e["dur"]) / 1e3}
                for e in events if e.get("cat") == "cuda_runtime" and e["name"] in HOST_BLOCKING
                and float(e["ts"]) >= origin]
    queries = sum(1 for e in events if e.get("cat") == "cuda_runtime" and e["name"] == "cudaEventQuery"
                  and float(e["ts"]) >= origin)
    ahead = sum(1 for before, after in zip(rows, rows[1:]) if after["cpu_start_ms"] < before["gpu_end_ms"])
    return {"iterations": rows, "host_blocking_calls": blocking, "event_queries_per_iteration": queries / iterations,
            "host_ahead": ahead}


def host_profile(model_name: str, systems: list[str], iterations: int = 20, top: int = 25) -> list[str]:
    """Per system: host ms per iteration (launching only) against GPU-waited ms, and cProfile's top functions."""
    import cProfile
    import io
    import pstats

    lines = []
    base = build_model(model_name)
    x, y = batch(model_name)
    for name in systems:
        run = build_system(name, model_name, base)
        for _ in range(30):  # past commsched's warm-up and its first choices, as the timed rounds are
            run.step(x, y)
        run.drain()
        started = time.perf_counter()
        for _ in range(iterations):
            run.step(x, y)
        launched = time.perf_counter() - started
        run.drain()
        waited = time.perf_counter() - started
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(iterations):
            run.step(x, y)
        run.drain()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
        lines += [f"=== {name} ({model_name}): host {launched / iterations * 1e3:.2f} ms/iter launching, "
                  f"{waited / iterations * 1e3:.2f} ms/iter with the GPU waited for", text.getvalue()]
        del run
    return lines


def report(model_name: str, times: dict[str, list[float]], memory: dict[str, int]) -> list[str]:
    median = {name: statistics.median(t) for name, t in times.items()}
    lines = [f"{model_name} (batch {MODELS[model_name][1]}, bf16 autocast, {MODELS[model_name][2]}), "
             f"medians of {len(next(iter(times.values())))} rounds",
             f"{'system':28} {'ms/iter':>8} {'vs none':>8} {'vs DDP':>7} {'peak MiB':>9}"]
    for name, seconds in median.items():
        vs_none = seconds / median["no wrapper"] if "no wrapper" in median else float("nan")
        vs_ddp = seconds / median["DDP"] if "DDP" in median else float("nan")
        mib = f"{memory[name] / 2**20:9.0f}" if name in memory else f"{'-':>9}"
        lines.append(f"{name:28} {seconds * 1e3:8.2f} {vs_none:8.3f} {vs_ddp:7.3f} {mib}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = runner.make_parser(__doc__, summary_only=True)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=8, help="per system, before the first round")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    runner.add_json(parser, help="write every round's times and the peaks here")
    parser.add_argument("--profile", type=Path, help="write commsched's profiled timeline (first model) here")
    parser.add_argument("--host-profile", help="write each system's cProfile (first model) here")
    parser.add_argument("--peak-memory-of", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    init_group()
    if args.peak_memory_of:
        print(peak_memory(args.models[0], args.peak_memory_of))
        dist.destroy_process_group()
        return
    results: dict[str, dict] = {}
    for model_name in args.models:
        times = time_rounds(model_name, args.systems, args.rounds, args.iterations, args.warmup)
        memory = {} if args.no_memory else {name: peak_memory_in_child(model_name, name) for name in args.systems}
        results[model_name] = {"seconds_per_iteration": times, "peak_bytes": memory}
        print("\n".join(report(model_name, times, memory)), "\n", flush=True)
    if args.profile:
        timelines = {}
        for system in [name for name in ("commsched", "commsched, forced schedule") if name in args.systems]:
            timeline = timelines[system] = profile_timeline(args.models[0], system=system)
            blocking = timeline["host_blocking_calls"]
            print(f"profiled {len(timeline['iterations'])} iterations of {system} ({args.models[0]}): "
                  f"{len(blocking)} host-blocking CUDA calls", [b["name"] for b in blocking][:20],
                  f"{timeline['event_queries_per_iteration']:.1f} cudaEventQuery per iteration; the host started "
                  f"{timeline['host_ahead']} of {len(timeline['iterations']) - 1} iterations before the GPU ended "
                  "the one before")
            for row in timeline["iterations"]:
                print(f"  iteration {row['iteration']}: CPU {row['cpu_start_ms']:.1f}-{row['cpu_end_ms']:.1f} ms, "
                      f"GPU {row['gpu_start_ms']:.1f}-{row['gpu_end_ms']:.1f} ms, {row['kernels']} kernels")
        results["timeline"] = timelines
        runner.write_json(args.profile, timelines)
    if args.host_profile:
        lines = host_profile(args.models[0], args.systems, args.iterations)
        with open(args.host_profile, "w") as f:
            f.write("\n".join(lines))
        print("\n".join(line for line in lines if line.startswith("===")))
    runner.write_json(args.json, results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

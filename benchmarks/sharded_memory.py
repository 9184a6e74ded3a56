"""Peak memory per rank with sharded optimizer state, against the all-reduce backend and torch DDP.

    python benchmarks/sharded_memory.py --json results/sharded_memory.json                # a CUDA GPU, about a minute
    .venv/bin/python benchmarks/sharded_memory.py --device cpu --width 2048               # CPU, about a minute

Each system trains the same stack of large linear layers with Adam in fresh ranks
of its own. On CUDA: NCCL, one rank per GPU, where there are ``--world-size``
GPUs; else gloo with CUDA tensors, every rank on the one GPU (then the times say
nothing about a real network, only the memory counts). On the CPU: gloo on
loopback. Reported per system, as the max over ranks: the peak memory over
warm-up and the measured iterations (``torch.cuda.max_memory_allocated``; on the
CPU the process's peak RSS, with glibc's mmap threshold fixed as in
``commsched bench``, so that it counts what was alive at once), the optimizer
state the rank holds (Adam's two moments and step counts), and the median
iteration. With ``AllReduce(shard_optimizer=True)`` each
rank keeps the state of its own 1/N of every bucket, so the peak should fall by
about (N-1)/N of the unsharded state, less the one bucket it gathers at a time.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import commsched
from commsched.bench import runner
from commsched.bench.memory import fix_mmap_threshold, own_peak_rss_mib
from commsched.strategy import AllReduce, Strategy
from commsched.testing import run_ranks

SYSTEMS = {
    "torch DDP": None,
    "commsched AllReduce()": Strategy(),
    "commsched AllReduce(shard_optimizer=True)": Strategy(backend=AllReduce(shard_optimizer=True)),
}


def build_model(width: int, layers: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks).to(device)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_mib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else own_peak_rss_mib()


def state_bytes(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> int:
    """This rank's bytes of optimizer state, as commsched reports it where sharded."""
    if isinstance(model, commsched.CommschedModule):
        sharding = commsched.status(model).sharding
        if sharding is not None:
            return sharding.state_bytes
    return sum(value.numel() * value.element_size()
               for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value))


def train_one_system(rank: int, world_size: int, device: str, system: str, width: int, layers: int, batch: int,
                     warmup: int, iterations: int) -> dict:
    if device == "cpu":
        fix_mmap_threshold()
    base = build_model(width, layers, device)
    strategy = SYSTEMS[system]
    if strategy is None:
        model = torch.nn.parallel.DistributedDataParallel(base)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        model, optimizer = commsched.prepare(base, torch.optim.Adam(base.parameters(), lr=1e-4), strategy=strategy)
    generator = torch.Generator(device=device).manual_seed(rank)
    inputs = torch.randn(batch, width, device=device, generator=generator)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for index in range(warmup + iterations):
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        model(inputs).square().mean().backward()
        optimizer.step()
        synchronize(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    result = {"peak_mib": peak_mib(device),
              "state_bytes": state_bytes(optimizer, model),
              "seconds_per_iteration": statistics.median(times)}
    if strategy is not None:
        commsched.release(model)
    dist.barrier()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = runner.make_parser(__doc__, summary_only=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--warmup", type=int, default=12, help="commsched plans at the end of warm-up")
    parser.add_argument("--iterations", type=int, default=6)
    runner.add_json(parser, help="write every rank's figures here")
    args = parser.parse_args(argv)
    runner.refuse_below_one(parser, args, "world_size", "iterations")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU")
    backend = "nccl" if args.device == "cuda" and torch.cuda.device_count() >= args.world_size else "gloo"
    where = {"nccl": "", "gloo": " with CUDA tensors, all on one GPU" if args.device == "cuda" else " on loopback"}
    params = args.layers * (args.width * args.width + args.width)
    print(f"{args.layers} x Linear({args.width}, {args.width}): {params / 1e6:.0f}M parameters, "
          f"{params * 4 / 2**20:.0f} MiB fp32; Adam; {args.world_size} ranks on {backend}"
          + where[backend])
    results = {}
    for system in SYSTEMS:
        per_rank = run_ranks(train_one_system, args.world_size, args.device, system, args.width, args.layers,
                             args.batch, args.warmup, args.iterations, backend=backend, timeout_s=600)
        results[system] = per_rank
    peak = "peak MiB" if args.device == "cuda" else "peak RSS MiB"
    print(f"{'system':<44}{peak:>13}{'state MiB':>11}{'ms/iter':>9}")
    for system, per_rank in results.items():
        print(f"{system:<44}{max(r['peak_mib'] for r in per_rank):>13.0f}"
              f"{max(r['state_bytes'] for r in per_rank) / 2**20:>11.0f}"
              f"{1000 * max(r['seconds_per_iteration'] for r in per_rank):>9.1f}")
    runner.write_json(args.json, results, backend=backend)


if __name__ == "__main__":
    main()

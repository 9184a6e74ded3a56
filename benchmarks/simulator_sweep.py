"""How long the simulator takes to sweep strategies, and what it finds, on a ResNet-50-sized profile.

    .venv/bin/python benchmarks/simulator_sweep.py
    .venv/bin/python benchmarks/simulator_sweep.py --workers 2 64 1024 --gbit 25 --algorithm tree

The profile is synthetic (no model runs): ResNet-50's 161 parameter tensors
(25.6 M parameters, about 98 MiB of float32 gradients), each layer's forward
and backward time in proportion to its multiply-adds at 224x224, gradients
ready in reverse forward order. Per number of workers, ``--strategies``
Strategies spread evenly over `strategy_space` are simulated (4 iterations
each); printed: the sweep's wall time, the bound, torch DDP, commsched's
defaults and the best strategy found.
"""

from __future__ import annotations

import argparse
import time

from commsched.profiling.profile import ParameterProfile, Profile
from commsched.simulator import Cluster, DDPConfig, best_strategy, bound_s, simulate, strategy_space
from commsched.strategy import Strategy

STAGES = ((64, 3, 56), (128, 4, 28), (256, 6, 14), (512, 3, 7))
"""ResNet-50: per stage, the bottleneck width, the number of blocks and the output side in pixels."""


def resnet50_layers() -> list[tuple[str, int, float]]:
    """(name, parameters, multiply-adds) per parameter tensor, in forward order."""
    layers: list[tuple[str, int, float]] = []

    def conv(name: str, c_in: int, c_out: int, k: int, side: int) -> None:
        layers.append((f"{name}.weight", c_in * c_out * k * k, c_in * c_out * k * k * side * side))

    def bn(name: str, c: int, side: int) -> None:
        layers.append((f"{name}.weight", c, c * side * side))
        layers.append((f"{name}.bias", c, c * side * side))

    conv("conv1", 3, 64, 7, 112)
    bn("bn1", 64, 112)
    c_in = 64
    for stage, (width, blocks, side) in enumerate(STAGES, start=1):
        for block in range(blocks):
            name = f"layer{stage}.{block}"
            conv(f"{name}.conv1", c_in, width, 1, side)
            bn(f"{name}.bn1", width, side)
            conv(f"{name}.conv2", width, width, 3, side)
            bn(f"{name}.bn2", width, side)
            conv(f"{name}.conv3", width, 4 * width, 1, side)
            bn(f"{name}.bn3", 4 * width, side)
            if block == 0:
                conv(f"{name}.downsample.0", c_in, 4 * width, 1, side)
                bn(f"{name}.downsample.1", 4 * width, side)
            c_in = 4 * width
    layers.append(("fc.weight", 2048 * 1000, 2048 * 1000))
    layers.append(("fc.bias", 1000, 1000))
    return layers


def resnet50_profile(forward_s: float, backward_s: float, update_s: float) -> Profile:
    layers = resnet50_layers()
    work = sum(flops for _, _, flops in layers)
    params, done = [], 0.0
    for name, numel, flops in layers:
        params.append(ParameterProfile(name, numel, 4, forward_s * done / work, 0.0))
        done += flops
    ready, done = {}, 0.0
    for index in reversed(range(len(layers))):
        done += layers[index][2]
        ready[index] = backward_s * done / work
    params = [ParameterProfile(p.name, p.numel, 4, p.first_use_s, ready[i]) for i, p in enumerate(params)]
    return Profile("resnet50-synthetic", "synthetic", 32, forward_s, backward_s, update_s, tuple(params))


def spread(space: list[Strategy], count: int) -> list[Strategy]:
    if count >= len(space):
        return space
    return [space[round(i * (len(space) - 1) / (count - 1))] for i in range(count)] if count > 1 else space[:1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1024, 2])
    parser.add_argument("--gbit", type=float, default=10.0, help="each host's link rate (default 10)")
    parser.add_argument("--algorithm", choices=("ring", "tree"), default="ring")
    parser.add_argument("--strategies", type=int, default=100, help="how many of strategy_space (default 100)")
    parser.add_argument("--forward-ms", type=float, default=60.0)
    parser.add_argument("--backward-ms", type=float, default=120.0)
    parser.add_argument("--update-ms", type=float, default=10.0)
    args = parser.parse_args()

    profile = resnet50_profile(args.forward_ms / 1e3, args.backward_ms / 1e3, args.update_ms / 1e3)
    space = spread(strategy_space(), args.strategies)
    print(f"profile: {len(profile.parameters)} parameters, {profile.gradient_bytes / 2**20:.1f} MiB of gradients, "
          f"compute {(profile.forward_s + profile.backward_s + profile.update_s) * 1e3:.0f} ms; "
          f"{len(space)} of {len(strategy_space())} strategies")
    for workers in args.workers:
        cluster = Cluster(workers, args.gbit, algorithm=args.algorithm)
        started = time.perf_counter()
        chosen, result = best_strategy(profile, cluster, space)
        elapsed = time.perf_counter() - started
        ddp = simulate(profile, cluster, DDPConfig())
        default = simulate(profile, cluster, Strategy(adaptive=False))
        print(f"\n{cluster.describe()}: swept {len(space)} strategies in {elapsed:.2f} s "
              f"({elapsed / len(space) * 1e3:.1f} ms each); bound {bound_s(profile, cluster) * 1e3:.1f} ms")
        print(f"  DDP      {ddp.describe()}")
        print(f"  default  {default.describe()}")
        print(f"  best     {result.describe()}")
        print(f"           speedup over DDP {ddp.iteration_s / result.iteration_s:.2f}x")


if __name__ == "__main__":
    main()

"""How evenly the parameter-server sharding spreads the benchmark models over servers.

    .venv/bin/python benchmarks/ps_sharding.py --servers 1 2 3 4

For each model: its parameters laid out in buckets exactly as a worker lays
them out (forward order recorded on one batch, default Strategy), cut into
row-aligned blocks and placed largest first onto the least loaded server.
Reported: blocks, parameters that span several servers, and the bytes on the
most loaded server over the mean (1.00 is perfect balance). No process group
is needed: the plan is a pure function of the layout.
"""

from __future__ import annotations

import argparse

import torch

from commsched.bench.models import WORKLOADS
from commsched.layout.buckets import bucket_layout
from commsched.ps.sharding import plan_model_sharding
from commsched.strategy import ParameterServer, Strategy
from commsched.watch.first_forward import ForwardRecorder

MODELS = ("vgg-like", "resnet-like", "transformer-like")


def plan_for(model_name: str, servers: int, strategy: Strategy):
    workload = WORKLOADS[model_name]
    torch.manual_seed(0)
    model = workload.build()
    params = [p for p in model.parameters() if p.requires_grad]
    recorder = ForwardRecorder(model, params)
    inputs, _ = next(workload.batches(2))
    model(inputs)
    recorder.finish()
    slots, priorities = bucket_layout(params, recorder.parameter_order(params), strategy.bucket_size_limits_bytes)
    return plan_model_sharding(params, slots, priorities, strategy.ps_block_bytes, servers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--partition-mb", type=float, default=Strategy().partition_mb)
    args = parser.parse_args()
    strategy = Strategy(backend=ParameterServer(), partition_mb=args.partition_mb)
    print("| model | MB | servers | blocks | params spanning servers | most loaded / mean |")
    print("|---|---|---|---|---|---|")
    for name in MODELS:
        for servers in args.servers:
            plan = plan_for(name, servers, strategy)
            print(f"| {name} | {sum(plan.loads_bytes()) / 1e6:.1f} | {servers} | {len(plan.blocks)} "
                  f"| {plan.spanning_parameters()} | {plan.imbalance():.3f} |")


if __name__ == "__main__":
    main()

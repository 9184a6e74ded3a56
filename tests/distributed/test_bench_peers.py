"""The benchmark's peers train like torch DDP; a peer that cannot run a model is reported, not fatal.

One spawned group of two ranks runs every comparison; the tests read its results.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commsched.bench.compare import ComparisonConfig, SystemResult, compare_on_rank
from commsched.bench.contention import contention_on_rank
from commsched.bench.models import WORKLOADS, DemoNet, Workload
from commsched.bench.peers import build, fsdp2_units, sgd
from commsched.bench.server_link import server_link_on_rank
from commsched.bench.systems import UNSCHEDULED, Commsched, TorchDDP, TorchFSDP2
from commsched.strategy import Strategy
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

DDP = TorchDDP()
PEERS = (TorchDDP(static_graph=True, gradient_as_bucket_view=True),
         TorchDDP(0.05, static_graph=True, gradient_as_bucket_view=True), TorchFSDP2())
OURS = Commsched(Strategy())
OFF = Commsched(UNSCHEDULED, "scheduling off")


class TiedNet(nn.Module):
    """Two blocks sharing one weight: FSDP2 refuses to shard them apart."""

    def __init__(self) -> None:
        super().__init__()
        first, second = nn.Linear(8, 8), nn.Linear(8, 8)
        second.weight = first.weight
        self.layers = nn.Sequential(first, nn.ReLU(), second, nn.ReLU(), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


SLOW_S = 0.05
"""How much longer rank 1 computes than rank 0 in `SlowOnRankOne`."""


class SlowOnRankOne(nn.Module):
    """A model whose forward pass takes `SLOW_S` longer on rank 1: the other rank is the faster one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            time.sleep(SLOW_S)
        return self.linear(x)


def compare_everything(rank: int, world_size: int) -> dict[str, dict[str, SystemResult]] | None:
    """Every comparison the tests check, in one group of processes."""
    WORKLOADS["tied"] = Workload("tied", TiedNet, (8,))
    WORKLOADS["slow-on-rank-1"] = Workload("slow-on-rank-1", SlowOnRankOne, (8,))
    peers = ComparisonConfig(workload="demo-mlp", batch_size=8, iterations=2, rounds=2, warmup=4,
                             systems=(DDP, *PEERS, OURS, OFF), show_progress=False)
    refused = ComparisonConfig(workload="tied", batch_size=8, iterations=2, rounds=1, warmup=2,
                               systems=(DDP, TorchFSDP2()), show_progress=False)
    results = {"peers": compare_on_rank(rank, world_size, peers),
               "refused": compare_on_rank(rank, world_size, refused),
               "built": {system.name: what_was_built(system) for system in PEERS},
               "contention": contention_on_rank(rank, world_size, peers, pairs=3),
               "uneven_contention": contention_on_rank(
                   rank, world_size, ComparisonConfig(workload="slow-on-rank-1", batch_size=8, show_progress=False),
                   pairs=2),
               "server_link": server_link_on_rank(rank, world_size, ComparisonConfig(rounds=2, num_servers=1)),
               "no_server_link": server_link_on_rank(rank, world_size, peers)}
    return results if rank == 0 else None


def what_was_built(system) -> dict:
    """The settings torch reports for a peer as `build` makes it."""
    from torch.distributed.fsdp import FSDPModule

    model, optimizer = build(system, DemoNet(), dist.group.WORLD, sgd(0.1))
    sharded = sum(isinstance(module, FSDPModule) for module in model.modules())
    return {"static_graph": getattr(model, "static_graph", None),
            "gradient_as_bucket_view": getattr(model, "gradient_as_bucket_view", None),
            "bucket_bytes_cap": getattr(model, "bucket_bytes_cap", None), "sharded_modules": sharded,
            "optimizes_the_model": {id(p) for p in model.parameters()}
            == {id(p) for group in optimizer.param_groups for p in group["params"]}}


in_the_comparison = in_shared_ranks(compare_everything, 2, timeout_s=120)
"""The tests that read `compare_everything`'s results: it runs once for them all."""


@pytest.fixture
def compared(shared_ranks) -> dict[str, dict[str, SystemResult]]:
    return shared_ranks.result()[0]


@in_the_comparison
@pytest.mark.parametrize("peer", PEERS + (OURS,), ids=lambda system: system.name)
def test_peer_trains_like_ddp(compared, peer):
    results = compared["peers"]
    reference, result = results[DDP.name], results[peer.name]
    assert result.unavailable is None
    assert len(result.iteration_times_s) == 4
    assert math.isfinite(result.final_loss) and math.isfinite(result.eval_loss)
    assert result.final_loss == pytest.approx(reference.final_loss, rel=1e-3)
    assert result.eval_loss == pytest.approx(reference.eval_loss, rel=1e-3)


@in_the_comparison
def test_peers_are_built_as_named(compared):
    built = compared["built"]
    static, static_small, fsdp2 = (built[system.name] for system in PEERS)
    assert static["static_graph"] is True and static["gradient_as_bucket_view"] is True
    assert static_small["bucket_bytes_cap"] == int(0.05 * 1024 * 1024)
    # FSDP2: every block of the demo MLP (4 linear layers, 3 layer norms), and the root
    assert fsdp2["sharded_modules"] == 8 and static["sharded_modules"] == 0
    assert all(entry["optimizes_the_model"] for entry in built.values())


@in_the_comparison
def test_commsched_figures_cover_every_measured_iteration_but_a_rounds_last(compared):
    """One figure per measured iteration whose waits ended in the next one (2 rounds x (2 - 1)): the
    breakdown averages them. A round's last iteration's waits end in the drain, timed apart."""
    for system in (OURS, OFF):
        result = compared["peers"][system.name]
        assert len(result.exposed_wait_s) == len(result.update_s) == 2, system.name
        assert all(value >= 0 for value in result.exposed_wait_s + result.update_s)
    assert not compared["peers"][DDP.name].exposed_wait_s
    assert set(compared["peers"]) == {system.name for system in (DDP, *PEERS, OURS, OFF)}
    for name, result in compared["peers"].items():
        assert len(result.drain_s) == 2 and all(value >= 0 for value in result.drain_s), name


@in_the_comparison
def test_a_model_fsdp2_cannot_shard_is_reported_and_the_rest_goes_on(compared):
    results = compared["refused"]
    refusal = results[TorchFSDP2().name].unavailable
    assert refusal is not None and refusal.startswith("torch FSDP2 cannot train tied:") and "shared" in refusal
    assert not results[TorchFSDP2().name].iteration_times_s
    assert results[DDP.name].unavailable is None and len(results[DDP.name].iteration_times_s) == 2


@in_the_comparison
def test_the_contention_measurement_times_each_pair_and_the_all_reduce_alone(compared):
    measured = compared["contention"]
    assert len(measured.compute_alone_s) == len(measured.together_s) == len(measured.allreduce_s) == 3
    assert all(value > 0 for value in measured.compute_alone_s + measured.together_s + measured.allreduce_s)


@in_the_comparison
def test_the_contention_measurement_reports_the_slowest_worker(compared):
    """[Note: the bound with contention]: an iteration ends with its slowest rank, so rank 0, the
    faster here, reports rank 1's computation, alone and beside the all-reduce."""
    measured = compared["uneven_contention"]
    assert len(measured.compute_alone_s) == len(measured.together_s) == 2
    assert min(measured.compute_alone_s + measured.together_s) >= SLOW_S


@in_the_comparison
def test_the_server_link_is_timed_per_round_with_servers_and_not_at_all_without(compared):
    """[Note: the measured server link]: rank 0 (a worker) reports the slowest rank's time per round."""
    measured = compared["server_link"]
    assert len(measured.iteration_times_s) == 5 and all(value > 0 for value in measured.iteration_times_s)
    assert compared["no_server_link"] is None


def test_fsdp2_blocks_are_layers_residual_blocks_and_encoder_layers():
    """Per layer in the MLP and the VGG-like, per residual block, per encoder layer; never a
    module its parent only reads weights from (attention's out_proj)."""
    def kinds(name: str) -> list[str]:
        return [type(unit).__name__ for unit in fsdp2_units(WORKLOADS[name].build())]

    assert kinds("demo-mlp") == ["Linear", "LayerNorm", "Linear", "LayerNorm", "Linear", "LayerNorm", "Linear"]
    assert kinds("vgg-like") == ["Conv2d"] * 6 + ["Linear"] * 3
    assert kinds("resnet-like") == ["Conv2d", "BatchNorm2d", *["_BasicBlock"] * 16, "Linear"]
    assert kinds("transformer-like") == ["TransformerEncoderLayer"] * 4

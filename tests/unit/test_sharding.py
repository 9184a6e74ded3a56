"""Parameter-server sharding: blocks cover buckets exactly, on row boundaries, balanced."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.ps.sharding import make_blocks, min_block_bytes_for, place_blocks, plan_model_sharding
from commsched.ps.state import pack_block_state, unpack_block_state
from commsched.update.kinds import decode_hyperparameters, encode_hyperparameters, hyperparameter_snapshot

shapes = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=8
)


@settings(max_examples=150, deadline=None)
@given(shapes=shapes, bucket_size=st.integers(1, 4), block_bytes=st.integers(4, 2000))
def test_blocks_tile_buckets_on_row_boundaries(shapes, bucket_size, block_bytes):
    numels = [rows * cols for rows, cols in shapes]
    row_numels = [cols for _, cols in shapes]
    slots = list(range(len(shapes)))
    bucket_slots = [slots[i:i + bucket_size] for i in range(0, len(slots), bucket_size)]
    blocks, segments = make_blocks(bucket_slots, numels, row_numels, [4] * len(bucket_slots),
                                   list(range(len(bucket_slots))), block_bytes)
    minimum = min_block_bytes_for(block_bytes) // 4
    for bucket, members in enumerate(bucket_slots):
        mine = [b for b in blocks if b.bucket == bucket]
        total = sum(numels[s] for s in members)
        assert mine[0].start == 0 and mine[-1].end == total
        assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
        if len(mine) > 1:
            assert all(b.end - b.start >= minimum for b in mine)
    covered = {slot: 0 for slot in slots}
    assert blocks and len(blocks) == len(segments), (len(blocks), len(segments))
    for block, block_segments in zip(blocks, segments, strict=True):
        assert block_segments, f"block {block.pid} has no segment"
        assert sum(s.numel for s in block_segments) == block.end - block.start
        for segment in block_segments:
            row = row_numels[segment.slot]
            # every piece of a parameter is a stack of whole rows
            assert segment.param_start % row == 0
            assert (segment.param_start + segment.numel) % row == 0 or (
                segment.param_start + segment.numel == numels[segment.slot])
            covered[segment.slot] += segment.numel
    assert covered == {slot: numels[slot] for slot in slots}


def test_large_parameter_spans_servers_and_balance_is_reported():
    params = [torch.zeros(512, 256), torch.zeros(256), torch.zeros(64, 64)]
    plan = plan_model_sharding(params, [[0], [1, 2]], [1, 0], block_bytes=64 * 1024, num_servers=2)
    first = [b for b in plan.blocks if b.bucket == 0]
    assert len(first) == 8 and all(b.nbytes == 64 * 1024 for b in first)
    assert {plan.servers[b.pid] for b in first} == {0, 1}
    assert plan.imbalance() < 1.1
    assert "span several servers" in plan.summary([5, 6]) and "rank 6" in plan.summary([5, 6])


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=60), st.integers(1, 6))
def test_placement_is_within_one_block_of_perfect(sizes, servers):
    placement = place_blocks(sizes, servers)
    loads = [0] * servers
    for size, server in zip(sizes, placement):
        loads[server] += size
    assert max(loads) <= sum(sizes) / servers + max(sizes)
    assert place_blocks(sizes, servers) == placement  # deterministic


def test_hyperparameters_round_trip():
    w = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2))
    for kind, optimizer in (
        ("sgd", torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.3}], lr=0.1, momentum=0.9,
                                nesterov=True)),
        ("adamw", torch.optim.AdamW([w, b], lr=1e-3, betas=(0.8, 0.95), amsgrad=True)),
    ):
        snapshot = hyperparameter_snapshot(optimizer, kind)
        decoded = decode_hyperparameters(kind, encode_hyperparameters(kind, snapshot), len(snapshot))
        assert snapshot and len(decoded) == len(snapshot), (snapshot, decoded)
        for before, after in zip(snapshot, decoded, strict=True):
            assert {k: v for k, v in before.items() if k not in ("foreach", "fused")} == {
                k: v for k, v in after.items() if k not in ("foreach", "fused")}


def test_block_state_round_trip():
    from commsched.ps.sharding import Segment

    segments = [Segment(0, 4, 0, 3), Segment(1, 0, 3, 5)]
    states = [
        {"step": torch.tensor(7.0), "exp_avg": torch.arange(3.0), "exp_avg_sq": torch.ones(3)},
        None,
    ]
    message = pack_block_state("adam", segments, states, 8, torch.float32)
    unpacked = unpack_block_state("adam", segments, message, 8)
    assert unpacked[1] == {}
    assert float(unpacked[0]["step"]) == 7.0 and "max_exp_avg_sq" not in unpacked[0]
    torch.testing.assert_close(unpacked[0]["exp_avg"], torch.arange(3.0))

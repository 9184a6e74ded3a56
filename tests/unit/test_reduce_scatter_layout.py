"""Which buckets are reduce-scattered, and how their partitions cover every rank's chunk (pure logic)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.comm.reduce_scatter import cut_partitions, scattered_buckets
from commsched.layout.grad_layout import build_layout


def test_every_bucket_but_the_first_in_forward_order():
    assert scattered_buckets([5, 0, 2], world_size=3) == {0, 2}
    assert scattered_buckets([0], world_size=4) == frozenset()  # one bucket: it carries the flags
    assert scattered_buckets([3, 0], world_size=1) == frozenset()  # one replica: nothing to scatter


@settings(max_examples=80, deadline=None)
@given(numels=st.lists(st.integers(1, 60), min_size=2, max_size=7), world_size=st.integers(2, 5),
       partition_elements=st.one_of(st.none(), st.integers(1, 40)))
def test_partitions_cover_each_chunk_once(numels, world_size, partition_elements):
    """Scattered buckets are padded to equal chunks; their partitions tile the chunk, and count the
    bytes of every rank's piece; the first bucket's tile its buffer."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    forward_order = list(range(len(params)))
    partition_bytes = None if partition_elements is None else partition_elements * 4

    def cut(bucket_set):
        scattered = scattered_buckets(bucket_set.priorities, world_size)
        return cut_partitions(bucket_set, partition_bytes, scattered, world_size)

    layout = build_layout([f"p{i}" for i in range(len(params))], params, forward_order, [64 * 4], True, cut,
                          chunk_padding=world_size)
    scattered = scattered_buckets(layout.priorities, world_size)
    assert layout.flags_bucket not in scattered
    for bucket in layout.buckets:
        pieces = sorted((p.start, p.end, p.nbytes) for p in layout.partitions if p.bucket == bucket.index)
        if bucket.index in scattered:
            assert bucket.flat.numel() % world_size == 0 and bucket.flat.numel() - bucket.grad_numel < world_size
            covered = bucket.flat.numel() // world_size
        else:
            covered = bucket.flat.numel()
        assert pieces[0][0] == 0 and pieces[-1][1] == covered
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert sum(nbytes for _, _, nbytes in pieces) == bucket.flat.numel() * 4

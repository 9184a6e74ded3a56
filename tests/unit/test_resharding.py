"""Moving sharded state a piece at a time: every element reaches the new fragment that holds it."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.layout.shards import shard_bucket
from commsched.update.resharding import (
    RESHARD_PIECE_BYTES,
    new_fragments_by_param,
    own_stretch,
    piece_elements,
    take_stretch,
)


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    world_size=st.integers(1, 4),
    cut_every=st.integers(1, 8),
    stretch=st.integers(1, 30),
)
def test_every_element_reaches_its_new_fragment(numels, world_size, cut_every, stretch):
    """One old bucket of every parameter, on ``world_size`` ranks; new buckets of ``cut_every``
    parameters; each stretch of every rank's chunk gathered in turn, as the ranks' all-gathers would."""
    params = [torch.empty(numel) for numel in numels]
    offsets = list(itertools.accumulate([0, *numels[:-1]]))
    whole = torch.arange(sum(numels), dtype=torch.float64) + 1  # the old bucket's state, back to back
    old = [shard_bucket(0, range(len(params)), numels, rank, world_size) for rank in range(world_size)]
    chunk = old[0].chunk
    groups = [list(range(start, min(start + cut_every, len(params)))) for start in range(0, len(params), cut_every)]
    for rank in range(world_size):
        new = [shard_bucket(index, slots, [numels[s] for s in slots], rank, world_size)
               for index, slots in enumerate(groups)]
        targets = new_fragments_by_param([[params[s] for s in slots] for slots in groups], new)
        into = {key: {"exp_avg": torch.zeros(fragment.numel, dtype=torch.float64)}
                for found in targets.values() for key, fragment in found}
        for begin in range(0, chunk, stretch):
            length = min(stretch, chunk - begin)
            for other in range(world_size):  # what rank ``other`` contributes to this all-gather
                held = [(f, whole[f.bucket_offset:f.bucket_offset + f.numel]) for f in old[other].fragments]
                mine = torch.zeros(length, dtype=torch.float64)
                own_stretch(mine, other * chunk + begin, held)
                take_stretch(mine, other * chunk + begin, params, offsets, targets, "exp_avg", into)
        for position, param in enumerate(params):
            for key, fragment in targets.get(id(param), ()):
                want = whole[offsets[position] + fragment.start:offsets[position] + fragment.end]
                torch.testing.assert_close(into[key]["exp_avg"], want, rtol=0, atol=0)
        moved = sum(state["exp_avg"].numel() for state in into.values())
        assert moved == sum(shard.owned_numel for shard in new)


def test_a_gathered_piece_is_bounded_whatever_the_world_size():
    for element_size, world_size in ((4, 1), (4, 8), (2, 1024), (8, 100_000_000)):
        assert piece_elements(element_size, world_size) * element_size * world_size <= max(
            RESHARD_PIECE_BYTES, element_size * world_size)
        assert piece_elements(element_size, world_size) >= 1

"""Moving sharded state a piece at a time: every element reaches the new fragment that holds it."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.layout.shards import shard_bucket
from commsched.update.resharding import (
    RESHARD_PIECE_BYTES,
    back_to_back_offsets,
    move_kind,
    new_fragments_by_param,
    piece_elements,
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
    parameters. Each rank moves the state with a gather that hands it every rank's stretch in turn,
    taken from the whole state, as the ranks' all-gathers would."""
    params = [torch.empty(numel) for numel in numels]
    offsets = back_to_back_offsets(params)
    assert offsets == list(itertools.accumulate([0, *numels[:-1]]))
    whole = torch.arange(sum(numels), dtype=torch.float64) + 1  # the old bucket's state, back to back
    old = [shard_bucket(0, range(len(params)), numels, rank, world_size) for rank in range(world_size)]
    chunk = old[0].chunk
    padded = torch.cat([whole, torch.zeros(chunk * world_size - whole.numel(), dtype=torch.float64)])
    groups = [list(range(start, min(start + cut_every, len(params)))) for start in range(0, len(params), cut_every)]
    for rank in range(world_size):
        new = [shard_bucket(index, slots, [numels[s] for s in slots], rank, world_size)
               for index, slots in enumerate(groups)]
        targets = new_fragments_by_param([[params[s] for s in slots] for slots in groups], new)
        into = {key: {"exp_avg": torch.zeros(fragment.numel, dtype=torch.float64)}
                for found in targets.values() for key, fragment in found}
        held = [(f, whole[f.bucket_offset:f.bucket_offset + f.numel]) for f in old[rank].fragments]
        begins = iter(range(0, chunk, stretch))

        def gather(mine: torch.Tensor) -> torch.Tensor:
            begin = next(begins)
            stretches = [padded[other * chunk + begin:other * chunk + begin + mine.numel()]
                         for other in range(world_size)]
            torch.testing.assert_close(mine, stretches[rank], rtol=0, atol=0)  # this rank's own stretch
            return torch.cat(stretches)

        move_kind("exp_avg", old[rank], held, whole, params, targets, into, stretch, gather)
        if world_size > 1:
            assert next(begins, None) is None, "a stretch was never gathered"
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

"""Which part of each bucket a rank owns when the optimizer state is sharded.

Pure logic: `commsched.update.sharded` keeps the optimizer state, and runs the
update, for the elements this module assigns to a rank.

[Note: shard layout] A bucket of ``n`` gradient elements is cut into
``world_size`` equal chunks of ``ceil(n / world_size)`` elements, in the
bucket's own order; rank ``r`` owns chunk ``r``. The last chunks may end in
padding (never a parameter) or be empty, so every rank sends and receives
chunks of one size, which the all-gather needs. A parameter may
straddle chunks: each rank owns a *fragment* of it, a contiguous run of its
elements in memory order, and keeps optimizer state for that fragment only.
SGD, Adam and AdamW are elementwise, so updating fragments gives the same
values as updating whole parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WHOLE_FIRST_BUCKET_BYTES = 2**20
"""The largest first bucket (in forward order) whose state every rank keeps whole; see
[Note: the first bucket is not sharded] in `commsched.update.sharded`."""


def first_kept_whole(bucket_bytes: Sequence[int], first: int) -> bool:
    """Whether sharded state keeps bucket ``first`` (the forward pass's first) whole on every
    rank: it is small and not the only one."""
    return len(bucket_bytes) > 1 and bucket_bytes[first] <= WHOLE_FIRST_BUCKET_BYTES


def gathered_buckets(bucket_bytes: Sequence[int], first: int) -> int:
    """How many of these buckets sharded state all-gathers each step: all but one kept whole."""
    return len(bucket_bytes) - int(first_kept_whole(bucket_bytes, first))


@dataclass(frozen=True)
class Fragment:
    """The elements ``[start, end)`` (memory order) of one parameter that this rank owns."""

    slot: int
    """The parameter's slot in the model."""
    position: int
    """The parameter's position in its bucket."""
    start: int
    end: int
    bucket_offset: int
    """Where the fragment starts in the bucket's flat buffer."""

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BucketShard:
    """One bucket's chunks, and this rank's."""

    bucket: int
    numel: int
    """Gradient elements in the bucket (no padding, no flags)."""
    chunk: int
    """Elements each rank owns, padding included."""
    rank: int
    world_size: int
    fragments: tuple[Fragment, ...]

    @property
    def padded_numel(self) -> int:
        """The bucket's elements and padding: ``world_size`` chunks."""
        return self.chunk * self.world_size

    @property
    def start(self) -> int:
        """This rank's first element in the bucket."""
        return self.chunk * self.rank

    @property
    def owned_numel(self) -> int:
        """Elements of parameters this rank owns (no padding)."""
        return sum(fragment.numel for fragment in self.fragments)


def shard_bucket(bucket: int, slots: Sequence[int], numels: Sequence[int], rank: int, world_size: int) -> BucketShard:
    """Cut a bucket whose parameters (``slots``, of ``numels`` elements, in bucket order)
    lie back to back into ``world_size`` chunks; ``rank``'s fragments (see [Note: shard layout])."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    total = sum(numels)
    chunk = -(-total // world_size)
    begin, finish = chunk * rank, min(chunk * (rank + 1), total)
    fragments = []
    offset = 0
    for position, (slot, numel) in enumerate(zip(slots, numels, strict=True)):
        low, high = max(begin, offset), min(finish, offset + numel)
        if low < high:
            fragments.append(Fragment(slot, position, low - offset, high - offset, low))
        offset += numel
    return BucketShard(bucket, total, chunk, rank, world_size, tuple(fragments))


@dataclass(frozen=True)
class ShardStatus:
    """What `commsched.status` says about sharded optimizer state."""

    world_size: int
    rank: int
    chunk_elements: tuple[int, ...]
    """Per bucket, the elements each rank owns (padding included)."""
    owned_elements: int
    """Parameter elements whose state and update this rank owns."""
    total_elements: int
    """Parameter elements in every bucket."""
    state_bytes: int
    """Bytes of optimizer state this rank holds."""
    whole_buckets: tuple[int, ...] = ()
    """Buckets whose state every rank keeps whole and updates whole (the first one the forward
    pass needs, when small: see [Note: the first bucket is not sharded] in `commsched.update.sharded`)."""

    def describe(self) -> str:
        whole = f" (bucket {', '.join(map(str, self.whole_buckets))} whole on every rank)" if self.whole_buckets else ""
        return (f"optimizer state sharded over {self.world_size} ranks: rank {self.rank} owns "
                f"{self.owned_elements} of {self.total_elements} elements{whole}, {self.state_bytes} bytes of state")

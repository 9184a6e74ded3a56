"""Parameter-server sharding: row-aligned blocks, and which server holds each.

Pure logic, no process group: every rank (workers and servers) computes the
same plan from the same bucket layout, so nothing but the layout is exchanged.

A block is a contiguous slice of one bucket's flat buffer, cut at row
boundaries of the parameters it spans (a row is ``param[i]``: a slice along the
first dimension), so every piece of a parameter is itself a stack of whole
rows, as PaddlePaddle's parameter-server transpiler cuts them. Blocks are about
the partition size and never smaller than `min_block_bytes_for` it (unless the
bucket itself is smaller): a large parameter spans several blocks, and so
several servers; small parameters that share a bucket share a block. Blocks
are then placed largest first onto the least loaded server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from commsched.layout.partitions import Partition
from commsched.layout.placement import MIN_BLOCK_BYTES, place_blocks, server_block_bytes


def min_block_bytes_for(block_bytes: int) -> int:
    """Blocks are at least half the target size, or 64 KiB if that is smaller.

    Snapping cut points to row boundaries must not leave slivers that cost a
    message each; an explicitly small target (tests, tiny models) is honoured.
    """
    return max(1, min(MIN_BLOCK_BYTES, block_bytes // 2))


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that lies in one block."""

    slot: int
    """The parameter (its index among the model's trainable parameters)."""
    param_start: int
    """First element of the parameter (flattened) in this segment."""
    block_start: int
    """Where the segment starts inside the block."""
    numel: int


@dataclass(frozen=True)
class ShardingPlan:
    """Blocks (as `Partition`s of the buckets), their segments, and their servers."""

    blocks: list[Partition]
    segments: list[list[Segment]]
    servers: list[int]
    """Server index (0 .. num_servers-1) of each block."""
    num_servers: int

    def blocks_of(self, server: int) -> list[int]:
        return [b for b, s in enumerate(self.servers) if s == server]

    def loads_bytes(self) -> list[int]:
        loads = [0] * self.num_servers
        for block, server in zip(self.blocks, self.servers, strict=True):
            loads[server] += block.nbytes
        return loads

    def imbalance(self) -> float:
        """Bytes on the most loaded server over the mean (1.0 is perfect balance)."""
        loads = self.loads_bytes()
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0

    def summary(self, server_ranks: Sequence[int] | None = None) -> str:
        """One readable paragraph: blocks, bytes per server, balance."""
        ranks = list(server_ranks) if server_ranks is not None else list(range(self.num_servers))
        loads = self.loads_bytes()
        counts = [len(self.blocks_of(s)) for s in range(self.num_servers)]
        per_server = ", ".join(
            f"rank {rank}: {counts[s]} blocks, {loads[s] / 1e6:.2f} MB" for s, rank in enumerate(ranks)
        )
        return (
            f"{len(self.blocks)} blocks on {self.num_servers} server(s) ({per_server}); most loaded / mean "
            f"= {self.imbalance():.3f}; {self.spanning_parameters()} parameter(s) span several servers"
        )

    def spanning_parameters(self) -> int:
        """How many parameters have blocks on more than one server."""
        return sum(1 for blocks in self._blocks_per_slot().values() if len({self.servers[b] for b in blocks}) > 1)

    def _blocks_per_slot(self) -> dict[int, list[int]]:
        per_slot: dict[int, list[int]] = {}
        for block, segments in enumerate(self.segments):
            for segment in segments:
                per_slot.setdefault(segment.slot, []).append(block)
        return per_slot


def make_blocks(
    bucket_slots: Sequence[Sequence[int]],
    numels: Sequence[int],
    row_numels: Sequence[int],
    element_sizes: Sequence[int],
    bucket_priorities: Sequence[int],
    block_bytes: int,
    min_block_bytes: int | None = None,
) -> tuple[list[Partition], list[list[Segment]]]:
    """Cut every bucket into row-aligned blocks of about ``block_bytes``.

    ``numels[slot]`` and ``row_numels[slot]`` describe parameter ``slot``
    (``row_numels`` is its number of elements per first-dimension index);
    ``element_sizes`` and ``bucket_priorities`` are per bucket.
    """
    min_block_bytes = min_block_bytes_for(block_bytes) if min_block_bytes is None else min_block_bytes
    if block_bytes <= 0 or min_block_bytes <= 0:
        raise ValueError(f"block sizes must be > 0 bytes, got {block_bytes} and {min_block_bytes}")
    blocks: list[Partition] = []
    segments: list[list[Segment]] = []
    for bucket, slots in enumerate(bucket_slots):
        size = element_sizes[bucket]
        offsets, total = [], 0
        for slot in slots:
            offsets.append(total)
            total += numels[slot]
        cuts = _row_aligned_cuts(
            [numels[s] for s in slots], [max(1, row_numels[s]) for s in slots], offsets, total,
            max(1, block_bytes // size), max(1, math.ceil(min_block_bytes / size)),
        )
        for start, end in zip(cuts, cuts[1:]):
            pid = len(blocks)
            blocks.append(Partition(pid, bucket, start, end, (end - start) * size, bucket_priorities[bucket]))
            segments.append([
                Segment(slot, max(start, offset) - offset, max(start, offset) - start,
                        min(end, offset + numels[slot]) - max(start, offset))
                for slot, offset in zip(slots, offsets)
                if offset < end and offset + numels[slot] > start
            ])
    return blocks, segments


def _row_aligned_cuts(
    numels: list[int], rows: list[int], offsets: list[int], total: int, target: int, minimum: int
) -> list[int]:
    """Cut points ``[0, ..., total]`` near multiples of ``total / pieces``, on row boundaries."""
    pieces = max(1, min(total // minimum if total >= minimum else 1, int(total / target + 0.5)))
    cuts = [0]
    for piece in range(1, pieces):
        ideal = round(piece * total / pieces)
        cut = _nearest_row_boundary(ideal, numels, rows, offsets)
        if cut - cuts[-1] >= minimum and total - cut >= minimum:
            cuts.append(cut)
    cuts.append(total)
    return cuts


def _nearest_row_boundary(position: int, numels: list[int], rows: list[int], offsets: list[int]) -> int:
    for numel, row, offset in zip(numels, rows, offsets):
        if offset <= position < offset + numel:
            snapped = offset + round((position - offset) / row) * row
            return min(snapped, offset + numel)
    return position


def plan_model_sharding(
    params: Sequence[torch.Tensor],
    bucket_slots: Sequence[Sequence[int]],
    bucket_priorities: Sequence[int],
    block_bytes: int,
    num_servers: int,
) -> ShardingPlan:
    """Blocks of a model's trainable parameters laid out in ``bucket_slots``, and their servers.

    ``block_bytes`` is lowered, if needed, to about `commsched.layout.placement.BLOCKS_PER_SERVER` blocks per server.
    """
    numels = [p.numel() for p in params]
    total = sum(p.numel() * p.element_size() for p in params)
    block_bytes = server_block_bytes(block_bytes, total, num_servers)
    rows = [p.numel() // p.shape[0] if p.dim() > 0 and p.shape[0] > 0 else max(1, p.numel()) for p in params]
    sizes = [params[slots[0]].element_size() for slots in bucket_slots]
    blocks, segments = make_blocks(bucket_slots, numels, rows, sizes, bucket_priorities, block_bytes)
    return ShardingPlan(blocks, segments, place_blocks([b.nbytes for b in blocks], num_servers), num_servers)

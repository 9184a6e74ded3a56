"""Making every rank start from the same model, and proving they do.

Collectives are matched by the order they are issued, so a model with a
different parameter list on one rank would pair gradients with the wrong
partner. Every rank hashes its parameter and buffer list, the hashes are
compared, and a mismatch stops all ranks with the first entry that differs.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from commsched.errors import wait_or_raise


def describe_tensor(kind: str, name: str, tensor: torch.Tensor) -> str:
    """What must agree across ranks for one parameter or buffer."""
    grad = ", requires_grad" if tensor.requires_grad else ""
    return f"{kind} '{name}' shape={tuple(tensor.shape)} dtype={tensor.dtype}{grad}"


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def verify_same_across_ranks(descriptions: Sequence[str], group: dist.ProcessGroup) -> None:
    """Raise ``ValueError`` on every rank unless all ranks hold the same descriptions."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    count = torch.tensor([len(descriptions)], dtype=torch.int64)
    counts = [torch.zeros_like(count) for _ in range(world_size)]
    dist.all_gather(counts, count, group=group)
    longest = max(int(c) for c in counts)

    hashes = torch.zeros(longest, dtype=torch.int64)
    hashes[: len(descriptions)] = torch.tensor([_hash64(d) for d in descriptions], dtype=torch.int64)
    gathered = [torch.zeros_like(hashes) for _ in range(world_size)]
    dist.all_gather(gathered, hashes, group=group)
    table = torch.stack(gathered)  # [rank, entry]
    differs = (table != table[0]).any(dim=0).nonzero()
    if differs.numel() == 0:
        return

    first = int(differs[0])
    ranks = [r for r in range(world_size) if table[r, first] != table[0, first]]
    mine = descriptions[first] if first < len(descriptions) else "nothing (fewer entries)"
    reference = _broadcast_text(mine, group)
    rank = dist.get_rank(group)
    raise ValueError(
        f"The model differs across ranks at entry #{first}: rank 0 has {reference}; "
        f"rank(s) {ranks} differ (this is rank {rank}, which has {mine}). "
        f"Entry counts per rank: {[int(c) for c in counts]}. "
        "Build the same model (same parameters, buffers, shapes, dtypes and requires_grad) "
        "on every rank before commsched.prepare()."
    )


def _broadcast_text(text: str, group: dist.ProcessGroup) -> str:
    """Rank 0's ``text`` on every rank, sent as bytes (never pickled)."""
    payload = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.broadcast(length, group=group, group_src=0)
    buffer = payload.clone() if dist.get_rank(group) == 0 else torch.zeros(int(length), dtype=torch.uint8)
    dist.broadcast(buffer, group=group, group_src=0)
    return bytes(buffer.tolist()).decode()


@torch.no_grad()
def broadcast_from_rank0(
    tensors: Iterable[torch.Tensor], group: dist.ProcessGroup, timeout_s: float | None = None
) -> None:
    """Overwrite ``tensors`` with rank 0's values, one collective per dtype and device.

    With ``timeout_s``, a peer that never joins raises `CommunicationTimeout`.
    """
    if dist.get_world_size(group) == 1:
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        by_kind[(tensor.dtype, tensor.device)].append(tensor)
    is_source = dist.get_rank(group) == 0
    for same_kind in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same_kind])
        work = dist.broadcast(flat, group=group, group_src=0, async_op=True)
        if timeout_s is None:
            work.wait()
        else:
            wait_or_raise(work, timeout_s, f"the broadcast of {len(same_kind)} buffers from rank 0")
        if not is_source:
            for tensor, chunk in zip(same_kind, flat.split([t.numel() for t in same_kind])):
                tensor.copy_(chunk.view_as(tensor))

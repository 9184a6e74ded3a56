"""Sharded optimizer state to and from ``torch.distributed.checkpoint``, each rank its own part.

``optimizer.state_dict()`` gathers the whole state on every rank (torch.optim's
format); for state too large to gather, each rank writes and reads only its
fragments (see [Note: shard layout] in `commsched.layout.shards`). Each state
tensor of a parameter is saved as one ``ShardedTensor`` over the parameter's
elements, flat in memory order, whose shards are the ranks' fragments; a scalar
(Adam's step) is saved once. A run that loads it asks for its own fragments, so
``torch.distributed.checkpoint`` reads the parts of the saved shards that
overlap them: the checkpoint loads into any world size and bucket layout.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from commsched.layout.shards import shard_bucket
from commsched.update.sharded_layout import ShardCut, StateKinds

PARAM_GROUPS_KEY = "param_groups"


@dataclass(frozen=True)
class Piece:
    """One state tensor of one parameter: this rank's fragment of it, and where every rank's lies."""

    name: str
    """``state.<parameter index>.<key>`` (the index as in torch.optim's state dict)."""
    numel: int
    """The parameter's elements."""
    local: tuple[int, torch.Tensor] | None
    """This rank's fragment: its first element and its values (None: it owns none)."""
    chunks: tuple[tuple[int, int, int], ...]
    """Every rank's fragment: (rank, first element, elements)."""
    whole: bool = False
    """Every rank holds all of it (see [Note: the first bucket is not sharded] in
    `commsched.update.sharded`): saved by rank 0 alone, read whole by every rank."""


def _sharded(piece: Piece, group: dist.ProcessGroup) -> ShardedTensor:
    """``piece`` as a ShardedTensor over the parameter's elements (no communication)."""
    start, values = piece.local
    device = values.device
    metadata = ShardedTensorMetadata(
        shards_metadata=[ShardMetadata(shard_offsets=[first], shard_sizes=[length], placement=f"rank:{rank}/{device}")
                         for rank, first, length in piece.chunks],
        size=torch.Size([piece.numel]),
        tensor_properties=TensorProperties(dtype=values.dtype, layout=torch.strided, requires_grad=False,
                                           memory_format=torch.contiguous_format, pin_memory=False),
    )
    local = Shard(values, ShardMetadata(shard_offsets=[start], shard_sizes=[values.numel()],
                                        placement=f"rank:{dist.get_rank(group)}/{device}"))
    return ShardedTensor._init_from_local_shards_and_global_metadata([local], metadata, process_group=group)


def save(pieces: Sequence[Piece], scalars: Mapping[str, torch.Tensor], param_groups: list[dict[str, Any]],
         checkpoint_id: str | os.PathLike, group: dist.ProcessGroup) -> None:
    """Write this rank's pieces, the scalars it holds (by name) and the param groups. Collective."""
    state: dict[str, Any] = {PARAM_GROUPS_KEY: param_groups, **scalars}
    for piece in pieces:
        if piece.local is not None:
            state[piece.name] = _sharded(piece, group)
    with _sharded_tensors_allowed():
        _dcp().save(state, checkpoint_id=checkpoint_id, process_group=group)


def load(pieces: Sequence[Piece], scalars: Mapping[str, torch.Tensor], param_groups: list[dict[str, Any]],
         checkpoint_id: str | os.PathLike, group: dist.ProcessGroup) -> tuple[dict[str, torch.Tensor], list]:
    """Fill this rank's pieces and scalars from what `save` wrote (those the checkpoint holds,
    by name); returns them and the saved param groups. Collective."""
    dcp = _dcp()
    saved = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    wanted: dict[str, Any] = {PARAM_GROUPS_KEY: param_groups}
    for piece in pieces:
        if piece.local is not None and piece.name in saved:
            if tuple(saved[piece.name].size) != (piece.numel,):
                raise ValueError(
                    f"the sharded optimizer checkpoint at {os.fspath(checkpoint_id)!r} holds {piece.name} of "
                    f"{tuple(saved[piece.name].size)} elements, this model's parameter has {piece.numel}: it was "
                    "saved from another model"
                )
            wanted[piece.name] = piece.local[1] if piece.whole else _sharded(piece, group)
    wanted.update({name: value for name, value in scalars.items() if name in saved})
    with _sharded_tensors_allowed():
        dcp.load(wanted, checkpoint_id=checkpoint_id, process_group=group)
    loaded = {name: value.local_shards()[0].tensor if isinstance(value, ShardedTensor) else value
              for name, value in wanted.items() if name != PARAM_GROUPS_KEY}
    return loaded, wanted[PARAM_GROUPS_KEY]


@contextlib.contextmanager
def _sharded_tensors_allowed() -> Iterator[None]:
    """torch asks for DTensor instead of ShardedTensor, but a DTensor's shards are the even
    chunks of one dimension, and a parameter's fragments start anywhere: keep ShardedTensor,
    without a warning at every checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


# ------------------------------------------------------------- naming
def pieces(cut: ShardCut, state: Mapping[torch.Tensor, dict[str, Any]], kinds: StateKinds,
           template: bool) -> tuple[list[Piece], dict[str, torch.Tensor]]:
    """Per parameter and state tensor, this rank's fragment and every rank's; the scalars, by the
    names of torch.optim's state dict. ``state``: per fragment (its view), its state;
    ``template``: zeros for every state the optimizer may hold (to load into), else what it holds."""
    index_of = kinds.param_indices()
    found, scalars = [], {}
    for shard, params, fragments in zip(cut.shards, cut.bucket_params, cut.fragments, strict=True):
        everyone = [shard_bucket(shard.bucket, range(len(params)), [p.numel() for p in params], rank,
                                 shard.world_size).fragments for rank in range(shard.world_size)]
        whole = shard.bucket == cut.whole_bucket
        # Every rank holds the whole bucket's state: rank 0 writes it, every rank reads it whole.
        mine = ({} if whole and not template and cut.rank != 0 else
                {fragment.position: (fragment, piece) for fragment, piece in fragments})
        for position, param in enumerate(params):
            group_keys = kinds.keys_of(param)
            if group_keys is None:
                continue
            index = index_of[id(param)]
            chunks = tuple((rank, f.start, f.numel) for rank, owned in enumerate(everyone)
                           for f in owned if f.position == position)
            fragment, piece = mine.get(position, (None, None))
            held = {} if piece is None else state.get(piece, {})
            keys = group_keys if template else [k for k, v in held.items() if v.dim() > 0]
            for key in keys:
                local = None
                if piece is not None:
                    local = (fragment.start, torch.zeros_like(piece) if template else held[key])
                found.append(Piece(f"state.{index}.{key}", param.numel(), local, chunks, whole=whole))
            if piece is not None and kinds.has_step:
                if template:
                    scalars[f"state.{index}.step"] = torch.zeros((), dtype=torch.float32)
                elif "step" in held:
                    scalars[f"state.{index}.step"] = held["step"].detach().cpu()
    return found, scalars


def fragment_names(cut: ShardCut, kinds: StateKinds) -> dict[str, list[tuple[torch.Tensor, str]]]:
    """Where each name of `pieces` goes: this rank's fragments (their views) and the state key."""
    index_of = kinds.param_indices()
    where: dict[str, list[tuple[torch.Tensor, str]]] = defaultdict(list)
    for params, fragments in zip(cut.bucket_params, cut.fragments, strict=True):
        for fragment, piece in fragments:
            param = params[fragment.position]
            keys = kinds.keys_of(param)
            if keys is None:
                continue
            for key in (*keys, *(("step",) if kinds.has_step else ())):
                where[f"state.{index_of[id(param)]}.{key}"].append((piece, key))
    return where


def param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """torch.optim's param groups, as its state dict holds them (no state: nothing is gathered)."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        packed = {key: value for key, value in group.items() if key != "params"}
        packed["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        groups.append(packed)
    return groups


def _dcp():
    """``torch.distributed.checkpoint``, imported at the first checkpoint: importing it (and the
    DTensor it brings) takes about 0.6 s, which every process that imports commsched would pay."""
    import torch.distributed.checkpoint as dcp

    return dcp

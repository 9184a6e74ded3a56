"""What sharded optimizer state is laid out as: this rank's chunks of the buckets, and the state kinds.

Plain data shared by the sharded update (`commsched.update.sharded`), its checkpoints
(`commsched.update.sharded_checkpoint`) and its move into a new layout
(`commsched.update.resharding`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from commsched.layout.shards import BucketShard, Fragment

FullState = dict[torch.nn.Parameter, dict[str, Any]]
"""Per parameter, torch.optim's state for it (whole tensors)."""

FragmentStates = dict[tuple[int, int], dict[str, Any]]
"""Per (bucket, number of the fragment among this rank's in that bucket), the fragment's state."""


@dataclass
class ShardCut:
    """The layout's chunks as cut on this rank (see [Note: shard layout] in `commsched.layout.shards`)."""

    shards: list[BucketShard] = field(default_factory=list)
    """Per bucket, who owns which chunk."""
    flats: list[torch.Tensor] = field(default_factory=list)
    """Per bucket, the flat buffer its parameters are views into (padded to equal chunks)."""
    bucket_params: list[tuple[torch.nn.Parameter, ...]] = field(default_factory=list)
    fragments: list[list[tuple[Fragment, torch.Tensor]]] = field(default_factory=list)
    """Per bucket, this rank's fragments and their views into the flat buffer (the state's keys)."""
    rank: int = 0
    world_size: int = 1
    whole_bucket: int | None = None
    """The bucket every rank updates whole (see [Note: the first bucket is not sharded] in
    `commsched.update.sharded`)."""


class StateKinds:
    """Which state tensors an optimizer keeps for each of its parameters, by its param group's options."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str):
        """``kind``: "sgd", "adam" or "adamw" (`commsched.update.kinds.optimizer_kind`)."""
        self.optimizer, self.kind = optimizer, kind
        self.group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        """Each of the optimizer's parameters (by id), its param group's index."""
        self.has_step = kind != "sgd"
        """Whether each parameter's state holds a scalar step (Adam's)."""

    def keys_of_group(self, group: int) -> tuple[str, ...]:
        options = self.optimizer.param_groups[group]
        if self.kind == "sgd":
            return ("momentum_buffer",) if options["momentum"] != 0 else ()
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if options["amsgrad"] else ("exp_avg", "exp_avg_sq")

    def keys_of(self, param: torch.Tensor) -> tuple[str, ...] | None:
        """``param``'s state tensors; None if the optimizer does not step it."""
        group = self.group_of.get(id(param))
        return None if group is None else self.keys_of_group(group)

    def state_keys(self, params: Sequence[torch.nn.Parameter]) -> list[str]:
        """Every kind of state tensor some of ``params`` has, each once."""
        keys: list[str] = []
        for param in params:
            for key in self.keys_of(param) or ():
                if key not in keys:
                    keys.append(key)
        return keys

    def param_indices(self) -> dict[int, int]:
        """Each parameter's index in torch.optim's state dict (param groups in order)."""
        params = (p for group in self.optimizer.param_groups for p in group["params"])
        return {id(p): i for i, p in enumerate(params)}

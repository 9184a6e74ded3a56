"""Optimizer state of parameter-server blocks, flattened into one tensor per block.

Servers hold the optimizer state of their blocks (a segment of a parameter has
the matching segment of each state tensor). Checkpoints move it between the
servers and the workers' ``optimizer.state`` in torch.optim's own format, so a
state dict saved with the parameter-server backend loads into plain torch and
back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commsched.ps.protocol import STATE_SCALAR_KEYS, STATE_TENSOR_KEYS, state_message_length
from commsched.ps.sharding import Segment


def _family(kind: str) -> str:
    return "sgd" if kind == "sgd" else "adam"


def pack_block_state(
    kind: str,
    segments: Sequence[Segment],
    states: Sequence[dict[str, object] | None],
    block_numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``states[i]`` holds segment ``i``'s state: tensors of the segment's length, or None."""
    family = _family(kind)
    scalar_keys, tensor_keys = STATE_SCALAR_KEYS[family], STATE_TENSOR_KEYS[family]
    keys = scalar_keys + tensor_keys
    n = len(segments)
    message = torch.zeros(state_message_length(kind, block_numel, n), dtype=dtype)
    present = message[: n * len(keys)].view(n, len(keys))
    scalars = message[n * len(keys): n * len(keys) + n * len(scalar_keys)].view(n, len(scalar_keys))
    tensors = message[n * len(keys) + n * len(scalar_keys):].view(len(tensor_keys), block_numel)
    for i, (segment, state) in enumerate(zip(segments, states, strict=True)):
        if not state:
            continue
        for k, key in enumerate(scalar_keys):
            if key in state:
                present[i, k] = 1
                scalars[i, k] = float(state[key])
        for k, key in enumerate(tensor_keys):
            value = state.get(key)
            if value is not None:
                present[i, len(scalar_keys) + k] = 1
                tensors[k, segment.block_start: segment.block_start + segment.numel] = value.reshape(-1)
    return message


def unpack_block_state(
    kind: str, segments: Sequence[Segment], message: torch.Tensor, block_numel: int
) -> list[dict[str, torch.Tensor]]:
    """Per segment its state (empty dict if none): 1-D tensors, and a 0-d float32 ``step``."""
    family = _family(kind)
    scalar_keys, tensor_keys = STATE_SCALAR_KEYS[family], STATE_TENSOR_KEYS[family]
    keys = scalar_keys + tensor_keys
    n = len(segments)
    present = message[: n * len(keys)].view(n, len(keys))
    scalars = message[n * len(keys): n * len(keys) + n * len(scalar_keys)].view(n, len(scalar_keys))
    tensors = message[n * len(keys) + n * len(scalar_keys):].view(len(tensor_keys), block_numel)
    states: list[dict[str, torch.Tensor]] = []
    for i, segment in enumerate(segments):
        state: dict[str, torch.Tensor] = {}
        for k, key in enumerate(scalar_keys):
            if present[i, k]:
                state[key] = torch.tensor(float(scalars[i, k]), dtype=torch.float32)
        for k, key in enumerate(tensor_keys):
            if present[i, len(scalar_keys) + k]:
                state[key] = tensors[k, segment.block_start: segment.block_start + segment.numel].clone()
        states.append(state)
    return states

"""The parameter-server wire protocol: tags, commands, and message layouts.

Everything on the wire is a tensor of a known size: nothing is unpickled.

Per synchronised iteration, each worker sends every server one *header*
(float64: command, iteration, whether a new plan follows, the optimizer's
hyper-parameters), then pushes that server's blocks in the agreed plan order.
A push is the block's gradient followed by a *trailer* in the block's dtype:
the iteration, then one flag per segment (1 if this worker has a gradient for
that parameter). The server answers each push with the block's new values
(the pull), on the block's own tag. Other commands (finish, read or write the
optimizer state or the parameters) travel as headers between iterations.
"""

from __future__ import annotations

import enum

import torch

HEADER_TAG = 11
LAYOUT_TAG = 12
PLAN_TAG = 13
STATE_TAG = 14
ACK_TAG = 15
PARAMS_TAG = 16
_BLOCK_TAG_BASE = 1000


def push_tag(block: int) -> int:
    return _BLOCK_TAG_BASE + 2 * block


def pull_tag(block: int) -> int:
    return _BLOCK_TAG_BASE + 2 * block + 1


class Command(enum.IntEnum):
    PUSH = 1
    """An iteration's pushes follow."""
    FINISH = 2
    """This worker is done: no more messages."""
    GET_STATE = 3
    """Send the optimizer state of every block of this server."""
    SET_STATE = 4
    """The optimizer state of every block of this server follows; acknowledge."""
    SET_PARAMETERS = 5
    """New parameter values for every block of this server follow; acknowledge."""
    FAILED = 6
    """This worker is ending by an exception: no more messages (its note says which)."""


HEADER_FIXED = 3  # command, iteration, plan follows


def header_length(num_hyperparameters: int) -> int:
    return HEADER_FIXED + num_hyperparameters


def make_header(command: Command, iteration: int, plan_follows: bool, hyperparameters: list[float]) -> torch.Tensor:
    return torch.tensor([float(command), float(iteration), float(plan_follows), *hyperparameters],
                        dtype=torch.float64)


def trailer_length(num_segments: int) -> int:
    return 1 + num_segments


STATE_TENSOR_KEYS = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}
"""Optimizer state tensors shaped like the parameter, per optimizer kind."""
STATE_SCALAR_KEYS = {"sgd": (), "adam": ("step",)}


def state_message_length(kind: str, block_numel: int, num_segments: int) -> int:
    """Per segment a presence flag for each key, the scalars, then each tensor key over the block."""
    family = "sgd" if kind == "sgd" else "adam"
    keys = STATE_SCALAR_KEYS[family] + STATE_TENSOR_KEYS[family]
    return num_segments * len(keys) + num_segments * len(STATE_SCALAR_KEYS[family]) + block_numel * len(
        STATE_TENSOR_KEYS[family])

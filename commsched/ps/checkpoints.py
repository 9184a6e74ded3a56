"""A server's side of checkpoints: its blocks' optimizer state and values, to and from one worker.

``optimizer.state_dict()`` on a worker fetches every server's state
(`commsched.ps.remote_update.ServerSideUpdate.fetch`); loading
a checkpoint sends the state, or the parameters' values, back. The server
answers each command here, between iterations, under its update lock.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from commsched.errors import wait_work
from commsched.ps.protocol import ACK_TAG, PARAMS_TAG, STATE_TAG, state_message_length
from commsched.ps.sharding import Segment
from commsched.ps.state import pack_block_state, unpack_block_state


class CheckpointExchange:
    """Moves the state and values of one server's blocks (``values`` by block id) to and from a worker."""

    def __init__(
        self,
        kind: str,
        segments: Mapping[int, Sequence[Segment]],
        values: Mapping[int, torch.Tensor],
        segment_views: Mapping[int, Sequence[torch.Tensor]],
        optimizer: torch.optim.Optimizer,
        lock: threading.Lock,
        group: dist.ProcessGroup,
        timeout_s: float,
    ):
        """``segments``, ``segment_views``: per block, its parameters' segments and their views of
        ``values``; ``optimizer``: the server's, over those views; ``lock``: the server's update lock."""
        self._kind, self._segments, self._values, self._views = kind, segments, values, segment_views
        self._optimizer, self._lock, self._group, self._timeout_s = optimizer, lock, group, timeout_s

    def send_state(self, worker: int) -> None:
        with self._lock:
            messages = []
            for pid, values in self._values.items():
                states = [self._optimizer.state.get(view) for view in self._views[pid]]
                messages.append(pack_block_state(self._kind, self._segments[pid], states, values.numel(),
                                                 values.dtype))
        for message in messages:
            wait_work(dist.isend(message, dst=worker, tag=STATE_TAG, group=self._group), self._timeout_s)

    def receive_state(self, worker: int) -> None:
        received = {}
        for pid, values in self._values.items():
            message = torch.empty(state_message_length(self._kind, values.numel(), len(self._segments[pid])),
                                  dtype=values.dtype)
            wait_work(dist.irecv(message, src=worker, tag=STATE_TAG, group=self._group), self._timeout_s)
            received[pid] = message
        with self._lock:
            for pid, message in received.items():
                states = unpack_block_state(self._kind, self._segments[pid], message, self._values[pid].numel())
                for view, state in zip(self._views[pid], states, strict=True):
                    if state:
                        self._optimizer.state[view] = state
                    else:
                        self._optimizer.state.pop(view, None)
        self._acknowledge(worker)

    def receive_parameters(self, worker: int) -> None:
        received = {}
        for pid, values in self._values.items():
            message = torch.empty_like(values)
            wait_work(dist.irecv(message, src=worker, tag=PARAMS_TAG, group=self._group), self._timeout_s)
            received[pid] = message
        with self._lock:
            for pid, message in received.items():
                self._values[pid].copy_(message)
        self._acknowledge(worker)

    def _acknowledge(self, worker: int) -> None:
        wait_work(dist.isend(torch.ones(1, dtype=torch.int64), dst=worker, tag=ACK_TAG, group=self._group),
                  self._timeout_s)

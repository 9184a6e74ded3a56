"""The parameter servers run the optimizer: a bucket's "update" installs the values they sent.

The optimizer's state lives on the servers too, so checkpoints fetch it into
``optimizer.state`` (torch.optim's own format) and loading one sends it back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from commsched.layout.partitions import Partition
from commsched.ps.protocol import ACK_TAG, PARAMS_TAG, STATE_TAG, Command, state_message_length
from commsched.ps.push_pull import ParameterServerTransport
from commsched.ps.sharding import Segment
from commsched.ps.state import STATE_TENSOR_KEYS, pack_block_state, unpack_block_state
from commsched.update.base import Hyperparameters
from commsched.update.kinds import hyperparameter_snapshot

if TYPE_CHECKING:
    from commsched.layout.grad_layout import GradLayout
    from commsched.update.grad_scaling import GradScaling


class ServerSideUpdate:
    """The parameter-server backend's update: copy the pulled values into the parameters."""

    overlap_blocker = None
    per_bucket = True
    sharded = None
    join_refusal = None
    foreign_step_refusal = (
        "With Strategy(backend=ParameterServer(...)) the servers run the optimizer and the workers' parameters "
        "are replaced by the servers' values, so this update would be lost and its gradient is this worker's own"
    )

    def __init__(self, client: ParameterServerTransport):
        self.state_elsewhere = self
        """The servers hold the state and the values (see `commsched.ps.checkpoints`)."""
        self._client = client
        self._optimizer, self._kind, self._params = client.optimizer, client.kind, client.params

    def adopt(self, optimizer: torch.optim.Optimizer, layout: GradLayout | None) -> None:
        raise RuntimeError("with parameter servers the optimizer is given to prepare() and serve(), never adopted")

    def attach(self, layout: GradLayout) -> None:
        """The transport's stages (one per bucket) receive the pulled values."""

    def detach(self) -> None:
        """Nothing of the buckets is kept here."""

    def snapshot(self) -> Hyperparameters:
        return hyperparameter_snapshot(self._optimizer, self._kind)

    @torch.no_grad()
    def update(self, bucket: int, hyperparameters: Hyperparameters, skip_slots: frozenset[int],
               scaling: GradScaling | None) -> None:
        stage = self._client.stages[bucket]
        for param, values in zip(stage.params, stage.grad_views, strict=True):
            param.copy_(values)

    def wait_updated(self, bucket: int) -> None:
        """An update is done when it returns (the values were received)."""

    def step_on_current_gradients(self, optimizer_step: Callable[[], object], again: bool) -> None:
        """The servers applied this pass's gradients already; only a step on no gradient matches torch."""
        if again and all(p.grad is None for p in self._params):
            return  # torch.optim skips every parameter without a gradient
        what = (
            "optimizer.step() ran again without a backward() in between, on gradients that are not None"
            if again else "optimizer.zero_grad() ran between backward() and step()"
        )
        raise RuntimeError(
            f"{what}. With Strategy(backend=ParameterServer(...)) the servers apply each backward()'s "
            "gradients exactly once, when they arrive, so this step cannot do what torch.optim would. "
            "Call optimizer.step() once after each backward() and optimizer.zero_grad() after step() (a "
            "step() after zero_grad() with set_to_none=True changes nothing and is allowed)."
        )

    def before_backward(self, unstepped_backward: bool) -> None:
        if unstepped_backward:
            raise RuntimeError(
                "backward() ran twice without optimizer.step() in between. With "
                "Strategy(backend=ParameterServer(...)) every synchronised backward() is an update on the "
                "servers; accumulate gradients over micro-batches inside model.no_sync() and call "
                "optimizer.step() after the last backward()."
            )

    def check_step(self, gradients_changed: bool, scaled: bool) -> None:
        """The servers updated with the gradients and hyper-parameters of backward() time."""
        if scaled:
            raise RuntimeError(
                "a torch.amp.GradScaler steps this optimizer, but with Strategy(backend=ParameterServer(...)) "
                "the gradients were pushed to the servers during backward(), still scaled, and the servers "
                "run the optimizer without the scaler's unscaling or its inf/NaN check. Use the all-reduce "
                "backend (Strategy(backend=AllReduce()), the default) for mixed precision with GradScaler; "
                "bf16 autocast needs no GradScaler and works with parameter servers."
            )
        if gradients_changed:
            raise RuntimeError(
                "gradients were modified between backward() and step(), but with "
                "Strategy(backend=ParameterServer(...)) they were pushed to the servers during backward() and "
                "the servers run the optimizer, so the change would be ignored. Gradient clipping and "
                "AMP unscaling need the averaged gradients on the workers: use the all-reduce backend for them."
            )
        self._client.check_hyperparameters_unchanged()

    def fetch(self) -> None:
        """Copy the servers' optimizer state into ``optimizer.state`` (torch.optim's format)."""
        client = self._client
        if client.plan is None or client.finished:  # nothing built yet, or released
            return
        plan, family_keys = client.plan, STATE_TENSOR_KEYS["sgd" if self._kind == "sgd" else "adam"]
        gathered: dict[int, dict[str, torch.Tensor]] = {}
        for index, server in enumerate(client.roles.servers):
            client.send_command(server, Command.GET_STATE)
            for pid in plan.blocks_of(index):
                block, segments = plan.blocks[pid], plan.segments[pid]
                numel = block.end - block.start
                message = torch.empty(state_message_length(self._kind, numel, len(segments)),
                                      dtype=client.stages[block.bucket].dtype)
                client.receive(message, server, STATE_TAG, f"the optimizer state of block {pid}")
                for segment, state in zip(segments, unpack_block_state(self._kind, segments, message, numel)):
                    param = self._params[segment.slot]
                    target = gathered.setdefault(segment.slot, {})
                    for key, value in state.items():
                        if key in family_keys:
                            full = target.setdefault(key, torch.zeros(param.numel(), dtype=param.dtype))
                            full[segment.param_start:segment.param_start + segment.numel] = value
                        else:
                            target[key] = value
        owned = {id(p) for group in self._optimizer.param_groups for p in group["params"]}
        for slot, state in gathered.items():
            param = self._params[slot]
            if id(param) not in owned:
                continue
            if state:
                self._optimizer.state[param] = {
                    key: value.view_as(param) if key in family_keys else value for key, value in state.items()
                }
            else:
                self._optimizer.state.pop(param, None)

    def drop_fetched(self) -> None:
        """Workers keep the fetched state (the servers' copy of it) as torch.optim's."""

    def push_optimizer_state(self) -> None:
        """Send ``optimizer.state`` (just loaded from a checkpoint) to the servers."""

        def message(block: Partition, segments: list[Segment]) -> torch.Tensor:
            states = []
            for segment in segments:
                state = self._optimizer.state.get(self._params[segment.slot])
                states.append(None if not state else {
                    key: (value.reshape(-1)[segment.param_start:segment.param_start + segment.numel]
                          if isinstance(value, torch.Tensor) and value.dim() > 0 else value)
                    for key, value in state.items()
                })
            return pack_block_state(self._kind, segments, states, block.end - block.start,
                                    self._client.stages[block.bucket].dtype)

        self._send_every_block(Command.SET_STATE, message, STATE_TAG, "optimizer state")

    @torch.no_grad()
    def push_parameters(self) -> None:
        """Send the workers' parameter values (just loaded from a checkpoint) to the servers."""

        def message(block: Partition, segments: list[Segment]) -> torch.Tensor:
            return torch.cat([self._params[s.slot].detach().reshape(-1)[s.param_start:s.param_start + s.numel]
                              for s in segments])

        self._send_every_block(Command.SET_PARAMETERS, message, PARAMS_TAG, "values")

    def _send_every_block(
        self, command: Command, message: Callable[[Partition, list[Segment]], torch.Tensor], tag: int, what: str
    ) -> None:
        """``command`` to each server, then one message per block it holds; wait for its acknowledgement."""
        client = self._client
        if client.plan is None or client.finished:  # nothing built yet, or released
            return
        plan = client.plan
        for index, server in enumerate(client.roles.servers):
            client.send_command(server, command)
            for pid in plan.blocks_of(index):
                client.send(message(plan.blocks[pid], plan.segments[pid]), server, tag, f"the {what} of block {pid}")
            client.receive(torch.zeros(1, dtype=torch.int64), server, ACK_TAG, f"the acknowledgement of the {what}")

    def close(self) -> None:
        """The servers are let go of by the transport; the optimizer keeps whatever it holds."""

"""The gradient reducer: from "a gradient is ready" to "every rank holds the average".

One `GradientReducer` is attached to each prepared model. Per backward pass:

1. a post-accumulate-grad hook marks a parameter ready (its gradient already
   sits in its bucket's flat buffer, since ``param.grad`` is a view into it);
2. when a bucket is complete and every bucket before it has been launched, its
   reduction is launched, so all ranks issue collectives in the same order
   whatever their timing;
3. at the end of the backward pass (an autograd engine callback) parameters
   that got no gradient are resolved, the remaining buckets are launched, and
   the reductions are waited for and averaged, as torch DDP does, so code that
   reads gradients after ``backward()`` (clipping, logging) sees the average.

[Note: unused parameters] A parameter may get no gradient in an iteration on
some ranks or on all. Each rank writes, per parameter, whether it holds a
gradient into a few extra elements at the end of the last bucket launched; the
sum over ranks tells every rank which parameters no rank used, and those keep
``grad=None`` exactly as in single-process training. No extra collective, and
no ``find_unused_parameters`` switch: it is always on, for the price of one
element per parameter.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from commsched.backends.base import Backend, Handle
from commsched.buckets import Bucket, compute_bucket_assignment_by_size
from commsched.consistency import broadcast_from_rank0
from commsched.strategy import Strategy


class Phase(enum.Enum):
    IDLE = "idle"
    """No backward pass running; gradients (if any) are final."""
    BACKWARD = "backward"
    """A backward pass is producing gradients and launching reductions."""


class GradientReducer:
    """Buckets, hooks and in-flight reductions of one prepared model."""

    def __init__(
        self,
        module: torch.nn.Module,
        strategy: Strategy,
        backend: Backend,
        process_group: dist.ProcessGroup,
    ):
        self.module = module
        self.strategy = strategy
        self.backend = backend
        self.process_group = process_group
        self.world_size = backend.world_size
        self.phase = Phase.IDLE

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        # Gradients are produced roughly in reverse registration order; bucket
        # that order so the first bucket fills first.
        named.reverse()
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self.buckets = self._build_buckets()
        self._views: list[torch.Tensor] = [torch.empty(0)] * len(self._params)
        self._bucket_of: list[int] = [0] * len(self._params)
        slot_of = {id(p): slot for slot, p in enumerate(self._params)}
        for bucket in self.buckets:
            for param, view in zip(bucket.params, bucket.grad_views):
                slot = slot_of[id(param)]
                self._views[slot] = view
                self._bucket_of[slot] = bucket.index
        self._bucket_param_counts = [len(b.params) for b in self.buckets]

        # Per backward pass.
        self._ready: list[bool] = []
        self._has_grad: list[bool] = [False] * len(self._params)
        self._pending: list[int] = []
        self._next_launch = 0
        self._sync_this_backward = True
        self._unowned_grad_slots: list[int] = []
        self._in_flight: list[tuple[Bucket, Handle]] = []

        self._sync_enabled = True
        self._modules = list(module.modules())
        self._fingerprint = self._take_fingerprint()
        self._snapshot = self._describe_parameters()
        self._hook_handles: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(self._make_grad_hook(slot))
            for slot, param in enumerate(self._params)
        ]
        self._hook_handles.append(module.register_forward_pre_hook(self._before_forward))

    # ------------------------------------------------------------------ setup
    def _build_buckets(self) -> list[Bucket]:
        assignment = compute_bucket_assignment_by_size(
            self._params, self.strategy.bucket_size_limits_bytes
        )
        buckets = []
        for index, slots in enumerate(assignment):
            is_last = index == len(assignment) - 1
            tail = len(self._params) if is_last else 0  # see [Note: unused parameters]
            buckets.append(Bucket(index, [self._params[s] for s in slots], tail_numel=tail))
        return buckets

    def _make_grad_hook(self, slot: int):
        def on_grad_accumulated(param: torch.Tensor) -> None:
            self._on_grad_ready(slot, param)

        return on_grad_accumulated

    def close(self) -> None:
        """Remove every hook; the model trains as a plain local module afterwards."""
        self.synchronize()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    # ------------------------------------------------------------- public API
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def synchronize(self) -> None:
        """Block until every launched reduction is done and averaged."""
        if self.phase is Phase.BACKWARD:
            raise RuntimeError(
                "synchronize() was called during a backward pass; call it after backward() returns"
            )
        self._finish_reductions()

    # ------------------------------------------------------------ hot path
    def _on_grad_ready(self, slot: int, param: torch.Tensor) -> None:
        if self.phase is not Phase.BACKWARD:
            self._begin_backward()
        view = self._views[slot]
        grad = param.grad
        if grad is not view:
            # The gradient was None before this backward (zero_grad(set_to_none=True))
            # or replaced by the user: move it into the bucket once.
            self._check_gradient_kind(slot, grad)
            view.copy_(grad)
            param.grad = view
        self._ready[slot] = True
        if not self._sync_this_backward:
            return
        self._has_grad[slot] = True
        bucket = self._bucket_of[slot]
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0 and bucket == self._next_launch:
            self._launch_ready_buckets()

    def _check_gradient_kind(self, slot: int, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(
                f"parameter '{self._names[slot]}' received a sparse gradient; commsched reduces "
                "dense gradients only. Use nn.Embedding(..., sparse=False)."
            )
        if grad.requires_grad:
            raise RuntimeError(
                f"parameter '{self._names[slot]}' received a gradient that requires grad "
                "(backward(create_graph=True)); higher-order gradients cannot be reduced. "
                "Compute them with torch.autograd.grad on an unprepared copy of the model."
            )

    def _begin_backward(self) -> None:
        if self._in_flight:
            self._finish_reductions()
        self.phase = Phase.BACKWARD
        self._sync_this_backward = self._sync_enabled
        self._ready = [False] * len(self._params)
        self._pending = list(self._bucket_param_counts)
        self._next_launch = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _launch_ready_buckets(self) -> None:
        buckets = self.buckets
        while self._next_launch < len(buckets) and self._pending[self._next_launch] == 0:
            bucket = buckets[self._next_launch]
            if bucket.tail.numel():
                bucket.tail.copy_(torch.tensor(self._has_grad, dtype=bucket.dtype))
            self._in_flight.append((bucket, self.backend.launch(bucket)))
            self._next_launch += 1

    def _end_backward(self) -> None:
        """Runs once the autograd engine has finished this backward pass."""
        self.phase = Phase.IDLE
        if not self._sync_this_backward:
            return
        if not all(self._ready):
            self._resolve_unready_parameters()
        self._launch_ready_buckets()
        assert self._next_launch == len(self.buckets), "every bucket must be launched"
        self._finish_reductions()

    def _resolve_unready_parameters(self) -> None:
        for slot, ready in enumerate(self._ready):
            if ready:
                continue
            param, view = self._params[slot], self._views[slot]
            grad = param.grad
            if grad is None:
                view.zero_()
                self._unowned_grad_slots.append(slot)
            elif grad is not view:
                view.copy_(grad)
                param.grad = view
            self._has_grad[slot] = grad is not None
            self._ready[slot] = True
            self._pending[self._bucket_of[slot]] -= 1

    def _finish_reductions(self) -> None:
        if not self._in_flight:
            return
        in_flight, self._in_flight = self._in_flight, []
        for bucket, handle in in_flight:
            handle.wait(self.strategy.timeout_s)
            if self.world_size > 1:
                bucket.flat.div_(self.world_size)
        if self._unowned_grad_slots:
            used_by_some_rank = self.buckets[-1].tail.tolist()
            for slot in self._unowned_grad_slots:
                if used_by_some_rank[slot] > 0:
                    self._params[slot].grad = self._views[slot]
            self._unowned_grad_slots.clear()

    # -------------------------------------------------------- forward checks
    def _before_forward(self, module: torch.nn.Module, args: object) -> None:
        if self.phase is Phase.BACKWARD:
            raise RuntimeError(
                "the previous backward pass did not finish (it raised an exception), so some "
                "gradient reductions never ran and the ranks are out of step. Restart training "
                "from a checkpoint."
            )
        if self._take_fingerprint() != self._fingerprint:
            raise RuntimeError(self._explain_parameter_change())
        if (
            self.strategy.broadcast_buffers
            and self.world_size > 1
            and self._sync_enabled
            and torch.is_grad_enabled()
        ):
            buffers = [b for m in self._modules for b in m._buffers.values() if b is not None]
            if buffers:
                broadcast_from_rank0(buffers, self.process_group, self.strategy.timeout_s)

    def _take_fingerprint(self) -> list[object]:
        """Cheap identity of the module tree and its trainable parameters."""
        fingerprint: list[object] = []
        for module in self._modules:
            fingerprint.extend(map(id, module._modules.values()))
            for param in module._parameters.values():
                if param is None:
                    fingerprint.append(None)
                else:
                    fingerprint.append((id(param), param.requires_grad, param.shape))
        return fingerprint

    def _describe_parameters(self) -> dict[str, tuple[int, bool, tuple[int, ...]]]:
        return {
            name: (id(p), p.requires_grad, tuple(p.shape))
            for name, p in self.module.named_parameters()
        }

    def _explain_parameter_change(self) -> str:
        before, now = self._snapshot, self._describe_parameters()
        changes = [f"'{n}' was added" for n in now if n not in before]
        changes += [f"'{n}' was removed" for n in before if n not in now]
        for name in before.keys() & now.keys():
            (old_id, old_grad, old_shape), (new_id, new_grad, new_shape) = before[name], now[name]
            if old_id != new_id:
                changes.append(f"'{name}' was replaced by a new Parameter")
            elif old_grad != new_grad:
                changes.append(f"'{name}' changed requires_grad from {old_grad} to {new_grad}")
            elif old_shape != new_shape:
                changes.append(f"'{name}' changed shape from {old_shape} to {new_shape}")
        if not changes:
            changes.append("a submodule was added, removed or replaced")
        return (
            "the model's parameters changed after commsched.prepare(): "
            + "; ".join(sorted(changes))
            + ". Gradient buckets are built once, at prepare(); make every change "
            "(adding, removing, replacing, freezing or resizing parameters) before "
            "calling commsched.prepare()."
        )


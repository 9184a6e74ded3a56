"""Gradients accumulated straight into their buckets: views handed out as backward starts.

[Note: views ahead of backward] After ``zero_grad(set_to_none=True)`` (torch's
default) every ``.grad`` is None, so autograd gives each parameter a new
gradient tensor and the gradient hook copies it into the bucket: a Python call
and a kernel per parameter per iteration. On a GPU whose host launches kernels
no faster than the GPU runs them, that is time added to every step (ViT-B/16
on an H100: about 150 copies, several milliseconds). So when the gradient of the
model's output is computed (the first thing a backward pass through the model
does, before any parameter's gradient exists), each parameter whose ``.grad``
is None gets its bucket view, zeroed, and autograd accumulates into it in
place. Only buckets whose previous reduction and update are done are touched;
the others keep the copy. A parameter that then gets no gradient goes back to
None when the pass ends, as does every one when the backward pass reaches no
parameter at all (``torch.autograd.grad`` on inputs), so ``p.grad is None``
means what it means in single-process training.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from commsched.layout.grad_layout import GradLayout


def sparse_gradient_slots(module: torch.nn.Module, params: Sequence[torch.nn.Parameter]) -> frozenset[int]:
    """Slots of parameters whose module makes sparse gradients (``nn.Embedding(sparse=True)``).

    They keep the copy, whose check refuses sparse gradients with the fix: accumulated
    into a dense view they would silently become dense.
    """
    sparse = {id(p) for m in module.modules() if getattr(m, "sparse", False) is True
              for p in m.parameters(recurse=False)}
    return frozenset(slot for slot, param in enumerate(params) if id(param) in sparse)


def hand_out_views(layout: GradLayout, settled: Callable[[int], bool], keep: frozenset[int]) -> frozenset[int]:
    """Give every parameter whose ``.grad`` is None its bucket view, zeroed; return their slots.

    ``settled(bucket)``: nothing in flight or pending reads or writes that bucket.
    ``keep``: slots left as they are. A bucket whose gradients are all None is
    zeroed with one kernel.
    """
    handed: list[int] = []
    params, views = layout.params, layout.views
    for bucket, slots in zip(layout.buckets, layout.bucket_slots, strict=True):
        empty = [slot for slot in slots if params[slot].grad is None and slot not in keep]
        if not empty or not settled(bucket.index):
            continue
        if len(empty) == len(slots):
            bucket.flat[: bucket.grad_numel].zero_()
        else:
            for slot in empty:
                views[slot].zero_()
        for slot in empty:
            params[slot].grad = views[slot]
        handed.extend(empty)
    return frozenset(handed)


def take_back(layout: GradLayout, slots: Iterable[int]) -> None:
    """The pass reached none of these parameters: ``.grad`` is None again."""
    for slot in slots:
        param = layout.params[slot]
        if param.grad is layout.views[slot]:
            param.grad = None


class ViewsAhead:
    """Hands the bucket views out as a backward pass starts and takes back those it did not reach."""

    def __init__(self, module: torch.nn.Module, params: Sequence[torch.nn.Parameter]):
        self._sparse_slots = sparse_gradient_slots(module, params)
        self._handed: frozenset[int] = frozenset()
        """Slots handed their views as the coming backward pass starts."""

    def hand_out(self, layout: GradLayout, settled: Callable[[int], bool], backward_over: Callable[[], bool]) -> None:
        """The backward pass starts, before any gradient hook: hand out the views of ``settled``
        buckets; when it ends, ``backward_over()`` telling that no gradient arrived, take them back."""
        handed = hand_out_views(layout, settled, self._sparse_slots)
        if not handed:
            return
        self._handed = handed

        def take_back_unused() -> None:
            """The backward pass is over: if it reached no parameter, no view handed out stays ``.grad``."""
            unused, self._handed = self._handed, frozenset()
            if unused and backward_over():
                take_back(layout, unused)

        torch.autograd.Variable._execution_engine.queue_callback(take_back_unused)

    def taken(self) -> frozenset[int]:
        """The slots handed out for the pass that begins now (its first gradient arrived); none are left."""
        handed, self._handed = self._handed, frozenset()
        return handed

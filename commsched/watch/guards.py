"""Misuse that would make training silently wrong, turned into errors that say what to do.

[Note: gradients the user touches] With forward overlap, reductions may still
be in flight when ``backward()`` returns, so a gradient changed in place before
``step()`` (clipping, AMP unscaling) would race with them. The first
`WARMUP_ITERATIONS` run without overlap and compare the version counters of
the gradient buffers at ``step()`` with those at issue: a loop that changes
gradients keeps running without overlap (logged once). A change seen later,
with reductions in flight, stops training with `gradients_touched_error`.
"""

from __future__ import annotations

import torch

GRADIENTS_CHANGED_REASON = (
    "gradients are modified between backward() and step() (clip_grad_norm_, GradScaler.unscale_, ...), "
    "which needs every reduction finished first"
)


BACKWARD_UNFINISHED = (
    "the previous backward pass did not finish (it raised an exception), so some gradient reductions never "
    "ran and the ranks are out of step. Restart training from a checkpoint."
)


def gradients_touched_error() -> RuntimeError:
    return RuntimeError(
        "gradients were modified between backward() and step() while their reductions were "
        "still in flight (Strategy.overlap_forward=True), so this step would be wrong. Call "
        "optimizer.synchronize() before changing gradients (clip_grad_norm_, GradScaler."
        "unscale_), or use Strategy(overlap_forward=False)."
    )


def grad_scaler_after_warmup_error() -> RuntimeError:
    return RuntimeError(
        "a torch.amp.GradScaler stepped this optimizer for the first time after warm-up, while gradient "
        "reductions were still in flight (Strategy.overlap_forward=True): its check for infs/NaNs read "
        "gradients not yet averaged, so this step would be wrong. Use the GradScaler from the first "
        "iteration (commsched then updates at step(), once every reduction is done), call "
        "optimizer.synchronize() before scaler.step(optimizer), or use Strategy(overlap_forward=False)."
    )


def whole_gradients_needed_error(what: str) -> RuntimeError:
    """After warm-up, with reduce-scattered gradients, a loop that needs them whole (see [Note:
    reduce-scattered buckets] in `commsched.comm.reduce_scatter`)."""
    return RuntimeError(
        f"{what} for the first time after warm-up, but with AllReduce(shard_optimizer=True, reduce_scatter=True) "
        "each rank then holds the averaged gradients of its own chunk only (param.grad reads NaN elsewhere), so "
        "this step would be wrong. Do it from the first iteration on (warm-up sees it and gradients are then "
        "all-reduced whole), or use AllReduce(shard_optimizer=True), which always all-reduces them."
    )


def scattered_gradients_left_error() -> RuntimeError:
    return RuntimeError(
        "a backward pass began while param.grad still holds the gradients of the last one, which were "
        "reduce-scattered (AllReduce(shard_optimizer=True, reduce_scatter=True)): each rank holds only its own "
        "chunk averaged, NaN elsewhere, so adding new gradients to them would be wrong. Call "
        "optimizer.zero_grad() after each step(); to accumulate several backward passes, run all but the last "
        "under model.no_sync(); or use AllReduce(shard_optimizer=True), which all-reduces the gradients whole."
    )


def gradient_twice_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"parameter '{name}' received its gradient twice in one backward pass: it is used both inside "
        "and outside a block checkpointed with torch.utils.checkpoint(..., use_reentrant=True), whose "
        "gradients come from a backward pass of their own. Use use_reentrant=False, or keep each "
        "parameter on one side of the checkpoint."
    )


def synchronize_during_backward_error() -> RuntimeError:
    return RuntimeError("synchronize() was called during a backward pass; call it after backward() returns")


def check_gradient_kind(name: str, grad: torch.Tensor) -> None:
    """Only dense, first-order gradients can be reduced."""
    if grad.is_sparse:
        raise RuntimeError(
            f"parameter '{name}' received a sparse gradient; commsched reduces "
            "dense gradients only. Use nn.Embedding(..., sparse=False)."
        )
    if grad.requires_grad:
        raise RuntimeError(
            f"parameter '{name}' received a gradient that requires grad "
            "(backward(create_graph=True)); higher-order gradients cannot be reduced. "
            "Compute them with torch.autograd.grad on an unprepared copy of the model."
        )

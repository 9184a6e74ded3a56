"""Hugging Face: commsched in place of torch DDP under accelerate and transformers' `Trainer`.

Accelerate::

    accelerator = CommschedAccelerator(gradient_accumulation_steps=2)   # was: Accelerator(...)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

Transformers::

    trainer = CommschedTrainer(model=model, args=args, train_dataset=data)   # was: Trainer(...)

Both take ``strategy=commsched.Strategy(...)`` (default ``Strategy()``).

Why a subclass of `Accelerator`
-------------------------------
``Accelerator.prepare_model`` wraps every trainable model in
``torch.nn.parallel.DistributedDataParallel`` inside one long method, with no
hook to hand the model to another wrapper, and ``commsched.prepare`` needs the
model *and* its optimizer together, while accelerate prepares them one by one
(``prepare_model``, then ``prepare_optimizer``). `CommschedAccelerator`
overrides those public methods only:

- ``prepare_model`` runs accelerate's own preparation as for evaluation
  (``evaluation_mode=True``: device placement, autocast, ``torch.compile``),
  which is everything but the DDP wrap, and keeps the model aside;
- ``prepare_optimizer`` finds which of those models the optimizer's parameters
  belong to and calls ``commsched.prepare(model, optimizer, strategy)`` before
  accelerate wraps the optimizer in its ``AcceleratedOptimizer`` (which then
  steps the prepared optimizer). ``prepare`` hands models to accelerate before
  optimizers, whatever the order of its arguments, so that one call pairs them;
- ``clip_grad_norm_``, ``clip_grad_value_`` and ``unscale_gradients`` first
  call the prepared optimizers' ``synchronize()``: with forward overlap,
  gradients may still be in flight when ``backward()`` returns.

Everything else is accelerate's: ``no_sync``/``accumulate`` call the prepared
model's ``no_sync()`` (as they call DDP's), ``unwrap_model`` returns the model
itself (commsched adds no wrapper), and checkpoints keep their format. Patching
``DistributedDataParallel`` in accelerate's namespace instead would change
every accelerator in the process and hand back objects that are not DDP where
DDP's interface (``.module``, its reducer) is expected.

Why `CommschedTrainer` changes the class of the Trainer's accelerator
---------------------------------------------------------------------
``Trainer.create_accelerator_and_postprocess`` builds a plain ``Accelerator``
from many training arguments. `CommschedTrainer` lets it, then turns that very
object into a `CommschedAccelerator` (the subclass adds no constructor state of
its own but the strategy), so every argument the Trainer derives keeps its
meaning and nothing is built twice. The Trainer's loop needs nothing else:
it prepares the model and the optimizer in one ``accelerator.prepare`` call,
accumulates under ``accelerator.no_sync``, clips through
``accelerator.clip_grad_norm_`` and saves and resumes through the model's and
the optimizer's ``state_dict``, which commsched keeps current.

Refused at once, naming the fix: DeepSpeed, FSDP (1 and 2), Megatron-LM,
XLA, tensor/context/sequence parallelism and sharded data parallelism of a
``ParallelismConfig``, devices other than CPU and CUDA, DDP communication
hooks, parameter servers (every rank runs the same Trainer; servers run
`commsched.serve`), an optimizer whose parameters span several models, one
whose model was not prepared for training, and gradients computed for a
trainable model that no optimizer was prepared with. With one process,
both classes are accelerate's and transformers' own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from commsched.api import prepare
from commsched.prepared.module import CommschedModule
from commsched.prepared.optimizer import CommschedOptimizer
from commsched.strategy import Strategy

__all__ = ["CommschedAccelerator", "CommschedTrainer"]  # noqa: F822 - CommschedTrainer: module __getattr__

_STOCK = "use accelerate's own Accelerator (transformers' own Trainer) for it, or train without it to use commsched"

_DDP_SETTINGS = {"bucket_cap_mb": "bucket_cap_mb", "broadcast_buffers": "broadcast_buffers"}
"""`DistributedDataParallelKwargs` fields with a `Strategy` field of the same meaning."""

_DDP_HOOK_SETTINGS = ("comm_hook", "comm_wrapper")


class CommschedAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` that trains data-parallel with commsched instead of torch DDP.

    Takes accelerate's arguments, plus ``strategy`` (a `commsched.Strategy`).
    Pass each trainable model and its optimizer to the same ``prepare()``
    call (or the model to an earlier one). Without a ``strategy``, the
    ``bucket_cap_mb`` and ``broadcast_buffers`` of a
    ``DistributedDataParallelKwargs`` handler carry over; its
    ``find_unused_parameters``, ``static_graph`` and ``gradient_as_bucket_view``
    have no counterpart (commsched finds unused parameters by itself, and
    gradients are always views into their buckets).
    """

    def __init__(self, *args: Any, strategy: Strategy | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._commsched_setup(strategy)

    # ------------------------------------------------------------------ setup
    def _commsched_setup(self, strategy: Strategy | None) -> None:
        self._commsched_pending: list[torch.nn.Module] = []
        """Trainable models prepared for training, waiting for their optimizer."""
        self._commsched_active = self._commsched_applies(strategy)
        self._commsched_strategy = self._commsched_resolved(strategy) if self._commsched_active else strategy

    def _commsched_applies(self, strategy: Strategy | None) -> bool:
        """Whether this run is data-parallel over several processes; raises where commsched cannot serve it."""
        if strategy is not None and not isinstance(strategy, Strategy):
            raise ValueError(f"strategy must be a commsched.Strategy, got {type(strategy).__name__}")
        if strategy is not None and strategy.parameter_server:
            raise ValueError(
                "CommschedAccelerator was given Strategy(backend=ParameterServer(...)), but accelerate and the "
                "Trainer run the same training loop on every rank, while parameter-server ranks must run "
                "commsched.serve() instead: use the all-reduce backend (Strategy(), the default) here, or "
                "commsched.prepare()/commsched.serve() in a training loop of your own"
            )
        kind = self.distributed_type
        sharding = {
            DistributedType.DEEPSPEED: "DeepSpeed (a deepspeed_plugin or `deepspeed` config) shards and reduces "
                                       "gradients itself",
            DistributedType.FSDP: "FSDP (an fsdp_plugin or `fsdp` config) shards parameters and reduces "
                                  "gradients itself",
            DistributedType.MEGATRON_LM: "Megatron-LM partitions the model and reduces gradients itself",
            DistributedType.XLA: "XLA reduces gradients inside its compiled graph",
        }
        if kind in sharding or self.is_fsdp2:
            reason = sharding.get(kind, sharding[DistributedType.FSDP])
            raise ValueError(f"CommschedAccelerator cannot be used with {kind.value}: {reason}, and commsched "
                             f"replaces torch DDP only; {_STOCK}")
        config = self.parallelism_config
        if config is not None:
            enabled = [name for name in ("tp", "cp", "sp", "dp_shard")
                       if getattr(config, f"{name}_enabled", False)]
            if enabled:
                raise ValueError(
                    f"CommschedAccelerator cannot be used with a ParallelismConfig that enables "
                    f"{', '.join(enabled)} (sizes above 1): commsched replicates the whole model on every rank "
                    f"and averages gradients over all of them; {_STOCK}"
                )
        if not self.use_distributed or self.num_processes == 1:
            return False
        if kind not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
            raise ValueError(
                f"CommschedAccelerator trains on CPU (gloo) and CUDA GPU (NCCL) process groups, not "
                f"{kind.value}; {_STOCK}"
            )
        return True

    def _commsched_resolved(self, strategy: Strategy | None) -> Strategy:
        """The strategy, with what a `DistributedDataParallelKwargs` handler asks for where it has a counterpart."""
        handler = self.ddp_handler
        asked = handler.to_kwargs() if handler is not None else {}
        hooks = [name for name in _DDP_HOOK_SETTINGS if handler is not None and _set_hook(getattr(handler, name))]
        if hooks:
            raise ValueError(
                f"DistributedDataParallelKwargs sets {', '.join(hooks)}: DDP communication hooks run inside "
                "torch DDP, which CommschedAccelerator does not use. Drop the hook; for bfloat16 gradients on "
                "the wire, pass strategy=commsched.Strategy(reduce_dtype=torch.bfloat16)"
            )
        wanted = {field: asked[name] for name, field in _DDP_SETTINGS.items() if name in asked}
        if strategy is None:
            return Strategy(**wanted)
        for field, value in wanted.items():
            if getattr(strategy, field) != value:
                raise ValueError(
                    f"DistributedDataParallelKwargs sets {field}={value!r} but the commsched strategy has "
                    f"{field}={getattr(strategy, field)!r}: set it in one place (the strategy)"
                )
        return strategy

    # ---------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """As accelerate's, with each trainable model prepared by commsched together with its optimizer.

        Models are handed to accelerate before optimizers (results come back in
        the order given), so that a model and its optimizer pair up whatever
        their order in the call.
        """
        if not self._commsched_active or (device_placement is not None and len(device_placement) != len(args)):
            return super().prepare(*args, device_placement=device_placement)
        order = sorted(range(len(args)), key=lambda i: not isinstance(args[i], torch.nn.Module))
        placement = None if device_placement is None else [device_placement[i] for i in order]
        result = super().prepare(*(args[i] for i in order), device_placement=placement)
        if len(args) <= 1:
            return result
        ordered: list[Any] = [None] * len(args)
        for position, index in enumerate(order):
            ordered[index] = result[position]
        return tuple(ordered)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Accelerate's preparation without the DDP wrap; commsched's comes with the optimizer."""
        if not self._commsched_active or evaluation_mode:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(
                "CommschedAccelerator.prepare() was given a model wrapped in torch DDP: pass the model itself; "
                "commsched takes DDP's place"
            )
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        if (
            not isinstance(prepared, CommschedModule)
            and any(p.requires_grad for p in prepared.parameters())
            and not any(prepared is waiting for waiting in self._commsched_pending)
        ):
            self._commsched_pending.append(prepared)
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """Prepare the optimizer's model with commsched (once), then wrap the optimizer as accelerate does."""
        if self._commsched_active:
            inner = _inner_optimizer(optimizer)
            if not isinstance(inner, CommschedOptimizer):
                model = self._commsched_model_of(inner)
                prepare(model, inner, self._commsched_strategy)  # LR schedulers made before keep counting
                self._commsched_pending = [m for m in self._commsched_pending if m is not model]
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    def _commsched_model_of(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The one model waiting for ``optimizer``: the model its parameters belong to."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owners = [m for m in self._commsched_pending if params & {id(p) for p in m.parameters()}]
        if len(owners) == 1:
            return owners[0]
        name = type(optimizer).__name__
        if owners:
            models = " and ".join(type(m).__name__ for m in owners)
            raise ValueError(
                f"the {name} passed to CommschedAccelerator.prepare() has parameters of several models ({models}): "
                "commsched prepares each model with its own optimizer. Build one optimizer per model, or make "
                "the models submodules of one torch.nn.Module and prepare that"
            )
        raise ValueError(
            f"the {name} passed to CommschedAccelerator.prepare() belongs to no model prepared for training with "
            "it: pass the model (itself, not wrapped in DataParallel or DDP) to the same prepare() call as its "
            "optimizer, or to an earlier one, not with evaluation_mode=True; a model prepared by "
            "commsched.prepare() beforehand comes with its prepared optimizer"
        )

    def free_memory(self, *objects: Any) -> Any:
        self._commsched_pending = []
        return super().free_memory(*objects)

    def clear(self, *objects: Any) -> Any:
        self._commsched_pending = []
        return super().clear(*objects)

    # ------------------------------------------------------ during training
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        super().backward(loss, **kwargs)
        if self._commsched_pending:
            self._commsched_refuse_unprepared_gradients()

    def _commsched_refuse_unprepared_gradients(self) -> None:
        for model in self._commsched_pending:
            if any(p.grad is not None for p in model.parameters()):
                raise RuntimeError(
                    f"{type(model).__name__} got gradients, but it was prepared without an optimizer, so nothing "
                    "averages them across processes and the ranks drift apart: pass its optimizer to "
                    "CommschedAccelerator.prepare() (with the model, or after it) before training"
                )

    def synchronize(self) -> None:
        """Wait for every pending gradient reduction and update of the prepared optimizers.

        Needed before reading or changing gradients between ``backward()`` and
        ``optimizer.step()`` (the clipping and unscaling methods here do it).
        """
        for optimizer in self._optimizers:
            inner = _inner_optimizer(optimizer)
            if isinstance(inner, CommschedOptimizer):
                inner.synchronize()

    def unscale_gradients(self, optimizer: Any = None) -> None:
        if self._commsched_active:
            self.synchronize()
        super().unscale_gradients(optimizer)

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2) -> Any:
        """As accelerate's (``torch.nn.utils.clip_grad_norm_``), on gradients averaged over every rank."""
        if not self._commsched_active:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        self.synchronize()  # after it, commsched lets gradients change and keeps forward overlap
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        """As accelerate's (``torch.nn.utils.clip_grad_value_``), on gradients averaged over every rank."""
        if not self._commsched_active:
            return super().clip_grad_value_(parameters, clip_value)
        self.synchronize()
        return super().clip_grad_value_(parameters, clip_value)


def _set_hook(value: Any) -> bool:
    """Whether a ``DDPCommunicationHookType`` (or its name) asks for a hook."""
    return str(getattr(value, "value", value)).lower() != "no"


def _inner_optimizer(optimizer: Any) -> Any:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _adopt(accelerator: Accelerator, strategy: Strategy | None) -> CommschedAccelerator:
    """Turn the plain ``Accelerator`` a Trainer built into a `CommschedAccelerator`, in place."""
    if not isinstance(accelerator, CommschedAccelerator):
        if type(accelerator) is not Accelerator:
            raise TypeError(
                f"CommschedTrainer expected the Trainer to build an accelerate.Accelerator, got "
                f"{type(accelerator).__name__}: build a CommschedAccelerator in your create_accelerator_and_postprocess"
            )
        accelerator.__class__ = CommschedAccelerator
    accelerator._commsched_setup(strategy)
    return accelerator  # type: ignore[return-value]


def _trainer_class() -> type:
    """`CommschedTrainer`, defined at first use so that accelerate alone does not import transformers."""
    from transformers import Trainer

    class CommschedTrainer(Trainer):
        """A ``transformers.Trainer`` that trains data-parallel with commsched instead of torch DDP.

        Takes the Trainer's arguments, plus ``strategy`` (a `commsched.Strategy`).
        Mix it into a Trainer subclass by listing it first:
        ``class MyTrainer(CommschedTrainer, SFTTrainer)``. Without a
        strategy, ``ddp_bucket_cap_mb`` and ``ddp_broadcast_buffers`` carry
        over from the training arguments.
        """

        def __init__(self, *args: Any, strategy: Strategy | None = None, **kwargs: Any):
            self.commsched_strategy = strategy
            super().__init__(*args, **kwargs)

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            _adopt(self.accelerator, self.commsched_strategy)

    CommschedTrainer.__module__ = __name__
    CommschedTrainer.__qualname__ = "CommschedTrainer"  # found by name (pickle), through the module's __getattr__
    return CommschedTrainer


def __getattr__(name: str) -> Any:
    if name == "CommschedTrainer":
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


"""PyTorch Lightning: ``Trainer(strategy="commsched")`` trains through commsched instead of torch DDP.

Importing this module registers the strategy under the name ``"commsched"``::

    import commsched.integrations.lightning  # noqa: F401 - registers "commsched"

    trainer = Trainer(strategy="commsched", accelerator="gpu", devices=8)
    # or, with knobs:
    trainer = Trainer(strategy=CommschedStrategy(commsched.Strategy(bucket_cap_mb=50)), ...)

`CommschedStrategy` is Lightning's `DDPStrategy` (launch, ranks, collectives,
checkpoints) with the DDP wrapper replaced by `commsched.prepare`: in
``trainer.fit`` the LightningModule (inside a thin root module that every
``*_step`` call goes through, as it goes through DDP's wrapper) is prepared
with the optimizer ``configure_optimizers`` built, and released at teardown.
See docs/integrations/lightning.md for what is supported and what is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from commsched.api import prepare, release, status
from commsched.prepared.module import CommschedModule
from commsched.status import Status
from commsched.strategy import Strategy

__all__ = ["CommschedStrategy"]

log = logging.getLogger(__name__)

STRATEGY_NAME = "commsched"

_SCALER_CLIPPING = (
    "CommschedStrategy cannot clip gradients with a GradScaler (precision='16-mixed'): commsched unscales "
    "them inside optimizer.step(), after Lightning clips, so the clip would see scaled gradients. Use "
    "precision='bf16-mixed' (no scaler), or drop gradient_clip_val"
)

_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")
"""Hooks Lightning runs between ``backward()`` and ``step()``, where gradients are read."""


class CommschedStrategy(DDPStrategy):
    """Lightning's DDP strategy with commsched in place of ``DistributedDataParallel``.

    Args:
        strategy: commsched's knobs (``commsched.Strategy()`` when None); all-reduce backend only.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as for ``DDPStrategy``.

    torch DDP's own options (``find_unused_parameters``, ``static_graph``, communication hooks,
    model averaging) are refused: their commsched counterparts are fields of ``commsched.Strategy``.
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        strategy: Strategy | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        if ddp_kwargs:
            raise TypeError(
                f"CommschedStrategy does not take torch DDP's arguments {sorted(ddp_kwargs)}: commsched "
                "replaces DistributedDataParallel. Set commsched's knobs instead, with "
                "CommschedStrategy(commsched.Strategy(...)) (bucket_cap_mb, reduce_dtype, ...); unused "
                "parameters need no flag"
            )
        strategy = Strategy() if strategy is None else strategy
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a commsched.Strategy, got {type(strategy).__name__}")
        if strategy.parameter_server:
            raise ValueError(
                "CommschedStrategy does not run commsched's parameter-server backend: its server ranks "
                "call commsched.serve() instead of training, which Lightning's Trainer cannot do. Use the "
                "default backend (commsched.AllReduce()), or a plain training loop with "
                "commsched.prepare()/serve() for parameter servers"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._commsched = strategy
        self._accumulating = False
        self._sync_after_backward: bool | None = None
        """Whether gradients are read before ``step()`` (decided at the first backward of a fit)."""
        self._prepared_optimizer: Any = None
        """The optimizer given to ``commsched.prepare`` (None outside fit, or without one)."""
        self._clipping_plugin: Precision | None = None
        """The precision plugin whose ``clip_gradients`` `_settled_clipping` replaced for this fit."""
        self._interrupted = False

    @property
    def commsched_strategy(self) -> Strategy:
        """The ``commsched.Strategy`` models are prepared with."""
        return self._commsched

    def commsched_status(self) -> Status:
        """``commsched.status()`` of the model being trained (in ``trainer.fit``, before teardown)."""
        if not isinstance(self.model, CommschedModule):
            raise RuntimeError(
                "CommschedStrategy has no prepared model now: it prepares one when trainer.fit() sets up "
                "and releases it at teardown; call commsched_status() from a hook that runs during fit "
                "(e.g. on_train_end)"
            )
        return status(self.model)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Trainer) -> None:
        """DDPStrategy's setup, with ``commsched.prepare`` once the optimizer exists instead of a DDP wrapper."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            self._check_supported(trainer)
            _optimizers_to_device(self.optimizers, self.root_device)
            self._prepare()
        else:
            # Nothing to reduce: start every rank from rank 0's values, as DDPStrategy does.
            _sync_module_states(self.model)
        self.setup_precision_plugin()

    def _check_supported(self, trainer: Trainer) -> None:
        """Refuse, at once and on every rank, what commsched cannot train under Lightning."""
        if len(self.optimizers) > 1:
            raise ValueError(
                f"CommschedStrategy trains a model with one optimizer, but configure_optimizers() returned "
                f"{len(self.optimizers)}: commsched.prepare() takes the one optimizer that applies the averaged "
                "gradients, and another one would step on gradients still being reduced. Put every parameter "
                "into one optimizer (param groups may each have their own lr), or use strategy='ddp'"
            )
        plugin = self.precision_plugin
        if isinstance(plugin, (FSDPPrecision, DeepSpeedPrecision)):
            raise ValueError(
                f"CommschedStrategy cannot use {type(plugin).__name__}: it belongs to a sharding strategy, and "
                "commsched replicates the whole model on every rank. Use strategy='fsdp' or 'deepspeed' for "
                "sharded training, or a plain precision ('bf16-mixed', '32-true') with commsched"
            )
        if getattr(plugin, "scaler", None) is not None and (trainer.gradient_clip_val or 0) > 0:
            raise ValueError(_SCALER_CLIPPING)
        sharded = [name for name, p in self.lightning_module.named_parameters() if _is_dtensor(p)]
        if sharded:
            raise ValueError(
                f"CommschedStrategy found sharded (DTensor) parameters, e.g. {sharded[0]!r}: commsched "
                "replicates whole parameters. Use strategy='fsdp' or ModelParallelStrategy for a sharded "
                "model, or build it unsharded in configure_model()"
            )

    def _prepare(self) -> None:
        """``commsched.prepare`` the root module with Lightning's optimizer."""
        module = self.lightning_module
        assert module is not None
        optimizer = self.optimizers[0] if self.optimizers else None
        if isinstance(optimizer, _MockOptimizer):
            optimizer = None  # configure_optimizers() returned None: gradients are only averaged
        root = _LightningModuleRoot(module)
        prepare(root, optimizer, self._commsched)  # LR schedulers made before it keep counting steps
        self.model = root
        self._prepared_optimizer = optimizer
        self.optimizers = self.optimizers  # Lightning's optimizer wrappers, rebuilt on the prepared class
        if optimizer is not None:
            self._clipping_plugin = self.precision_plugin
            self._clipping_plugin.clip_gradients = _settled_clipping(  # type: ignore[method-assign]
                self._clipping_plugin, optimizer)
        self._sync_after_backward = None
        self._interrupted = False

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Never a DDP wrapper: the model is prepared in `setup`, once its optimizer exists."""
        return model

    @override
    def configure_ddp(self) -> None:
        """Nothing to wrap: `setup` prepares the model with commsched."""

    # --------------------------------------------------------------- training
    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: the micro-batches' backward passes run under the model's ``no_sync()``."""
        if not isinstance(self.model, CommschedModule):
            yield None
            return
        accumulating, self._accumulating = self._accumulating, True
        try:
            with self.model.no_sync():
                yield None
        finally:
            self._accumulating = accumulating

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward, then ``synchronize()`` where code may read gradients before ``step()``.

        That is: ``on_after_backward`` or ``on_before_optimizer_step`` overridden (in the module or
        a callback), ``configure_gradient_clipping`` overridden, or manual optimization. Every
        reader then sees averaged gradients. Lightning's own clipping waits by itself
        (`_settled_clipping`); micro-batches under ``no_sync()`` have nothing in flight.
        """
        self.pre_backward(closure_loss)
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        prepared = self._prepared_optimizer
        if prepared is not None and not self._accumulating and self._gradients_read(module):
            prepared.synchronize()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _gradients_read(self, module: LightningModule) -> bool:
        """Whether this fit reads gradients between backward and step (decided once per fit)."""
        if self._sync_after_backward is None:
            trainer = module.trainer
            callbacks: list[Callback] = list(trainer.callbacks)
            self._sync_after_backward = (
                not module.automatic_optimization
                or is_overridden("configure_gradient_clipping", module)
                or any(is_overridden(hook, module) for hook in _GRADIENT_HOOKS)
                or any(is_overridden(hook, cb) for cb in callbacks for hook in _GRADIENT_HOOKS)
            )
        return self._sync_after_backward

    # --------------------------------------------------------------- teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._interrupted = True
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """``commsched.release`` the model (waiting for what is in flight), then DDPStrategy's teardown."""
        root = self.model
        if isinstance(root, CommschedModule):
            try:
                release(root)
            except Exception:
                if not self._interrupted:
                    raise
                log.warning("commsched: release after an interrupted fit failed", exc_info=True)
            finally:
                self.model = self.lightning_module
                self._prepared_optimizer = None
                if self._clipping_plugin is not None:
                    self._clipping_plugin.__dict__.pop("clip_gradients", None)
                    self._clipping_plugin = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            STRATEGY_NAME, cls, description="Data-parallel training with commsched instead of torch DDP",
            override=True,
        )


class _LightningModuleRoot(torch.nn.Module):
    """The module commsched prepares: the LightningModule as its one child.

    Lightning calls every ``*_step`` through the forward of the module it trains
    when that is not the LightningModule itself (as with DDP's wrapper), so
    commsched's hooks on the root see each step's forward pass and its output.
    """

    def __init__(self, module: LightningModule) -> None:
        super().__init__()
        self.lightning_module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.lightning_module(*args, **kwargs)


def _settled_clipping(plugin: Precision, prepared: Any) -> Callable[..., None]:
    """``plugin.clip_gradients`` for the prepared optimizer: on averaged gradients, keeping forward overlap.

    Lightning clips ``param.grad`` in place right after backward, while
    reductions may still be in flight: this waits for them first
    (``synchronize()``, after which commsched lets gradients change without
    turning forward overlap off), then clips as Lightning's base plugin does.
    Lightning's ``MixedPrecision`` refuses to clip for any optimizer that takes
    a GradScaler's scale in ``step()``, as a prepared one does, even without a
    scaler (bf16); that refusal is for scaled gradients, so it is kept only
    where there is a scaler (16-mixed), with commsched's reason and the fix.
    """
    original = plugin.clip_gradients

    def clip_gradients(
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if getattr(optimizer, "_optimizer", optimizer) is not prepared or clip_val <= 0:
            return original(optimizer, clip_val, gradient_clip_algorithm)
        if getattr(plugin, "scaler", None) is not None:
            raise ValueError(_SCALER_CLIPPING)
        prepared.synchronize()
        return Precision.clip_gradients(plugin, optimizer, clip_val, gradient_clip_algorithm)

    return clip_gradients


def _is_dtensor(tensor: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(tensor, DTensor)


def _register() -> None:
    if STRATEGY_NAME not in StrategyRegistry:
        CommschedStrategy.register_strategies(StrategyRegistry)


_register()

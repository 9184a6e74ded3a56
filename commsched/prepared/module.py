"""What a prepared model gains: ``no_sync()``, ``Join``, and plain copies.

Its ``state_dict()`` and ``load_state_dict()``, and those of every submodule,
wait for pending updates through hooks (`commsched.engine.hooks.ModelHooks`).
"""

from __future__ import annotations

import copy
import copyreg
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, SupportsIndex

import torch
from torch.distributed.algorithms.join import Joinable, JoinHook

# At run time, not only for type checkers: frameworks read the annotations of the
# classes commsched mixes in (transformers calls typing.get_type_hints on each model class).
from commsched.engine.reducer import GradientReducer
from commsched.prepared.mixing import mixed_class
from commsched.update.kinds import USER_CLASS_ATTRIBUTE

_PACKAGE = __name__.partition(".")[0]


class PlainCopies:
    """Copies and pickles of a prepared model (or of its raw view) are plain modules of the user's class."""

    _commsched_reducer: GradientReducer

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.nn.Module:
        """A plain copy (EMA, SWA, evaluation): the user's class, without commsched.

        The reducer holds process groups, which cannot be copied, and a copy
        still hooked to it would wait for the original's buckets. Pending
        updates run first, so the copy holds the parameters ``step()`` made.
        The original keeps training.
        """
        self._commsched_reducer.synchronize()
        return _plain_copy(self, memo)  # type: ignore[arg-type]

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """Whole-module pickling (``torch.save(model)``) stores a plain module of the user's class.

        The mixed class cannot be found by name when loading, and the reducer
        cannot be pickled. Parameters and buffers are pickled as they are (not
        copied first), after pending updates.
        """
        self._commsched_reducer.synchronize()
        module: torch.nn.Module = self  # type: ignore[assignment]
        shared: dict[int, Any] = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
        reduced = _plain_copy(module, shared).__reduce_ex__(protocol)
        if isinstance(reduced, tuple) and reduced[0] is copyreg.__newobj__:
            # pickle lets __newobj__ rebuild only the pickled object's own (mixed) class.
            cls, *new_args = reduced[1]
            reduced = (cls.__new__, (cls, *new_args), *reduced[2:])
        return reduced


class RawModel(PlainCopies):
    """Mixed into the class of a prepared model's raw view, ``model.module``: see [Note: model.module]."""


RAW_VIEW_ATTRIBUTE = "_commsched_raw_view"
"""In a prepared model's ``__dict__``: its raw view, or None where it has none (under the drop-in wrapper)."""

# [Note: model.module] Code written for torch DDP reaches the model it trains
# through ``ddp.module`` (``raw_model = model.module`` in nanoGPT, torchvision's
# ``model_without_ddp``), and code that takes any wrapper off unwraps until there
# is no ``.module`` (timm's and transformers' ``unwrap_model``, ``while
# hasattr(m, "module")``). prepare() keeps the model itself, so ``.module``
# cannot be a wrapped model; were it the model itself, the unwrapping would
# never end. So it is the model's raw view: an object of the user's own class
# (named as it, with no ``.module``) that shares the model's ``__dict__``, so
# the same parameters, buffers, submodules, hooks and attributes, read or set
# through either. Calling it, its ``state_dict()`` and ``load_state_dict()``
# run the model's hooks, so they train and wait for pending updates as the
# model does; copies and pickles of it are plain copies, as the model's are.
# It is made once, at prepare(). Under `commsched.DistributedDataParallel` the
# wrapper's ``.module`` is the prepared model and that has no ``.module``, as
# under torch DDP.


def attach_raw_view(model: torch.nn.Module) -> None:
    """Give the prepared ``model`` its raw view: see [Note: model.module]."""
    user_cls = getattr(type(model), USER_CLASS_ATTRIBUTE)
    cls = mixed_class(RawModel, user_cls, keep_name=True)
    view = cls.__new__(cls)
    view.__dict__ = vars(model)  # shared, not copied: the view is the model under another class
    vars(model)[RAW_VIEW_ATTRIBUTE] = view


def drop_raw_view(model: torch.nn.Module) -> None:
    """``model`` is wrapped by `commsched.DistributedDataParallel`, whose ``.module`` it is: it has none."""
    vars(model)[RAW_VIEW_ATTRIBUTE] = None


def is_prepared(model: object) -> bool:
    """Whether ``model`` is a prepared model or the raw view of one."""
    return isinstance(model, CommschedModule | RawModel)


class CommschedModule(PlainCopies):
    """Mixed into the class of a prepared model (the model object itself is kept).

    The model stays the user's own module: same attributes, same ``state_dict``
    keys; ``.module`` is its raw view, for DDP code (see [Note: model.module]).
    It is a ``Joinable`` (registered, not inherited: the mixed class must keep
    the model's object layout): pass it to torch's ``Join`` for uneven inputs
    (see [Note: uneven inputs] in `commsched.engine.join`).
    """

    def join_hook(self, **kwargs: Any) -> JoinHook:
        reducer = self._commsched_reducer
        return reducer.uneven_inputs.hook(reducer)

    @property
    def join_device(self) -> torch.device:
        return self._commsched_reducer.uneven_inputs.device

    @property
    def join_process_group(self) -> Any:
        return self._commsched_reducer.uneven_inputs.process_group

    @property
    def module(self) -> torch.nn.Module:
        """The model's raw view (see [Note: model.module]), for code written for torch DDP's wrapper
        (``raw_model = model.module``) and for code that unwraps until there is no ``.module``.

        A model with an attribute of its own named ``module`` (a submodule) gets
        that, as its own forward expects; prepare() warns about it. A model
        wrapped by `commsched.DistributedDataParallel` has none, as under torch
        DDP: the wrapper's ``.module`` is the model.
        """
        own = own_attribute(self, "module")  # type: ignore[arg-type]
        if own is not _NOT_FOUND:
            return own  # type: ignore[return-value]
        view = vars(self).get(RAW_VIEW_ATTRIBUTE)
        if view is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute 'module': it is wrapped by "
                                 "commsched.DistributedDataParallel, whose .module is this model")
        return view

    @module.setter
    def module(self, value: Any) -> None:
        tables = ("_parameters", "_buffers", "_modules")
        if isinstance(value, torch.nn.Module | torch.nn.Parameter) or any("module" in vars(self)[t] for t in tables):
            torch.nn.Module.__setattr__(self, "module", value)  # type: ignore[arg-type]
        else:
            vars(self)["module"] = value

    @property
    def require_backward_grad_sync(self) -> bool:
        """As torch DDP's attribute: set False to accumulate gradients locally (as inside
        ``no_sync()``), True again for the micro-step whose backward reduces them."""
        return self._commsched_reducer.sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, enabled: bool) -> None:
        self._commsched_reducer.sync_enabled = enabled

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward outside reduces them all.

        As torch DDP's ``no_sync``: run the forward and backward passes of the
        micro-batches inside the context, and the last one outside it.
        """
        with self._commsched_reducer.no_sync():
            yield


_NOT_FOUND = object()


def own_attribute(model: torch.nn.Module, name: str) -> object:
    """``model``'s own parameter, buffer, submodule or plain attribute ``name``, else ``_NOT_FOUND``."""
    state = vars(model)
    for table in ("_parameters", "_buffers", "_modules"):
        if name in state[table]:
            return state[table][name]
    return state.get(name, _NOT_FOUND)


def has_own_attribute(model: torch.nn.Module, name: str) -> bool:
    return own_attribute(model, name) is not _NOT_FOUND


def _plain_copy(model: torch.nn.Module, memo: dict[int, Any]) -> torch.nn.Module:
    """Deep-copy ``model`` as its user's class, leaving out the reducer and commsched's hooks.

    Parameters lose their gradient hooks as torch copies them. Hook tables of
    every submodule are copied after the tree, through the same ``memo``, so
    that a user's own hook bound to a module is bound to that module's copy.
    """
    tables: list[tuple[dict, dict, set[int]]] = []
    for module in model.modules():
        hook_tables = [t for name, t in vars(module).items() if name.startswith("_") and "_hooks" in name
                       and isinstance(t, dict)]
        # One id per registration, also in the with_kwargs / always_called tables beside it.
        ours = {key for table in hook_tables for key, hook in table.items() if _is_commsched_hook(hook)}
        for table in hook_tables:
            stand_in = type(table)()
            memo[id(table)] = stand_in
            tables.append((table, stand_in, ours))
    user_class = getattr(type(model), USER_CLASS_ATTRIBUTE)
    plain = user_class.__new__(user_class)
    memo[id(model)] = plain
    state = {name: value for name, value in model.__getstate__().items()
             if name not in ("_commsched_reducer", RAW_VIEW_ATTRIBUTE)}
    plain.__setstate__(copy.deepcopy(state, memo))
    for table, stand_in, ours in tables:
        stand_in.update(copy.deepcopy([(key, hook) for key, hook in table.items() if key not in ours], memo))
    return plain


def _is_commsched_hook(hook: object) -> bool:
    """Hooks commsched registers (reducer, gates, first forward, trace) are defined in its package."""
    defined_in = getattr(hook, "__module__", None) or ""
    return defined_in == _PACKAGE or defined_in.startswith(_PACKAGE + ".")


Joinable.register(CommschedModule)

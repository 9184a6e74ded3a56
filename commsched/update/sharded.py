"""Sharded optimizer state (ZeRO-1, or ZeRO-2): each rank keeps the state of, and updates, 1/N of every bucket.

[Note: sharded optimizer state] Gradients are averaged as the all-reduce
backend averages them, so every rank holds the full averaged gradients and
every loop that reads or changes them (clipping, penalties, logging) stays
exact. Each rank then runs the optimizer on its chunk of every bucket (see
[Note: shard layout] in `commsched.layout.shards`) with state for that chunk
only, and the updated chunks are all-gathered into every rank's parameters.

The parameters of a bucket live in one flat buffer of the bucket's padded
size (``param.data`` becomes a view into it, the same ``Parameter`` objects),
so the all-gather writes them in place: no copy and no staging buffer. The
all-gathers go on a process group of their own (one per user group, shared by
the models sharded on it), issued in one order on every rank (`update_order`,
the forward order of the buckets): the updates run when the forward pass needs
them, whose timing differs between ranks, and a group shared with anything else
would match operations by arrival. On gloo they go one at a time (see
[Note: one all-gather at a time] in `commsched.update.gather_queue`).

State keeps torch.optim's format wherever it leaves commsched:
``optimizer.state_dict()`` gathers the full per-parameter state (a collective:
every rank calls it), ``load_state_dict()`` takes a full one, saved by any
world size or by plain torch.optim, and keeps this rank's fragments;
``commsched.release`` hands the full state back to the optimizer.

Under torch's ``Join`` a rank out of batches still owns its chunks: it updates
them at each of the others' steps, from a record they send (see [Note: a joined
rank's shard] in `commsched.update.step_records`).

Why ZeRO-1 by default and not ZeRO-2 (reduce-scatter of gradients, which
``AllReduce(reduce_scatter=True)`` turns on: see [Note: reduce-scattered buckets]
in `commsched.comm.reduce_scatter`): full averaged gradients keep every loop
exact (clipping, a ``GradScaler``, gradients read before ``step()``), and on
gloo a reduce-scatter saves little at 2 hosts (docs/records/2026-11-27-reduce-scatter-on-gloo.md).
This policy needs
nothing of its own for it: it reads only its chunk's gradients.

[Note: the first bucket is not sharded] The bucket the forward pass needs
first (the input side's, reduced last in backward) has no computation before
it to hide its all-gather: sharded, each forward pass would begin by waiting
for the end of backward's last reduction, then that bucket's update, then its
all-gather, a round trip that dominates for a small bucket. Where the layout
has more than one bucket and that one holds at most `commsched.layout.shards.WHOLE_FIRST_BUCKET_BYTES`,
every rank keeps its whole state and updates all of it, as the unsharded
backend does (same averaged gradients, same kernel: the same values on every
rank), and no all-gather is needed. It costs at most that bucket's state
again per rank, within the "1/N plus one bucket" that sharding promises.

[Note: a bucket's size bounds sharded state's memory] Beyond the shard, what
sharded state holds at once grows with its largest bucket: gloo's all-gather of
the updated parameters stages a buffer of the gathered bucket's size at every
step, and at a new layout a bucket's old flat buffer lives until the last of
its parameters has moved into the new ones (its state moves a piece at a time:
[Note: resharding one bucket at a time] in `commsched.update.resharding`). So
the configured ``bucket_cap_mb`` bounds the buckets of every layout a sharded
run measures or tunes: the cost model's candidates never include larger whole
buckets (for the unsharded backend it weighs 4x the cap too), nor does the
auto-tuner's space. With Adam on a 25M parameter model at 2 ranks, one such
candidate (a single 100 MiB bucket), then resharded whole, put the peak 190 MiB
above the unsharded backend's, against 98 MiB of state saved.

[Note: a new layout is cut after the backward pass] A new layout comes at the
start of a backward pass (the end of warm-up, the check's and the auto-tuner's
switch points; the first one after the first forward pass). The forward pass's
autograd graph then still holds the parameters' old storage (the tensors it
saved for the backward pass) and its activations are alive: new flat buffers
made there sat beside the old ones at the iteration's peak, every parameter
twice, with the moving state besides. So `attach` only decides the new chunks
(`_PendingCut`); the parameters move into the new flat buffers and the state
into the new fragments at the first update in the new layout (`_settle`), once
that backward pass has freed its graph: each old flat buffer is let go as its
last parameter moves, and what exists twice is about one bucket. The move is
collective (the state's all-gathers), so each rank makes it before the first
collective on the all-gathers' group after `attach`, whatever that is (the first
update's all-gather, `Join`'s record, a state dict, a checkpoint, a release):
every rank issues the same sequence there, so every rank moves at the same place
in it. Until then the parameters are the old flat buffers' views, with the same
values.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from commsched.device import HostSeam, runs_nccl
from commsched.errors import wait_or_raise
from commsched.layout.buckets import view_like
from commsched.layout.shards import BucketShard, Fragment, ShardStatus, first_kept_whole, shard_bucket
from commsched.update import resharding, sharded_checkpoint
from commsched.update.base import Hyperparameters
from commsched.update.fused import BucketUpdater
from commsched.update.gather_queue import QueuedGather, gather_queue_for, gathers_one_at_a_time
from commsched.update.grad_scaling import GradScaling
from commsched.update.kinds import hyperparameter_snapshot, optimizer_kind, unsupported_reason
from commsched.update.sharded_layout import FragmentStates, FullState, ShardCut, StateKinds
from commsched.update.step_records import StepRecords

if TYPE_CHECKING:
    from commsched.layout.grad_layout import GradLayout




class _Place(NamedTuple):
    """Where a bucket's parameters go in its flat buffer (the gradients' bucket, without its buffer)."""

    params: tuple[torch.nn.Parameter, ...]
    offsets: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class _PendingCut(NamedTuple):
    """A new layout's chunks, decided at `ShardedUpdate.attach` and made at the first update in it
    (see [Note: a new layout is cut after the backward pass]). It holds no gradient buffer, so the
    reducer's old buckets can go before new ones are made."""

    places: tuple[_Place, ...]
    shards: list[BucketShard]
    whole_bucket: int | None
    rank: int
    world_size: int


def sharding_refusal(optimizer: torch.optim.Optimizer | None) -> str | None:
    """Why ``optimizer``'s state cannot be sharded, or None."""
    if optimizer is None:
        return ("Strategy(backend=AllReduce(shard_optimizer=True)) shards an optimizer's state, but no "
                "optimizer was given to prepare(); pass it as commsched.prepare(model, optimizer, strategy)")
    reason = unsupported_reason(optimizer)
    if reason is None:
        return None
    return (f"Strategy(backend=AllReduce(shard_optimizer=True)) cannot shard this optimizer's state: {reason}. "
            "Sharding runs torch's SGD, Adam and AdamW kernels on each rank's part of every bucket; use one "
            "of them, or AllReduce() (unsharded), where any optimizer works")


class ShardedUpdate:
    """The update policy of ``AllReduce(shard_optimizer=True)``: see [Note: sharded optimizer state]."""

    overlap_blocker = None
    foreign_step_refusal = None
    per_bucket = True
    join_refusal = None

    def __init__(self, optimizer: torch.optim.Optimizer, fuse_optimizer: bool,
                 gather_group: Callable[[], dist.ProcessGroup], timeout_s: float, seam: HostSeam | None = None):
        """``gather_group``: the process group of the all-gathers, read when used (see
        [Note: process groups at exit] in `commsched.engine.groups`); ``seam``: how a wait for
        an all-gather orders the parameters' device (see [Note: stream-ordered waits] in
        commsched/device.py)."""
        refusal = sharding_refusal(optimizer)
        if refusal is not None:
            raise ValueError(refusal)
        self._optimizer, self._fused, self._group, self._timeout_s = optimizer, fuse_optimizer, gather_group, timeout_s
        self._seam = HostSeam() if seam is None else seam
        self._kind = optimizer_kind(optimizer)
        device = next(p.device for group in optimizer.param_groups for p in group["params"])
        self.sharded = self.state_elsewhere = self
        """It is the sharded state, and keeps it apart from the user's optimizer."""
        self.step_records = StepRecords(self._kind, optimizer, self._group_after_gathers, device, timeout_s)
        """What a rank out of batches under Join learns of the others' steps (see
        [Note: a joined rank's shard] in `commsched.update.step_records`)."""
        self._kinds = StateKinds(optimizer, self._kind)
        self._cut = ShardCut()
        """This rank's chunks of the layout in use (empty until the first layout's move)."""
        self._state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        """Per fragment of a parameter (its view into the flat buffer), the optimizer's state."""
        self._updater: BucketUpdater | None = None
        self._gathers: dict[int, QueuedGather] = {}
        """Per bucket, its all-gather not yet awaited."""
        self._layout: GradLayout | None = None
        """The layout attached, until `detach`: the gradients the updates read."""
        self._pending_cut: _PendingCut | None = None
        """The layout in use, where its chunks are not made yet (see [Note: a new layout is cut after
        the backward pass]); the fields above then describe the layout before it."""
        self._pending_load: str | os.PathLike | None = None
        """A sharded checkpoint to load once the buckets exist (`load` before the first forward)."""
        self.update_order: tuple[int, ...] | None = None
        """Buckets in the order their updates run on every rank (forward order)."""
        self.local_updates: frozenset[int] = frozenset()
        """Buckets whose update gathers nothing: the one every rank updates whole, or all in a world of one."""

    # ------------------------------------------------------------- layout
    def attach(self, layout: GradLayout) -> None:
        """Decide the buckets' chunks; where the buckets hold the same parameters as before (a new
        partitioning, credit or order), chunks and state stay as they are. Otherwise the parameters
        and the state move at the first update in this layout (see [Note: a new layout is cut after
        the backward pass])."""
        self._settle()  # a layout never updated in: its move is made before the next one is decided
        self._layout = layout
        order = tuple(sorted(range(len(layout.buckets)), key=lambda b: (layout.priorities[b], b)))
        whole = _whole_bucket(layout, order)
        unchanged = (bool(self._cut.shards) and [tuple(b.params) for b in layout.buckets] == self._cut.bucket_params
                     and whole == self._cut.whole_bucket)
        self.update_order = order
        if unchanged:
            self._updater = self._bucket_updater(layout)
            self.local_updates = frozenset(s.bucket for s in self._cut.shards if s.world_size == 1)
            self._load_pending_checkpoint()
            return
        group = self._group()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        # The whole bucket is one rank's in a world of one: no padding, nothing to gather.
        shards = [shard_bucket(index, layout.bucket_slots[index], [p.numel() for p in bucket.params],
                               *((0, 1) if index == whole else (rank, world_size)))
                  for index, bucket in enumerate(layout.buckets)]
        self._wait_all_updated()  # the all-gathers in flight are numbered by the old buckets
        places = tuple(_Place(tuple(b.params), tuple(b.offsets), b.dtype, b.flat.device) for b in layout.buckets)
        self._pending_cut = _PendingCut(places, shards, whole, rank, world_size)
        self.local_updates = frozenset(s.bucket for s in shards if s.world_size == 1)

    def _settle(self) -> None:
        """Make the pending layout's chunks: this rank's state moves into its new fragments
        (collective where an old layout had some) and the parameters into the new flat buffers."""
        pending, self._pending_cut = self._pending_cut, None
        if pending is None:
            return
        bucket_params = [place.params for place in pending.places]
        if self._cut.shards:
            self._wait_all_updated()
            state = resharding.reshard_state(self._cut, self._state, self._kinds, bucket_params, pending.shards,
                                             self._group_after_gathers(), self._wait)
        else:
            state = _fragments_of(self._take_optimizer_state(), bucket_params, pending.shards)
        self._make_cut(pending.places, pending.shards, state, pending.whole_bucket, pending.rank, pending.world_size)
        if self._layout is not None:  # else the next attach builds it
            self._updater = self._bucket_updater(self._layout)
        self._load_pending_checkpoint()

    def _bucket_updater(self, layout: GradLayout) -> BucketUpdater:
        """The fused updates of this rank's fragments, on ``layout``'s gradients."""
        return BucketUpdater(
            self._optimizer,
            [[piece for _, piece in fragments] for fragments in self._cut.fragments],
            [[layout.buckets[b].flat[f.bucket_offset:f.bucket_offset + f.numel] for f, _ in fragments]
             for b, fragments in enumerate(self._cut.fragments)],
            [[f.slot for f, _ in fragments] for fragments in self._cut.fragments],
            fused=self._fused, state=self._state,
            bucket_groups=[[self._kinds.group_of.get(id(layout.params[f.slot])) for f, _ in fragments]
                           for fragments in self._cut.fragments],
        )

    def _load_pending_checkpoint(self) -> None:
        """A sharded checkpoint `load_sharded` was given before the buckets existed: loaded now."""
        if self._pending_load is not None:
            checkpoint_id, self._pending_load = self._pending_load, None
            self.load(checkpoint_id)

    def _make_cut(self, places: Sequence[_Place], shards: Sequence[BucketShard], state: FragmentStates,
                  whole: int | None, rank: int, world_size: int) -> None:
        """New chunks: the parameters move into one flat buffer per bucket, and this rank's
        fragments take their ``state``; of bucket ``whole``, every rank holds everything."""
        # The old cut goes first: each old flat buffer is then let go as its last parameter moves.
        self._cut = cut = ShardCut(list(shards), rank=rank, world_size=world_size, whole_bucket=whole)
        self._state = defaultdict(dict)
        for index, (place, shard) in enumerate(zip(places, shards, strict=True)):
            flat = torch.zeros(shard.padded_numel, dtype=place.dtype, device=place.device)
            with torch.no_grad():
                for param, offset in zip(place.params, place.offsets, strict=True):
                    view = view_like(flat, offset, param)
                    view.copy_(param.detach())
                    param.data = view
            fragments = []
            for number, fragment in enumerate(shard.fragments):
                piece = flat[fragment.bucket_offset:fragment.bucket_offset + fragment.numel]
                fragments.append((fragment, piece))
                if (index, number) in state:
                    self._state[piece] = state.pop((index, number))
            cut.flats.append(flat)
            cut.bucket_params.append(place.params)
            cut.fragments.append(fragments)

    def detach(self) -> None:
        """The buckets are about to be laid out anew: let go of their gradients. The chunks stay
        until `attach` knows whether they change, and where they do, until the first update in the
        new layout (see [Note: a new layout is cut after the backward pass])."""
        self._updater, self._layout = None, None

    def adopt(self, optimizer: torch.optim.Optimizer, layout: GradLayout | None) -> None:
        raise RuntimeError(
            "Strategy(backend=AllReduce(shard_optimizer=True)) needs its optimizer at prepare(): pass it as "
            "commsched.prepare(model, optimizer, strategy) (the drop-in DistributedDataParallel, which adopts "
            "an optimizer built after it, does not shard)"
        )

    # ------------------------------------------------------------- updates
    def snapshot(self) -> Hyperparameters:
        return hyperparameter_snapshot(self._optimizer, self._kind)

    def update(self, bucket: int, hyperparameters: Hyperparameters, skip_slots: frozenset[int],
               scaling: GradScaling | None) -> None:
        """Update this rank's chunk of ``bucket``, then gather every rank's chunk (see
        [Note: one all-gather at a time] in `commsched.update.gather_queue`)."""
        self._settle()
        self._updater.update(bucket, hyperparameters, skip_slots, scaling)
        shard, flat = self._cut.shards[bucket], self._cut.flats[bucket]
        if shard.world_size == 1:
            return
        mine = flat[shard.start:shard.start + shard.chunk]
        group = self._group()
        self._gathers[bucket] = gather_queue_for(group).submit(
            lambda: resharding.all_gather_single(flat, mine, group=group, async_op=True),
            f"the all-gather of bucket {bucket}'s updated parameters ({shard.padded_numel} elements, "
            f"{shard.chunk} from each rank)",
            gathers_one_at_a_time(flat.device), runs_nccl(group, flat.device))

    def wait_updated(self, bucket: int) -> None:
        """Every rank's updated chunk of ``bucket`` is in the parameters."""
        gather = self._gathers.pop(bucket, None)
        if gather is not None:
            gather_queue_for(self._group()).wait(gather, self._timeout_s, self._seam)

    def _group_after_gathers(self) -> dist.ProcessGroup:
        """The all-gathers' group for any other collective: every queued all-gather starts first, so
        that it comes after them on every rank; so does a pending layout's move, which every rank
        then makes before the same collective on this group."""
        self._settle()
        group = self._group()
        gather_queue_for(group).start_all()
        return group

    def step_on_current_gradients(self, optimizer_step: Callable[[], object], again: bool) -> None:
        """Every bucket updated on ``.grad`` as it is now (averaged: every rank holds the same),
        skipping parameters whose ``.grad`` is None, as torch.optim does."""
        del optimizer_step, again
        self._settle()
        hyperparameters = self.snapshot()
        cut = self._cut
        without = frozenset(f.slot for fragments, params in zip(cut.fragments, cut.bucket_params, strict=True)
                            for f, _ in fragments if params[f.position].grad is None)
        for bucket in self.update_order:
            self.update(bucket, hyperparameters, without, None)
        for bucket in self.update_order:
            self.wait_updated(bucket)

    def before_backward(self, unstepped_backward: bool) -> None:
        """Two backward passes before one step accumulate, as in single-process training."""

    def check_step(self, gradients_changed: bool, scaled: bool) -> None:
        """Gradients are averaged on every rank, as with the all-reduce backend: its guards decide."""

    # ------------------------------------------------------------- state
    def fetch(self) -> None:
        """Before ``optimizer.state_dict()``: the whole state, gathered from every rank (collective)."""
        self._optimizer.state.update(self._gather_state())

    def drop_fetched(self) -> None:
        """After ``state_dict()`` (or a copy): the whole state leaves the optimizer again."""
        for params in self._cut.bucket_params:
            for param in params:
                self._optimizer.state.pop(param, None)

    def push_optimizer_state(self) -> None:
        """After ``optimizer.load_state_dict()``: keep this rank's fragments of the loaded state
        (before the first layout, the state waits in the optimizer, where `attach` takes it)."""
        if not self._cut.shards:
            return
        loaded = self._take_optimizer_state()
        for fragments, params in zip(self._cut.fragments, self._cut.bucket_params, strict=True):
            for fragment, piece in fragments:
                self._state.pop(piece, None)
                full = loaded.get(params[fragment.position])
                if full:
                    self._state[piece] = _slice_state(full, params[fragment.position], fragment)

    def push_parameters(self) -> None:
        """``load_state_dict`` copied the values into the parameters, which every rank holds whole."""

    def save(self, checkpoint_id: str | os.PathLike) -> None:
        """Each rank writes its own fragments with ``torch.distributed.checkpoint`` (collective);
        see `commsched.update.sharded_checkpoint`."""
        self._settle()
        pieces, scalars = sharded_checkpoint.pieces(self._cut, self._state, self._kinds, template=False)
        sharded_checkpoint.save(pieces, scalars, sharded_checkpoint.param_groups(self._optimizer), checkpoint_id,
                                self._group_after_gathers())

    def load(self, checkpoint_id: str | os.PathLike) -> None:
        """Each rank reads its own fragments of what `save` wrote, in any world size and
        layout (collective). Before the first forward pass there are no buckets yet: it happens
        once they exist."""
        self._settle()
        if not self._cut.shards:
            self._pending_load = checkpoint_id
            return
        pieces, scalars = sharded_checkpoint.pieces(self._cut, self._state, self._kinds, template=True)
        groups = sharded_checkpoint.param_groups(self._optimizer)
        loaded, param_groups = sharded_checkpoint.load(pieces, scalars, groups, checkpoint_id,
                                                       self._group_after_gathers())
        torch.optim.Optimizer.load_state_dict(self._optimizer, {"state": {}, "param_groups": param_groups})
        where = sharded_checkpoint.fragment_names(self._cut, self._kinds)
        self._state = defaultdict(dict)
        for name, value in loaded.items():
            for piece, key in where.get(name, ()):
                self._state[piece][key] = value.clone()
        if self._updater is not None:
            self._updater.state = self._state

    def close(self) -> None:
        """``commsched.release``: the optimizer gets its whole state back and steps on its own."""
        self._optimizer.state.update(self._gather_state())
        self._state = defaultdict(dict)
        self._updater = None

    def status(self) -> ShardStatus:
        """The shard layout in use and the state this rank holds, once the buckets exist (of a layout
        not updated in yet, the chunks it will have: see [Note: a new layout is cut after the
        backward pass])."""
        pending = self._pending_cut
        shards = self._cut.shards if pending is None else pending.shards
        if not shards:
            return None
        held = list(self._state.values())
        if pending is None:
            rank, world_size, whole = self._cut.rank, self._cut.world_size, self._cut.whole_bucket
        else:
            rank, world_size, whole = pending.rank, pending.world_size, pending.whole_bucket
            # Before the first layout's move, the state is still the optimizer's.
            held += [self._optimizer.state.get(p, {}) for place in pending.places for p in place.params]
        state_bytes = sum(value.numel() * value.element_size() for state in held
                          for value in state.values() if isinstance(value, torch.Tensor))
        return ShardStatus(world_size, rank, tuple(s.chunk for s in shards), sum(s.owned_numel for s in shards),
                           sum(s.numel for s in shards), state_bytes, () if whole is None else (whole,))

    def _take_optimizer_state(self) -> FullState:
        """The optimizer's own per-parameter state (loaded, or made before prepare()), moved out of it."""
        state = self._optimizer.state
        taken = {param: state.pop(param) for param in list(state) if id(param) in self._kinds.group_of and state[param]}
        return taken

    def _gather_state(self) -> FullState:
        """Every parameter's whole state, on every rank (collective), in tensors of its own."""
        self._settle()
        self._wait_all_updated()
        group = self._group_after_gathers()
        return {param: {key: value.clone() for key, value in state.items()}
                for bucket in range(len(self._cut.shards))
                for param, state in resharding.gather_bucket(self._cut, self._state, self._kinds, bucket, group,
                                                             self._wait).items()}

    def _wait_all_updated(self) -> None:
        for bucket in list(self._gathers):
            self.wait_updated(bucket)

    def _wait(self, work: dist.Work, what: str) -> None:
        wait_or_raise(work, self._timeout_s, f"{what} (sharded optimizer state; every rank must take part: "
                                             "optimizer.state_dict() and commsched.release() are collective)")

def _whole_bucket(layout: GradLayout, order: Sequence[int]) -> int | None:
    """The bucket every rank updates whole, if any: see [Note: the first bucket is not sharded]."""
    if not order:
        return None
    return order[0] if first_kept_whole([bucket.nbytes for bucket in layout.buckets], order[0]) else None


def _fragments_of(held: FullState, bucket_params: Sequence[Sequence[torch.nn.Parameter]],
                  shards: Sequence[BucketShard]) -> FragmentStates:
    """The state of this rank's fragments (of ``shards``) of the parameters ``held`` has."""
    state: FragmentStates = {}
    for index, shard in enumerate(shards):
        params = bucket_params[index]
        for number, fragment in enumerate(shard.fragments):
            full = held.get(params[fragment.position])
            if full:
                state[(index, number)] = _slice_state(full, params[fragment.position], fragment)
    return state


def _slice_state(full: dict[str, Any], param: torch.Tensor, fragment: Fragment) -> dict[str, Any]:
    """A fragment's part of one parameter's whole state (tensors the parameter's size are cut;
    the rest, such as Adam's step, copied)."""
    sliced: dict[str, Any] = {}
    for key, value in full.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == param.numel():
            sliced[key] = _memory_order(value, param)[fragment.start:fragment.end].to(param.dtype).clone()
        elif isinstance(value, torch.Tensor):
            sliced[key] = value.clone()
        else:
            sliced[key] = value
    return sliced


def _memory_order(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value``'s elements, flat, in the order ``param``'s elements lie in memory."""
    if param.is_contiguous():
        return value.reshape(-1).to(param.device)
    dense = torch.empty_like(param, memory_format=torch.preserve_format)
    dense.copy_(value)
    return dense.as_strided((dense.numel(),), (1,), dense.storage_offset())


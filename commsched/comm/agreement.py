"""Making every rank start from the same model and setup, and proving they do.

Collectives are matched by the order they are issued, so a model with a
different parameter list on one rank would pair gradients with the wrong
partner, and a different `Strategy` or optimizer would build other buckets,
partitions, plans or updates: an abort deep inside, a hang, or replicas that
drift apart. Every rank hashes what must agree, the hashes are compared in one
small exchange, and a mismatch stops all ranks with the first entry that
differs and every rank's version of it.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from commsched.device import HostSeam, WorkOrder, runs_nccl
from commsched.errors import wait_or_raise
from commsched.strategy import _FLAT_FIELDS, Strategy

SETTING = " = "
"""Between a setting's name and its value in the entries `describe_setup` returns."""

PER_RANK_FIELDS = ("trace_dir",)
"""Strategy fields that may differ across ranks: each rank writes its own trace file."""

_CHECKS = "the checks prepare() makes on each rank"
_MISSING = "nothing (fewer entries)"


def describe_tensor(kind: str, name: str, tensor: torch.Tensor) -> str:
    """What must agree across ranks for one parameter or buffer."""
    grad = ", requires_grad" if tensor.requires_grad else ""
    return f"{kind} '{name}' shape={tuple(tensor.shape)} dtype={tensor.dtype}{grad}"


def describe_setup(
    strategy: Strategy, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> list[str]:
    """What must agree across ranks besides the model: ``name = value`` entries.

    Every Strategy field but `PER_RANK_FIELDS` (the backend's own fields
    included), the optimizer's class, its param groups, the parameters in each
    and every hyper-parameter. Counts and key lists come before what they
    count, so the first entry that differs is the one to report.
    """
    entries = [_setting(f"Strategy.{f.name}", getattr(strategy, f.name)) for f in fields(strategy)
               if f.name not in (*PER_RANK_FIELDS, *_FLAT_FIELDS, "backend")]
    backend = strategy.backend
    entries.append(_setting("Strategy.backend", type(backend).__name__))
    entries += [_setting(f"Strategy.backend.{f.name}", getattr(backend, f.name)) for f in fields(backend)]
    if optimizer is None:
        return [*entries, f"optimizer class{SETTING}None (no optimizer passed)"]
    cls = type(optimizer)
    entries.append(f"optimizer class{SETTING}{cls.__module__}.{cls.__qualname__}")
    entries.append(f"number of optimizer param_groups{SETTING}{len(optimizer.param_groups)}")
    names = {id(p): name for name, p in model.named_parameters()}
    for index, group in enumerate(optimizer.param_groups):
        where = f"optimizer.param_groups[{index}]"
        keys = sorted(k for k in group if k != "params")
        entries.append(f"number of parameters in {where}{SETTING}{len(group['params'])}")
        entries.append(f"hyper-parameter names of {where}{SETTING}{', '.join(keys)}")
        entries += [f"{where}['params'][{i}]{SETTING}{names.get(id(p), '(not in the model)')!r}"
                    for i, p in enumerate(group["params"])]
        entries += [_setting(f"{where}[{key!r}]", group[key]) for key in keys]
    return entries


def checks_entry(problem: BaseException | None) -> str:
    """The entry that tells the other ranks whether this rank's own checks passed."""
    outcome = "passed" if problem is None else f"{type(problem).__name__}: {problem}"
    return f"{_CHECKS}{SETTING}{outcome}"


def _setting(name: str, value: object) -> str:
    return f"{name}{SETTING}{_value_text(value)}"


def _value_text(value: object) -> str:
    """A value as text that is equal on two ranks exactly when the values are (1 and 1.0 alike)."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_value_text(v) for v in value) + ")"
    if isinstance(value, torch.Tensor):
        return f"tensor({_value_text(value.tolist())}, dtype={value.dtype})"
    text = repr(value)
    return f"<a {type(value).__qualname__}>" if " at 0x" in text else text


@dataclass(frozen=True)
class Difference:
    """The first entry on which the ranks disagree."""

    index: int
    texts: tuple[str, ...]
    """Every rank's version of the entry, in rank order."""
    counts: tuple[int, ...]
    """How many entries each rank has."""

    @property
    def ranks(self) -> list[int]:
        """The ranks whose version differs from rank 0's."""
        return [r for r, text in enumerate(self.texts) if text != self.texts[0]]

    def by_value(self, value: Callable[[str], str] = str) -> str:
        """Each distinct version (through ``value``) with the ranks that hold it."""
        return "; ".join(f"{text} on rank(s) {ranks}" for text, ranks in _holders(map(value, self.texts)))


def _holders(texts: Iterable[str], ranks: Iterable[int] | None = None) -> list[tuple[str, list[int]]]:
    """Each distinct text, first seen first, with the ranks (default: positions) that hold it."""
    holders: dict[str, list[int]] = defaultdict(list)
    for rank, text in zip(itertools.count() if ranks is None else ranks, texts):
        holders[text].append(rank)
    return list(holders.items())


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def first_difference(
    descriptions: Sequence[str], group: dist.ProcessGroup, timeout_s: float | None, what: str
) -> Difference | None:
    """The first entry that is not the same on every rank of ``group``, or None.

    Collective: an exchange of entry counts and 64-bit hashes, and only on a
    mismatch the texts of the entry that differs. With ``timeout_s``, a rank
    that never joins raises `CommunicationTimeout` naming ``what``.
    """
    if dist.get_world_size(group) == 1:
        return None
    count = torch.tensor([len(descriptions)], dtype=torch.int64)
    counts = [int(c) for c in _all_gather(count, group, timeout_s, what)]
    hashes = torch.zeros(max(counts), dtype=torch.int64)
    hashes[: len(descriptions)] = torch.tensor([_hash64(d) for d in descriptions], dtype=torch.int64)
    table = torch.stack(_all_gather(hashes, group, timeout_s, what))  # [rank, entry]
    differs = (table != table[0]).any(dim=0).nonzero()
    if differs.numel() == 0:
        return None
    first = int(differs[0])
    mine = descriptions[first] if first < len(descriptions) else _MISSING
    return Difference(first, tuple(_gather_texts(mine, group, timeout_s, what)), tuple(counts))


def verify_same_across_ranks(
    descriptions: Sequence[str], group: dist.ProcessGroup, timeout_s: float | None = None
) -> None:
    """Raise ``ValueError`` on every rank unless all ranks hold the same model descriptions."""
    difference = first_difference(descriptions, group, timeout_s,
                                  "the agreement on the model's parameters and buffers (prepare)")
    if difference is None:
        return
    rank = dist.get_rank(group)
    others = difference.by_value()
    raise ValueError(
        f"The model differs across ranks at entry #{difference.index}: rank 0 has {difference.texts[0]}; "
        f"rank(s) {difference.ranks} differ (this is rank {rank}, which has {difference.texts[rank]}). "
        f"Each rank's entry: {others}. Entry counts per rank: {list(difference.counts)}. "
        "Build the same model (same parameters, buffers, shapes, dtypes and requires_grad) "
        "on every rank before commsched.prepare()."
    )


def verify_setup_across_ranks(entries: Sequence[str], group: dist.ProcessGroup, timeout_s: float) -> None:
    """Raise ``ValueError`` on every rank unless all ranks hold the same `describe_setup` entries.

    The error names the setting, each value and the ranks holding it.
    """
    difference = first_difference(entries, group, timeout_s, "the agreement on the Strategy and optimizer (prepare)")
    if difference is None:
        return
    rank = dist.get_rank(group)
    name = next(t.split(SETTING, 1)[0] for t in difference.texts if t != _MISSING)
    values = difference.by_value(lambda text: text.split(SETTING, 1)[1] if SETTING in text else text)
    if name == _CHECKS:
        outcomes = [text.split(SETTING, 1)[1] for text in difference.texts]
        failed = [r for r, outcome in enumerate(outcomes) if outcome != "passed"]
        passed = [r for r, outcome in enumerate(outcomes) if outcome == "passed"]
        raise ValueError(
            f"commsched.prepare() failed on rank(s) {failed} (passed on {passed}), so it stops on every "
            f"rank (this is rank {rank}): "
            + "; ".join(f"rank(s) {ranks}: {text}" for text, ranks in _holders([outcomes[r] for r in failed], failed))
            + ". Fix the failing ranks' model or optimizer: prepare() must be called with the same model, "
            "optimizer and Strategy on every rank."
        )
    if name.startswith("Strategy"):
        fix = ("Pass an equal Strategy on every rank (only trace_dir may differ): build it from the "
               "same values, not from per-rank settings.")
    else:
        fix = ("Build the optimizer the same way on every rank: the same class, param groups, "
               "parameters in each group and hyper-parameters.")
    raise ValueError(
        f"commsched.prepare() got a different {name} on different ranks: {values} "
        f"(rank(s) {difference.ranks} differ from rank 0; this is rank {rank}). {fix}"
    )


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup, timeout_s: float | None,
                what: str) -> list[torch.Tensor]:
    gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(gathered, tensor, group=group, async_op=True)
    if timeout_s is None:
        work.wait()
    else:
        wait_or_raise(work, timeout_s, what)
    return gathered


def _gather_texts(text: str, group: dist.ProcessGroup, timeout_s: float | None, what: str) -> list[str]:
    """Every rank's ``text``, in rank order, sent as bytes (never pickled)."""
    data = text.encode()
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [int(n) for n in _all_gather(length, group, timeout_s, what)]
    payload = torch.zeros(max(lengths), dtype=torch.uint8)
    payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else payload[:0]
    gathered = _all_gather(payload, group, timeout_s, what)
    return [bytes(chunk[:n].tolist()).decode() for chunk, n in zip(gathered, lengths)]


@torch.no_grad()
def broadcast_from_rank0(
    tensors: Iterable[torch.Tensor], group: dist.ProcessGroup, timeout_s: float | None = None,
    cpu_group: dist.ProcessGroup | None = None,
) -> None:
    """Overwrite ``tensors`` with rank 0's values (see `broadcast_from`)."""
    broadcast_from(tensors, 0, group, timeout_s, cpu_group)


def broadcast_from(
    tensors: Iterable[torch.Tensor], source: int, group: dist.ProcessGroup, timeout_s: float | None = None,
    cpu_group: dist.ProcessGroup | None = None, seam: HostSeam | None = None,
) -> None:
    """Overwrite ``tensors`` with group rank ``source``'s values, one collective per dtype and device.

    With ``timeout_s``, a peer that never joins raises `CommunicationTimeout`.
    CPU tensors go on ``cpu_group`` where given (the control group of a group
    without a CPU backend; see [Note: control messages] in commsched/comm/side_groups.py).
    With ``seam`` (and ``timeout_s``), the copies of tensors on a GPU are queued after the
    broadcast on the current stream, and the host does not wait (see [Note: stream-ordered
    waits] in commsched/device.py).
    """
    if dist.get_world_size(group) == 1:
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        by_kind[(tensor.dtype, tensor.device)].append(tensor)
    is_source = dist.get_rank(group) == source
    for (_, device), same_kind in by_kind.items():
        flat = torch.cat([t.detach().reshape(-1) for t in same_kind])
        on = cpu_group if cpu_group is not None and device.type == "cpu" else group
        work = dist.broadcast(flat, group=on, group_src=source, async_op=True)
        what = f"the broadcast of {len(same_kind)} tensors from rank {source}"
        if timeout_s is None:
            work.wait()
        elif seam is not None and device.type != "cpu":
            seam.settle(WorkOrder(work, what, runs_nccl(on, device)), timeout_s, what)
        else:
            wait_or_raise(work, timeout_s, what)
        if not is_source:
            with torch.no_grad():
                for tensor, chunk in zip(same_kind, flat.split([t.numel() for t in same_kind])):
                    tensor.copy_(chunk.view_as(tensor))


def highest_rank_still_training(
    training: bool, group: dist.ProcessGroup, timeout_s: float, device: torch.device
) -> int:
    """The source of buffers under ``Join`` (torch DDP's choice): one all-reduce on ``group``, of a
    tensor on ``device`` (one ``group`` takes: NCCL takes no CPU tensor).

    See [Note: uneven inputs] in `commsched.engine.join`.
    """
    if dist.get_world_size(group) == 1:
        return 0
    candidate = torch.tensor([dist.get_rank(group) if training else -1], dtype=torch.int64, device=device)
    work = dist.all_reduce(candidate, dist.ReduceOp.MAX, group=group, async_op=True)
    wait_or_raise(work, timeout_s, "the choice of the rank to copy buffers or parameters from (Join)")
    return int(candidate)


def on_any_rank(flag: bool, group: dist.ProcessGroup, timeout_s: float, what: str) -> bool:
    """Whether ``flag`` holds on some rank of ``group``: one all-reduce (MAX) of it, for a choice
    every rank must make alike (``what`` names it in a timeout)."""
    if dist.get_world_size(group) == 1:
        return flag
    tensor = torch.tensor([int(flag)], dtype=torch.int64)
    wait_or_raise(dist.all_reduce(tensor, dist.ReduceOp.MAX, group=group, async_op=True), timeout_s, what)
    return bool(tensor)

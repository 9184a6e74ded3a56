"""Under ``Join``, with sharded optimizer state: what a rank out of batches learns of the others' steps.

[Note: a joined rank's shard] With the all-reduce backend a rank that ran out
of batches only lends zeros to the others' reductions (see [Note: uneven
inputs] in `commsched.engine.join`); its parameters are replaced at the end.
With sharded state it owns a chunk of every bucket: nobody else holds that
chunk's optimizer state, and every other rank's all-gather waits for the chunk.
So it must update its chunk at each of the others' steps, with the
hyper-parameters their ``step()`` saw (an LR scheduler keeps changing them),
their ``GradScaler``'s scale and verdict, and only when they step at all.

Ranks still training do not know whether any rank has left (``Join`` tells only
the ones that have), so under an enabled ``Join`` every reducing iteration ends
in one small all-reduce (MAX) of a record on the all-gathers' group, issued
before that step's first all-gather: at ``step()``, or at the next forward pass
(or this rank's own first shadowed iteration) when no ``step()`` came. A rank
still training sends what it stepped with; a rank out of batches sends -inf
everywhere and reads the record. Every rank still training sends the same
values, so MAX returns them exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from commsched.errors import communication_timeout, wait_or_raise, wait_work
from commsched.update.grad_scaling import GradScaling
from commsched.update.kinds import Hyperparameters, decode_hyperparameters, encode_hyperparameters, encoded_length

_SENT, _STEPPED, _SCALED, _HAS_SCALE, _GRAD_SCALE, _FOUND_INF = range(6)
"""The record's leading fields; the encoded hyper-parameters follow."""
_HEADER = 6

WAITING_FOR_STEP = (
    "The ranks still training end every iteration that reduces gradients with optimizer.step() or with "
    "their next forward pass; a rank out of batches waits for that under Join with sharded optimizer "
    "state. An iteration whose gradients are never stepped before the loop ends leaves it waiting: step "
    "after every synchronised backward pass, or use AllReduce() without sharding"
)


class StepRecords:
    """The records of one sharded optimizer's steps, on its all-gathers' group; see
    [Note: a joined rank's shard]."""

    def __init__(self, kind: str, optimizer: torch.optim.Optimizer, group: Callable[[], dist.ProcessGroup],
                 device: torch.device, timeout_s: float):
        """``group``: the all-gathers' process group (read when used); ``device``: where its tensors go, and a
        received ``GradScaler`` verdict."""
        self._kind, self._optimizer, self._group, self._device = kind, optimizer, group, device
        self._timeout_s = timeout_s
        self._sent: tuple[dist.Work, torch.Tensor] | None = None

    def _length(self) -> int:
        return _HEADER + encoded_length(self._kind, len(self._optimizer.param_groups))

    def send(self, hyperparameters: Hyperparameters | None, scaling: GradScaling | None) -> None:
        """On a rank still training: this iteration's step (None: no ``step()``), without waiting."""
        self.wait_sent()
        record = torch.zeros(self._length(), dtype=torch.float64, device=self._device)
        record[_SENT] = 1
        if hyperparameters is not None:
            record[_STEPPED] = 1
            record[_HEADER:] = torch.tensor(encode_hyperparameters(self._kind, hyperparameters), dtype=torch.float64)
        if scaling is not None:
            record[_SCALED] = 1
            record[_FOUND_INF].copy_(scaling.found_inf.reshape(()))
            if scaling.grad_scale is not None:
                record[_HAS_SCALE] = 1
                record[_GRAD_SCALE].copy_(scaling.grad_scale.reshape(()))
        work = dist.all_reduce(record, op=dist.ReduceOp.MAX, group=self._group(), async_op=True)
        self._sent = (work, record)

    def send_unstepped(self) -> bool:
        """On a rank that begins shadowing with its last iteration unstepped, once every other rank's
        record of that iteration is out: send this rank's, wait, and tell whether another rank stepped."""
        self.send(None, None)
        _, record = self._sent
        self.wait_sent()
        return bool(record[_STEPPED] == 1)

    def wait_sent(self) -> None:
        """The last record sent is through (every rank took part in it)."""
        if self._sent is not None:
            work, _ = self._sent
            self._sent = None
            wait_or_raise(work, self._timeout_s,
                          "the all-reduce of a step's record under Join (sharded optimizer state)")

    def receive(self, own: Hyperparameters) -> tuple[Hyperparameters, GradScaling | None] | None:
        """On a rank out of batches: the others' step of this iteration, or None where they did not
        step. ``own``: this rank's snapshot, whose kernel choices and value types are kept."""
        record = torch.full((self._length(),), float("-inf"), dtype=torch.float64, device=self._device)
        work = dist.all_reduce(record, op=dist.ReduceOp.MAX, group=self._group(), async_op=True)
        try:
            wait_work(work, self._timeout_s)
        except RuntimeError as error:
            raise communication_timeout("the record of the others' step (Join, sharded optimizer state)",
                                        self._timeout_s, error, cause=WAITING_FOR_STEP) from error
        values = record.tolist()
        if values[_SENT] != 1:
            raise RuntimeError("a step's record under Join came from no rank still training: the ranks disagree "
                               "on whether a Join is active; every rank must run its loop inside the same Join")
        if values[_STEPPED] != 1:
            return None
        decoded = decode_hyperparameters(self._kind, values[_HEADER:], len(own))
        hyperparameters = [_typed_as(mine, theirs) for mine, theirs in zip(own, decoded, strict=True)]
        scaling = None
        if values[_SCALED] == 1:
            grad_scale = (torch.tensor(values[_GRAD_SCALE], dtype=torch.float32, device=self._device)
                          if values[_HAS_SCALE] == 1 else None)
            found_inf = torch.tensor(values[_FOUND_INF], dtype=torch.float32, device=self._device)
            scaling = GradScaling(grad_scale, found_inf)
        return hyperparameters, scaling


def _typed_as(mine: dict[str, object], theirs: dict[str, object]) -> dict[str, object]:
    """The others' values of one param group, of the types this rank's own hold (a tensor
    learning rate stays a tensor) and with its own kernel choices (``foreach``, ``fused``)."""
    typed = dict(mine)
    for key, value in theirs.items():
        if key in ("foreach", "fused"):
            continue
        typed[key] = _like(mine.get(key), value)
    return typed


def _like(template: object, value: object) -> object:
    if isinstance(template, tuple):
        return tuple(_like(t, v) for t, v in zip(template, value, strict=True))
    if isinstance(template, torch.Tensor):
        return torch.tensor(value, dtype=template.dtype, device=template.device)
    return value

"""Uneven inputs: torch's ``Join`` context manager with a prepared model.

[Note: uneven inputs] When ranks run different numbers of iterations (an
uneven ``DistributedSampler``), a rank that runs out of batches would leave the
others waiting in their collectives. As with torch DDP, training loops run
under ``torch.distributed.algorithms.join.Join([model])``: every forward pass
that will reduce gradients counts the ranks still training (one asynchronous
all-reduce on the buffer group), and a rank that has left its loop takes part
in each of the others' iterations with no gradients (`JoinParticipant.shadow_iteration`):
the buffer broadcast, then every partition in plan order, holding zeros and
flagged unused. Gradients are still divided by the full world size, as DDP's
default (``divide_by_initial_world_size``). When the last rank is done, every
rank takes the parameters and buffers of one of the ranks that trained longest
(its optimizer state stays its own, as with DDP). With sharded optimizer state,
a rank out of batches also updates its chunk at each of the others' steps: see
[Note: a joined rank's shard] in `commsched.update.step_records`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from commsched.comm.agreement import broadcast_from, highest_rank_still_training
from commsched.comm.side_groups import takes_cpu_tensors
from commsched.engine.groups import ProcessGroups
from commsched.errors import CommunicationTimeout
from commsched.update.base import Hyperparameters
from commsched.update.grad_scaling import GradScaling
from commsched.update.step_records import StepRecords


class JoinParticipant(Protocol):
    """What a rank out of batches runs: the reducer."""

    def shadow_iteration(self) -> None:
        """One iteration of the others' collectives, with no gradient of its own."""

    def synchronize(self) -> None:
        """Wait for every reduction and update in flight."""


class UnevenInputs:
    """What ``Join`` asks of a prepared model: its hook, the device and group of its counts."""

    def __init__(
        self,
        module: torch.nn.Module,
        groups: ProcessGroups,
        reference: torch.Tensor,
        timeout_s: float,
        refusal: Callable[[], str | None],
        overlap_requested: bool,
    ):
        """``reference``: a parameter, on whose device the counts go where the group takes no CPU
        tensors; ``refusal``: why the backend cannot shadow an iteration (None: it can), asked when
        Join is entered (a comm hook may change the backend's wire before training)."""
        self._module, self._groups, self._reference = module, groups, reference
        self._timeout_s, self._refusal, self._overlap_requested = timeout_s, refusal, overlap_requested

    @property
    def enabled(self) -> bool:
        """Whether the model runs inside an enabled ``Join`` now."""
        config = getattr(self._module, "_join_config", None)
        return config is not None and config.enable

    @property
    def process_group(self):  # noqa: ANN201 - a torch ProcessGroup
        """Join's count of the ranks still training goes here: beside the gradients, not behind them."""
        return self._groups.buffers

    @property
    def device(self) -> torch.device:
        if takes_cpu_tensors(self.process_group):
            return torch.device("cpu")
        return self._reference.device

    def hook(self, participant: JoinParticipant) -> JoinHook:
        """The hook ``Join`` runs; what a joined rank cannot shadow is refused here rather than as a hang."""
        refusal = self._refusal()
        if refusal is not None:
            raise RuntimeError(refusal)
        if self._overlap_requested and self._counts_share_gradients_group():
            raise RuntimeError(
                "Join (uneven inputs) with forward overlap needs commsched's control group, which is made "
                "only for the default process group: prepare() without process_group=, or use "
                "Strategy(overlap_forward=False)."
            )
        return ShadowIterations(participant, self._module, self._groups, self._timeout_s, self.device)

    def _counts_share_gradients_group(self) -> bool:
        """Whether Join's counts would queue behind reductions still in flight at the next forward.
        One rank has no side group and nothing in flight there (its updates all run at ``step()``)."""
        replicas = self._groups.replicas
        return self._groups.buffers is replicas and dist.get_world_size(replicas) > 1


class ShadowIterations(JoinHook):
    """What a prepared model does under ``Join`` once its rank has run out of batches."""

    def __init__(self, participant: JoinParticipant, module: torch.nn.Module, groups: ProcessGroups,
                 timeout_s: float, device: torch.device):
        """``device``: where the choice of the rank to copy from is made (`UnevenInputs.device`)."""
        self._participant, self._module, self._groups, self._timeout_s = participant, module, groups, timeout_s
        self._device = device

    def main_hook(self) -> None:
        self._participant.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self._participant.synchronize()
        group, timeout_s = self._groups.buffers, self._timeout_s
        source = highest_rank_still_training(is_last_joiner, group, timeout_s, self._device)
        module = self._module
        broadcast_from([*module.parameters(), *module.buffers()], source, group, timeout_s)


STEP_WITHOUT_BACKWARD_UNDER_JOIN = (
    "optimizer.step() without a new backward pass (a second step, or one after zero_grad(set_to_none=True)) "
    "inside Join with sharded optimizer state: its all-gathers would wait for the chunks of ranks out of "
    "batches, which take part only in the others' synchronised iterations. Step once per backward pass "
    "inside Join, or use AllReduce() without sharding"
)


ENDED_UNSTEPPED = (
    "This rank's loop under Join ended with a backward pass that optimizer.step() never followed, while "
    "a rank out of batches waited for that step (with sharded optimizer state it updates its own part at "
    "each of the others' steps) and gave up. Step after every synchronised backward pass inside Join (or "
    "run that last backward pass outside it), or use AllReduce() without sharding"
)


UNSTEPPED_WHILE_OTHERS_STEPPED = (
    "rank {rank}: its loop under Join ended with a backward pass that optimizer.step() never followed, while "
    "the ranks still training stepped that iteration: with sharded optimizer state every rank updates its "
    "own part at every step, so every rank must step the same iterations. Step after every synchronised "
    "backward pass inside Join (or run that last backward pass outside it), or use AllReduce() without sharding"
)


class JoinedSteps:
    """[Note: a joined rank's shard] for the reducer: which synchronised iteration still owes its
    step's record, and the record a rank out of batches receives. Without sharded state
    (``records`` None) it does nothing."""

    def __init__(self, records: StepRecords | None, counts: UnevenInputs):
        """``counts``: where Join counts the ranks still training."""
        self._records, self._counts = records, counts
        self._owed = False
        """A synchronised forward pass ran under Join and no record of its step went out yet."""
        self.ended_unstepped = False
        """This rank began shadowing with a record owed: its loop ended after a backward pass without
        ``step()``. Harmless where no other rank stepped that iteration; a failure of that shadowed
        iteration is then explained by it (`ENDED_UNSTEPPED`)."""
        self._wake: tuple[dist.Work, torch.Tensor] | None = None

    @property
    def needed(self) -> bool:
        return self._records is not None

    def count(self, notify_join: Callable[[], object]) -> None:
        """A forward pass that will reduce gradients, under an enabled Join: the previous one's
        record goes out if its ``step()`` never came, then ``notify_join`` counts this one (which
        raises under ``throw_on_early_termination`` once a rank is out: then nothing is owed)."""
        self._send_owed()
        notify_join()
        self._owed = self._records is not None

    def stepped(self, hyperparameters: Hyperparameters, scaling: GradScaling | None) -> None:
        """``step()`` released this iteration's updates, before any of them starts."""
        if self._owed:
            self._records.send(hyperparameters, scaling)
            self._owed = False

    def shadowing(self) -> None:
        """This rank's first shadowed iteration: its own last one may still owe its record.

        The count that let this rank shadow came after every other rank's record of
        that iteration (sent at its ``step()``, or before its next count), so the
        record is exchanged at once; a rank whose last iteration went unstepped
        while the others stepped it is refused (its chunks would miss that update).
        """
        if not self._owed:
            return
        self._owed = False
        self.ended_unstepped = True
        if self._records.send_unstepped():
            raise RuntimeError(UNSTEPPED_WHILE_OTHERS_STEPPED.format(rank=dist.get_rank()))

    def receive(self, own: Hyperparameters) -> tuple[Hyperparameters, GradScaling | None] | None:
        """On a rank out of batches, after the others' reductions: their step (see `StepRecords.receive`).

        [Note: waking the last trainer] Where no record came, the last rank still
        training may have left its loop after a backward pass without ``step()``:
        it then waits in Join's own count of the ranks still training, which this
        rank joins only after the record, and would get gloo's bare error once
        this rank has gone. So, giving up, this rank joins that count first: the
        other rank's Join then shadows an iteration, where it sends its record,
        finds this rank gone and says why (`ENDED_UNSTEPPED`). Elsewhere (a rank
        dead, or still computing) the extra count is never waited for.
        """
        try:
            return self._records.receive(own)
        except CommunicationTimeout:
            count = torch.ones(1, device=self._counts.device)
            self._wake = (dist.all_reduce(count, group=self._counts.process_group, async_op=True), count)
            raise

    def close(self) -> None:
        if self._records is not None:
            self._records.wait_sent()

    def _send_owed(self) -> None:
        if self._owed:
            self._records.send(None, None)
            self._owed = False

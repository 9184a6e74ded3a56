"""Which buckets the training loop waits for, and where: the forward gates, and the reads outside them.

With forward overlap, each module's gate (`commsched.engine.hooks.ForwardGates`) waits for
its own buckets; in compiled code each piece of a graph waits for the buckets of the
parameters it uses first (`wait_in_graph`; [Note: gates in compiled graphs] in
`commsched.layout.gated_graphs`). What warm-up saw decides the rest (see [Note: reads outside
the forward pass] and [Note: reads before the gate] in `commsched.watch.reads`):
buckets the loop reads before the forward pass are updated at ``step()``, those
it reads after it when the forward pass returns, and parameters a warm-up
forward pass read before their gates are waited for by the root's gate.
`ForwardGating` holds these choices in parameter slots, which outlive a layout,
and maps them to the buckets of each layout.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from commsched.engine.hooks import ForwardGates, WaitForBuckets
from commsched.engine.events import phase
from commsched.layout.gated_graphs import cut_at
from commsched.layout.grad_layout import GradLayout, gating_modules
from commsched.watch.autograd_context import running_backward
from commsched.watch.reads import ParameterReads

logger = logging.getLogger("commsched")


class ForwardGating:
    """The gates of the layout in use and the buckets updated outside them."""

    def __init__(
        self,
        root: torch.nn.Module,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        wait_for: WaitForBuckets,
    ):
        """``wait_for(buckets)``: complete those buckets of the current pass (a gate's wait)."""
        self._root, self._params, self._names, self._wait_for = root, params, names, wait_for
        self._read_before_owner: dict[int, torch.nn.Module] = {}
        """Per slot the first forward pass read before its module ran, the module that read it;
        the root for those a warm-up pass read before their gate ([Note: reads before the gate])."""
        self._read_slots: tuple[frozenset[int], frozenset[int]] | None = None
        """Slots the loop reads before and after the forward pass (seen during warm-up)."""
        self._gates: ForwardGates | None = None
        self._bucket_of: Sequence[int] | None = None
        """Per slot, its bucket in the layout the gates are installed for (None: no gates)."""
        self._partition_of: Sequence[int] | None = None
        """Per slot, its partition there: where compiled graphs are cut."""
        self._after_forward: RemovableHandle | None = None
        self.updated_at_step: tuple[int, ...] = ()
        """Buckets the loop reads between ``step()`` and the next forward pass: with overlap,
        updated at ``step()``."""
        self.updated_after_forward: tuple[int, ...] = ()
        """Buckets the loop reads after the forward pass: updated when it returns."""
        self.gated_at_forward_start: tuple[str, ...] = ()
        """Parameters a warm-up forward pass read before their gates."""

    def readers_found(self, read_before_owner: Mapping[int, torch.nn.Module]) -> None:
        """What the first forward pass saw: parameters read before their own module ran, and by which."""
        self._read_before_owner = dict(read_before_owner)

    def modules(self) -> list[list[torch.nn.Module]]:
        """Per slot, the modules whose gate waits for it (`commsched.layout.grad_layout.gating_modules`)."""
        return gating_modules(self._root, self._params, self._read_before_owner)

    def install(self, layout: GradLayout) -> None:
        """One gate per module that waits for parameters, for ``layout``."""
        self.remove_gates()
        self._gates = ForwardGates(self.modules(), layout.bucket_of, self._wait_for)
        self._bucket_of, self._partition_of = layout.bucket_of, layout.partition_of_slots()
        cut_at(self._partition_of)

    def remove_gates(self) -> None:
        if self._gates is not None:
            self._gates.remove()
            self._gates = None
        self._bucket_of = self._partition_of = None

    def partitions_in_use(self) -> Sequence[int] | None:
        """Per slot, its partition under the gates installed (None: none are): where compiled graphs are cut."""
        return self._partition_of

    def wait_in_graph(self, slots: tuple[int, ...]) -> None:
        """A gate inside a compiled graph, before the piece that first uses ``slots``: their buckets in the
        layout in use. Nothing while no gates are installed, and in a recomputation during backward."""
        bucket_of = self._bucket_of
        if bucket_of is None or running_backward():
            return
        with phase("commsched::gate"):
            self._wait_for(sorted({bucket_of[slot] for slot in slots}))

    def use_recorded_reads(self, reads: ParameterReads, layout: GradLayout) -> None:
        """At the end of warm-up, with forward overlap: what the warm-up's reads decide."""
        if reads.before_gate:
            self._gate_at_forward_start(list(reads.before_gate), layout)
        self._read_slots = (frozenset(reads.before_forward), frozenset(reads.after_forward))
        self.map_reads(layout)
        for slots, buckets, when in (
            (reads.before_forward, self.updated_at_step, "at step()"),
            (reads.after_forward, self.updated_after_forward, "when the forward pass returns"),
        ):
            if slots:
                logger.info(
                    "commsched: the training loop reads %d parameters (first: '%s') outside the forward pass; "
                    "their %d buckets are updated %s", len(slots), self._names[min(slots)], len(buckets), when,
                )
        if self.updated_after_forward:
            self._after_forward = self._root.register_forward_hook(self._forward_returned, always_call=True)

    def map_reads(self, layout: GradLayout) -> None:
        """The buckets of the slots read outside the forward pass, in ``layout``."""
        if self._read_slots is None:
            return
        before, after = self._read_slots
        self.updated_at_step = tuple(sorted({layout.bucket_of[s] for s in before}))
        self.updated_after_forward = tuple(sorted({layout.bucket_of[s] for s in after}))

    def close(self) -> None:
        self.remove_gates()
        if self._after_forward is not None:
            self._after_forward.remove()
            self._after_forward = None

    def _gate_at_forward_start(self, slots: list[int], layout: GradLayout) -> None:
        for slot in slots:
            self._read_before_owner[slot] = self._root
        self.gated_at_forward_start = tuple(self._names[slot] for slot in slots)
        if self._gates is not None:
            self.install(layout)
        logger.warning(
            "commsched: a warm-up forward pass read %d parameters (first: '%s') before the modules that wait "
            "for them ran, unlike the first forward pass: with forward overlap, the forward pass now waits for "
            "their buckets at its start. If its paths can differ in other ways after warm-up, use "
            "Strategy(overlap_forward=False).", len(slots), self._names[slots[0]],
        )

    def _forward_returned(self, module: torch.nn.Module, args: object, output: object) -> None:
        """Buckets read after the forward pass (a module that did not run) are updated now."""
        if not running_backward():
            self._wait_for(self.updated_after_forward)

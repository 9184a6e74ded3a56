"""A dynamo backend that puts the forward gates inside compiled graphs: each graph is cut where the
partitions of the parameters it uses change, and each piece waits for its own buckets before it runs.

[Note: gates in compiled graphs] A forward gate waits for reductions and runs updates: Python that
dynamo must not trace. As a module's forward pre-hook inside compiled code it is a graph break, and
with a gate on every module that owns parameters dynamo compiles each ``Linear.forward`` or
``Conv2d.forward`` again for every shape it meets, until its recompile limit leaves the rest eager.
Gated only at whole blocks, the next forward pass waits for a block's every bucket before the
block's first layer runs, and the last block's computation cannot hide behind the last reductions.

So a compiled region of a prepared model compiles through `GatesInGraphs`, which wraps the backend
the user chose. Dynamo traces the region as it would without commsched: the module gates that it
traces there return at once (`tracing_gated_region`), so they break nothing. The backend then
splits each graph it is given, in the order of its nodes, where a node first uses a parameter of a
partition the current piece holds none of, compiles every piece with the user's backend (torch's
``split_module`` and ``SubmodCompiler``, which torch DDP's ``DDPOptimizer`` uses to split its
compiled graphs at its bucket boundaries), and calls the wait for the parameters each piece uses
first before it runs. The parameters are the graph's inputs, the very tensors the updates write in
place, so each piece reads them updated. Each piece's backward is its own graph too, so its
gradients are ready when it ends, not when the whole region's backward pass does. The cut is at
partitions, the wire's unit, not only at buckets: a partitioned bucket's partitions then go on the
wire as their pieces' backward passes end, as they do from an eager model, rather than all at the
end of the bucket's last piece.

What runs eagerly inside a region (around a graph break of the user's code, every frame under
``torch.compiler.set_stance("force_eager")``, past dynamo's recompile limit) runs the module
gates as in an eager model. Code compiled some other way (a compiled function calling the
model) meets them as graph breaks, as before.

The pieces follow the partitions of the layout in use when a graph is compiled (`cut_at`); each
wait looks up the buckets of its parameters when it runs, so a later layout only moves where a
piece waits, never whether it does.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

logger = logging.getLogger("commsched")

WaitForSlots = Callable[[tuple[int, ...]], None]
"""Complete, in the current forward pass, the buckets of these parameter slots (an in-graph gate)."""

_regions_running = 0
"""Calls into gated regions under way: while dynamo traces one, the module gates it meets return."""
_cut = 0
"""Which partitions the graphs compiled from now on are cut at (`cut_at`)."""
_cuts: dict[tuple[int, ...], int] = {}
"""Per layout met (each slot's partition), its cut."""
MAX_CUTS = 4
"""Layouts a process compiles graphs for; past them (an auto-tuner trying many layouts) graphs
keep the last cut, within dynamo's recompile limit (8 graphs per code): the waits still find their buckets."""


def tracing_gated_region() -> bool:
    """True while dynamo traces code of a region compiled through `GatesInGraphs` (its graph waits for
    the buckets). Dynamo reads the globals as constants and guards on them: a graph is compiled anew
    for other partitions (`cut_at`), and kept for each it has met."""
    return torch.compiler.is_compiling() and _regions_running > 0 and _cut >= 0


def cut_at(unit_of: Sequence[int]) -> None:
    """The layout in use changed (``unit_of``: per slot, its partition): graphs traced from now on are
    cut at its partitions, and a graph compiled for others no longer passes dynamo's guards (one
    compiled for these before does again)."""
    global _cut
    units = tuple(unit_of)
    if units in _cuts or len(_cuts) < MAX_CUTS:
        _cut = _cuts.setdefault(units, len(_cuts) + 1)


def calling_gated_region(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` (a region's compiled call), marked as running a gated region while it runs."""

    @functools.wraps(call)
    def gated_call(*args: Any, **kwargs: Any) -> Any:
        global _regions_running
        _regions_running += 1
        try:
            return call(*args, **kwargs)
        finally:
            _regions_running -= 1

    return gated_call


class GatesInGraphs:
    """A dynamo backend: ``inner`` compiles each piece of a graph cut at the partitions of its parameters,
    and ``wait(slots)`` runs before each piece for the parameters it uses first."""

    def __init__(self, inner: Callable[..., Any], slot_of: Mapping[int, int],
                 unit_of: Callable[[], Sequence[int] | None], wait: WaitForSlots):
        """``slot_of``: per ``id(param)``, its slot; ``unit_of()``: per slot, its partition in the
        layout in use (None: no layout yet, a piece per parameter's first use)."""
        self.inner = inner
        self._slot_of, self._unit_of, self._wait = slot_of, unit_of, wait
        self.pieces: list[int] = []
        """Per graph compiled, how many pieces it was cut into (what tests and benchmarks count)."""

    def __call__(self, graph: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
        slot_of_node = self._parameter_slots(graph)
        piece_of, first_used = self._cut(graph, slot_of_node)
        if not any(first_used):  # no parameter of the prepared model: nothing to wait for
            self.pieces.append(1)
            return self.inner(graph, example_inputs, **kwargs)
        self.pieces.append(len(first_used))
        return self._compile_pieces(graph, example_inputs, slot_of_node, piece_of, first_used, kwargs)

    def _cut(self, graph: fx.GraphModule, slot_of_node: Mapping[fx.Node, int]
             ) -> tuple[dict[fx.Node, int], list[list[fx.Node]]]:
        """Per node, its piece; per piece, the parameters' nodes it uses first. A piece ends before a node
        that first uses a parameter of a partition it holds none of."""
        unit_of = self._unit_of()
        piece_of: dict[fx.Node, int] = {}
        first_used: list[list[fx.Node]] = [[]]
        units: set[int] = set()
        used: set[fx.Node] = set()
        nodes_in_piece = 0
        for node in graph.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            new = [arg for arg in node.all_input_nodes if arg in slot_of_node and arg not in used]
            new_units = {slot_of_node[arg] if unit_of is None else unit_of[slot_of_node[arg]] for arg in new}
            if new and nodes_in_piece and not new_units <= units:
                first_used.append([])
                units, nodes_in_piece = set(), 0
            used.update(new)  # all_input_nodes names each node once
            first_used[-1].extend(new)
            units |= new_units
            piece_of[node] = len(first_used) - 1
            nodes_in_piece += 1
        return piece_of, first_used

    def _wait_for(self, fixed: tuple[int, ...], *params: torch.Tensor) -> None:
        """Before a piece: the buckets of the parameters it uses first (``fixed`` slots, and ``params``)."""
        slot_of = self._slot_of
        self._wait(fixed + tuple(slot_of[id(p)] for p in params if id(p) in slot_of))

    def _parameter_slots(self, graph: fx.GraphModule) -> dict[fx.Node, int]:
        """The graph's nodes that are the prepared model's parameters: dynamo's inputs (its own
        modules' parameters lifted as placeholders) or attributes, with their slots."""
        found: dict[fx.Node, int] = {}
        for node in graph.graph.nodes:
            if node.op == "placeholder":
                graph_arg = node.meta.get("grapharg")
                value = getattr(graph_arg, "example", None) if graph_arg is not None else None
            elif node.op == "get_attr":
                try:
                    value = graph.get_parameter(str(node.target))
                except AttributeError:
                    continue
            else:
                continue
            if isinstance(value, nn.Parameter) and (slot := self._slot_of.get(id(value))) is not None:
                found[node] = slot
        return found

    def _compile_pieces(self, graph: fx.GraphModule, example_inputs: list[Any], slot_of_node: Mapping[fx.Node, int],
                        piece_of: dict[fx.Node, int], first_used: list[list[fx.Node]], kwargs: dict[str, Any]
                        ) -> fx.GraphModule:
        """torch's own graph splitting (as torch DDP's compiled path uses it), then a wait before each piece.

        A wait is given the parameters its piece uses first as the graph's inputs, as they are at each
        call: dynamo runs one graph for every module of the same code (the blocks of a Transformer),
        each call with its own parameters. Parameters read as attributes belong to the graph's module:
        their slots are fixed."""
        from torch._dynamo.backends.distributed import SubmodCompiler, propagate_dynamo_source, propagate_metadata
        from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.split_module import split_module

        split = split_module(graph, None, lambda node: piece_of[node])  # type: ignore[arg-type]
        propagate_dynamo_source(graph, split)
        propagate_metadata(graph, split)
        fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
        with _disable_saved_tensors_hooks_during_tracing():
            SubmodCompiler(split, self.inner, fake_mode, **kwargs).run(*example_inputs)
        inputs = {node.target: node for node in split.graph.nodes if node.op == "placeholder"}
        for node in list(split.graph.nodes):
            if node.op == "call_module" and str(node.target).startswith("compiled_submod_"):
                params = first_used[int(str(node.target).rsplit("_", 1)[1])]
                if params:
                    fixed = tuple(slot_of_node[p] for p in params if p.op != "placeholder")
                    passed = [inputs[p.target] for p in params if p.op == "placeholder"]
                    with split.graph.inserting_before(node):
                        split.graph.call_function(self._wait_for, (fixed, *passed))
        split.recompile()
        logger.debug("commsched: a compiled graph cut into %d pieces at its partitions:\n%s",
                     len(first_used), split.code)
        return split

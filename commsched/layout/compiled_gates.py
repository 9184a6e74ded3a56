"""Where the forward gates of a compiled model go: at the granularity of what was compiled.

[Note: gates in compiled code] A forward gate is a pre-hook that must run as it is:
it waits for reductions and runs updates, which dynamo must not trace. Inside code
that ``torch.compile`` compiles, each gate is therefore a graph break, and a break
inside a submodule's call cannot be resumed: dynamo gives up on the calling frame
and compiles the frames under it one by one. With a gate on every module that owns
parameters that meant one graph per layer, each ``Linear.forward`` or
``Conv2d.forward`` compiled again for every shape it meets, until dynamo's
recompile limit (8) left the rest of the model eager.

So a compiled region (a ``torch.compile(module)`` wrapper, or a module compiled in
place by ``module.compile()``) is gated at the granularity it was compiled at:

- a region that holds repeated blocks (modules of one class that hold other modules,
  the ones nearest the region's top: a Transformer's layers, a ResNet's residual
  blocks) is gated at each block's entry. Dynamo then compiles each block's forward
  as one graph, once for every block of one shape, and its backward as one graph:
  each block's gradients arrive when its backward ends, and the next forward pass
  starts block by block. What lies outside the blocks (embeddings, a stem, a head)
  waits at the last of these gates its forward pass met before using it, so that no
  gate sits between two blocks: the root frame between them then runs eagerly, and
  dynamo compiles nothing else.
- any other region, and one compiled with ``fullgraph=True`` (which has no break to
  spare), is gated at its entry only: its parameters are all updated before it runs.
  A ``torch.compile`` wrapper's gate runs outside its compiled code; a module compiled
  in place runs its hooks inside, so ``module.compile(fullgraph=True)`` cannot be gated
  and is refused with forward overlap (`refuse_gates_in_full_graphs`).

The set of gated modules depends on the model and the forward order alone, never on
the buckets of a layout: dynamo does not guard on module hooks, so a gate added to a
module after its code was compiled would never run.

torch DDP's compiled path splits the one graph it is given at bucket boundaries
(``DDPOptimizer``), so that each bucket's gradients are ready when its piece of the
backward ends. commsched cuts at block boundaries instead: its buckets follow the
order parameters are used in, so a block boundary is where a gate helps the next
forward pass, and dynamo compiles one block's code once for all blocks alike.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from torch import nn

logger = logging.getLogger("commsched")

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def compiled(module: nn.Module) -> bool:
    """Whether ``module``'s calls run compiled code: a ``torch.compile`` wrapper, or compiled in place."""
    return _is_wrapper(module) or getattr(module, "_compiled_call_impl", None) is not None


def _is_wrapper(module: nn.Module) -> bool:
    """A ``torch.compile(module)`` wrapper (``OptimizedModule``), without importing dynamo where it is not."""
    return hasattr(module, "_orig_mod") and hasattr(module, "dynamo_ctx")


def full_graph(region: nn.Module) -> bool:
    """Whether ``region`` was compiled with ``fullgraph=True`` (a wrapper's context says it)."""
    return bool(getattr(getattr(region, "dynamo_ctx", None), "fullgraph", False))


def _in_place_full_graph(module: nn.Module) -> bool:
    """Whether ``module.compile(fullgraph=True)`` compiled it: its compiled call holds the context."""
    call = getattr(module, "_compiled_call_impl", None)
    cells = getattr(call, "__closure__", None) or ()
    return any(getattr(_cell_contents(cell), "fullgraph", False) is True for cell in cells)


def _cell_contents(cell: object) -> object:
    try:
        return cell.cell_contents  # type: ignore[attr-defined]
    except ValueError:  # an empty cell
        return None


def refuse_gates_in_full_graphs(root: nn.Module) -> None:
    """With forward overlap, a module compiled in place with ``fullgraph=True`` cannot be gated: its
    hooks run inside its compiled call, where a gate is a graph break. Refused at ``prepare()``."""
    for region in _outermost_compiled(root):
        if region is not root and not _is_wrapper(region) and _in_place_full_graph(region):
            name = next((n for n, m in root.named_modules() if m is region), "")
            raise ValueError(
                f"commsched: module '{name or type(region).__name__}' was compiled in place with "
                "fullgraph=True: with forward overlap its gate (a forward pre-hook) would run inside its "
                "compiled call and break the graph, which fullgraph=True forbids. Compile it as a wrapper, "
                "whose hooks run outside: parent.block = torch.compile(block, fullgraph=True) (as torchtitan "
                "does), or compile it without fullgraph=True, or prepare with "
                "commsched.Strategy(overlap_forward=False)"
            )


class CompiledGates:
    """The compiled regions of ``root`` and their blocks: where the gates of what they hold go."""

    def __init__(self, root: nn.Module):
        self.regions: list[nn.Module] = []
        """The outermost compiled modules."""
        self._blocks_of: dict[int, list[nn.Module]] = {}
        """Per region, its repeated blocks (none: the region is gated at its entry only)."""
        self._place_of: dict[int, tuple[nn.Module, nn.Module | None]] = {}
        """Per module inside a region, the region and the block holding it (None: outside its blocks)."""
        for region in _outermost_compiled(root):
            self.regions.append(region)
            blocks = [] if full_graph(region) else repeated_blocks(region)
            self._blocks_of[id(region)] = blocks
            for inner in region.modules():
                self._place_of[id(inner)] = (region, None)
            for block in blocks:
                for inner in block.modules():
                    self._place_of[id(inner)] = (region, block)

    def coarsen(self, gates_of_slots: Sequence[Sequence[nn.Module]], forward_order: Sequence[int]
                ) -> list[list[nn.Module]]:
        """Per slot, the gates of ``gates_of_slots`` moved to the granularity of what was compiled.

        Inside a region with blocks, a parameter of a block waits at the block's gate; one outside
        them (an embedding, a head) at the last gate its forward pass met before using it (the
        region's, or an earlier block's), so that no gate sits between two blocks; warm-up's
        watch of reads catches a later pass that reads it sooner ([Note: reads before the gate]
        in `commsched.watch.reads`). Inside a region without blocks, every parameter waits at
        the region's gate."""
        if not self.regions:
            return [list(gates) for gates in gates_of_slots]
        met_before = self._gates_met_before(gates_of_slots, forward_order)
        coarse: list[list[nn.Module]] = []
        for slot, gates in enumerate(gates_of_slots):
            moved: list[nn.Module] = []
            for module in gates:
                region, block = self._place_of.get(id(module), (None, None))
                if region is None:
                    gate = module
                elif block is not None:
                    gate = block
                elif self._blocks_of[id(region)] and module is not region:
                    gate = met_before.get(slot, region)
                else:
                    gate = region
                if not any(g is gate for g in moved):
                    moved.append(gate)
            coarse.append(moved)
        return coarse

    def _gates_met_before(self, gates_of_slots: Sequence[Sequence[nn.Module]], forward_order: Sequence[int]
                          ) -> dict[int, nn.Module]:
        """Per slot, the region's or block's gate last met before the forward pass first used it."""
        current: dict[int, nn.Module] = {id(region): region for region in self.regions}
        met: dict[int, nn.Module] = {}
        for slot in forward_order:
            for module in gates_of_slots[slot]:
                region, block = self._place_of.get(id(module), (None, None))
                if region is None:
                    continue
                if block is not None:
                    current[id(region)] = block
                else:
                    met.setdefault(slot, current[id(region)])
        return met


def see_gates_when_compiled(root: nn.Module) -> None:
    """[Note: dynamo and module hooks]: before ``root``'s compiled regions run compiled for the first time."""
    regions = list(_outermost_compiled(root))
    if not regions:
        return
    import torch._dynamo
    from torch._C._dynamo.eval_frame import reset_code

    if torch._dynamo.config.skip_nnmodule_hook_guards:
        logger.info("commsched: dynamo guards on module hooks from now on (torch._dynamo.config."
                    "skip_nnmodule_hook_guards = False), so that compiled code runs the forward gates")
        torch._dynamo.config.skip_nnmodule_hook_guards = False
    codes = {nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__}
    for region in regions:
        for module in region.modules():
            forward = getattr(type(module), "forward", None)
            if hasattr(forward, "__code__"):
                codes.add(forward.__code__)
    for code in codes:
        reset_code(code)


def _outermost_compiled(root: nn.Module) -> Iterator[nn.Module]:
    stack = [root]
    while stack:
        module = stack.pop()
        if compiled(module):
            yield module
        else:
            stack.extend(reversed(list(module.children())))


def repeated_blocks(region: nn.Module) -> list[nn.Module]:
    """The blocks of ``region`` gated one by one: the instances of the class, among those that hold
    other modules and occur at least twice, whose instances lie nearest the region's top (the
    larger share of parameters breaks a tie); none nest inside another. Empty where none repeats."""
    depth_of: dict[type, int] = {}
    instances: dict[type, list[nn.Module]] = {}
    sizes: dict[type, int] = {}
    pending = [(child, 1) for child in region.children()]
    seen: set[int] = set()
    while pending:
        module, depth = pending.pop(0)
        if id(module) in seen:
            continue
        seen.add(id(module))
        kind = type(module)
        holds_modules = next(module.children(), None) is not None
        if holds_modules and not isinstance(module, _CONTAINERS) and not compiled(module):
            own = sum(p.numel() for p in module.parameters())
            if own:
                instances.setdefault(kind, []).append(module)
                depth_of.setdefault(kind, depth)
                sizes[kind] = sizes.get(kind, 0) + own
        pending.extend((child, depth + 1) for child in module.children())
    repeated = [kind for kind, found in instances.items() if len(found) >= 2]
    if not repeated:
        return []
    kind = min(repeated, key=lambda k: (depth_of[k], -sizes[k]))
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for block in instances[kind]:
        if id(block) in inside:
            continue
        blocks.append(block)
        inside.update(id(m) for m in block.modules())
    return blocks

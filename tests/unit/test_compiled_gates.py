"""Gates inside compiled graphs (`commsched.layout.gated_graphs`, `commsched.layout.compiled_gates`), in one
process: a recording wait stands for the engine's, and "updates" the parameters it waits for in place, so
that a piece reading a parameter before its wait would compute something else than eager code."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from commsched.layout import gated_graphs
from commsched.layout.compiled_gates import GatedRegions, compiled
from commsched.layout.gated_graphs import GatesInGraphs, calling_gated_region, cut_at, tracing_gated_region
from commsched.testing.models import TinyGPT

SCALE = 0.5


class Recorder:
    """The engine's side: per parameter, its bucket; ``wait(slots)`` scales those parameters once each
    forward pass (an update), and records the slots it was given, in order."""

    def __init__(self, model: nn.Module, bucket_of: list[int]):
        self.params = list(model.parameters())
        self.slot_of = {id(p): slot for slot, p in enumerate(self.params)}
        self.bucket_of = bucket_of
        self.waits: list[tuple[int, ...]] = []
        self._updated: set[int] = set()

    def wait(self, slots: tuple[int, ...]) -> None:
        self.waits.append(tuple(slots))
        with torch.no_grad():
            for bucket in sorted({self.bucket_of[s] for s in slots} - self._updated):
                self._updated.add(bucket)
                for slot, p in enumerate(self.params):
                    if self.bucket_of[slot] == bucket:
                        p.mul_(SCALE)

    def next_pass(self) -> None:
        self.waits.clear()
        self._updated.clear()

    def backend(self, inner="aot_eager") -> GatesInGraphs:
        return GatesInGraphs(torch._dynamo.lookup_backend(inner), self.slot_of, lambda: self.bucket_of, self.wait)


def block_buckets(model: TinyGPT) -> list[int]:
    """Per parameter: the embeddings in bucket 0, each block's first half (norm1, qkv, proj) and second
    half in a bucket of their own, the final norm in the last."""
    buckets = []
    for name, _ in model.named_parameters():
        if name.startswith("blocks."):
            index = int(name.split(".")[1])
            buckets.append(1 + 2 * index + (name.split(".")[2] in ("norm2", "fc", "out")))
        else:
            buckets.append(0 if name.startswith(("tokens", "positions")) else 1 + 2 * len(model.blocks))
    return buckets


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def module_gates(model: nn.Module, recorder: Recorder) -> list:
    """A prepared model's module gates: elided while dynamo traces a gated region (reading, and so guarding
    on, the cut), waiting eagerly elsewhere."""
    return [m.register_forward_pre_hook(lambda m, a: None if tracing_gated_region() else recorder.wait(()))
            for m in model.modules()]


def run_gated(model: nn.Module, recorder: Recorder, tokens: torch.Tensor):
    """What a prepared region does: calls into it are marked, its gates elided while traced."""
    gates = module_gates(model, recorder)
    compiled_model = torch.compile(model, backend=recorder.backend())
    compiled_model.forward = calling_gated_region(compiled_model.forward)
    outputs = []
    for _ in range(3):
        recorder.next_pass()
        outputs.append(compiled_model(tokens))
        outputs[-1].square().mean().backward()
    for gate in gates:
        gate.remove()
    return outputs


def test_each_piece_waits_for_the_buckets_it_uses_first_and_reads_them_updated():
    torch.manual_seed(0)
    model, reference = TinyGPT(layers=2), TinyGPT(layers=2)
    reference.load_state_dict(model.state_dict())
    recorder = Recorder(model, block_buckets(model))
    cut_at(recorder.bucket_of)
    tokens = torch.randint(0, 32, (2, 8))
    outputs = run_gated(model, recorder, tokens)
    slots_of_bucket = [[s for s, b in enumerate(recorder.bucket_of) if b == bucket]
                       for bucket in range(max(recorder.bucket_of) + 1)]
    waited = [sorted({recorder.bucket_of[s] for s in slots}) for slots in recorder.waits]
    # One wait per piece, in the order the forward pass first uses each bucket; the head is the tied embedding.
    assert waited == [[0], [1], [2], [3], [4], [5]], waited
    assert sorted(s for slots in recorder.waits for s in slots) == sorted(sum(slots_of_bucket, []))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    for output in outputs:  # every parameter was scaled before any piece read it: as eager code after the update
        with torch.no_grad():
            for p in reference.parameters():
                p.mul_(SCALE)
        torch.testing.assert_close(output, reference(tokens), rtol=1e-6, atol=1e-6)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert got.grad is not None
        torch.testing.assert_close(got, want)


def test_blocks_compiled_alike_share_a_graph_and_each_waits_for_its_own_parameters():
    torch.manual_seed(0)
    model = TinyGPT(layers=3)
    recorder = Recorder(model, block_buckets(model))
    cut_at(recorder.bucket_of)
    backend = recorder.backend()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=backend, fullgraph=True)
        model.blocks[i].forward = calling_gated_region(model.blocks[i].forward)
    recorder.next_pass()
    model(torch.randint(0, 32, (2, 8)))
    assert counters["stats"]["unique_graphs"] == 1, "one graph for the three blocks"
    waited = [sorted({recorder.bucket_of[s] for s in slots}) for slots in recorder.waits]
    assert waited == [[1], [2], [3], [4], [5], [6]], waited


def test_other_buckets_compile_the_graph_anew_and_old_ones_reuse_theirs():
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    recorder = Recorder(model, block_buckets(model))
    whole = [0] * len(recorder.bucket_of)
    tokens = torch.randint(0, 32, (2, 8))
    module_gates(model, recorder)
    compiled_model = torch.compile(model, backend=recorder.backend())
    compiled_model.forward = calling_gated_region(compiled_model.forward)
    graphs = []
    for bucket_of in (recorder.bucket_of, whole, recorder.bucket_of, whole):
        recorder.bucket_of = bucket_of
        cut_at(bucket_of)
        recorder.next_pass()
        compiled_model(tokens)
        graphs.append(counters["stats"]["unique_graphs"])
        assert len(recorder.waits) == (1 if bucket_of is whole else 6)
    assert graphs == [1, 2, 2, 2], graphs


def test_traced_module_gates_return_only_inside_gated_regions():
    seen = []

    def probe(x):
        seen.append(tracing_gated_region())
        return x + 1

    traced = torch.compile(probe, backend="eager")
    traced(torch.ones(1))
    calling_gated_region(traced)(torch.ones(1))  # guarded: compiled anew inside a region
    assert seen == [False, True] and not tracing_gated_region()


@pytest.mark.parametrize("how", ["wrapper", "in place", "in place, fullgraph"])
def test_regions_compile_through_the_gating_backend_and_get_their_own_back(how):
    model = TinyGPT(layers=2)
    if how == "wrapper":
        model.blocks[0] = torch.compile(model.blocks[0], backend="aot_eager", dynamic=False)
    else:
        model.blocks[0].compile(backend="aot_eager", fullgraph=how.endswith("fullgraph"))
    region = model.blocks[0]
    own = region.dynamo_ctx if how == "wrapper" else region._compiled_call_impl
    made = []

    def make(inner):
        made.append(inner)
        return Recorder(model, [0] * len(list(model.parameters()))).backend()

    regions = GatedRegions(model, make)
    assert regions.count == 1 and compiled(region) and len(made) == 1
    assert getattr(made[0], "compiler_name", None) == "aot_eager", "the region's own backend, to compile the pieces"
    if how == "wrapper":
        assert region.dynamo_ctx is not own and region.dynamo_ctx._dynamic is False  # its options kept
    else:
        assert region._compiled_call_impl is not own
    model(torch.randint(0, 32, (2, 8)))
    assert counters["stats"]["unique_graphs"] == 1
    regions.restore()
    assert (region.dynamo_ctx if how == "wrapper" else region._compiled_call_impl) is own


def test_a_region_without_a_readable_context_is_refused_with_the_fix():
    model = TinyGPT(layers=2)
    model.blocks[0]._compiled_call_impl = lambda *args, **kwargs: None  # compiled some other way
    with pytest.raises(ValueError, match=r"'blocks\.0'.*torch\.compile\(module\).*overlap_forward=False"):
        GatedRegions(model, lambda inner: inner)


def test_cuts_are_bounded():
    saved = dict(gated_graphs._cuts), gated_graphs._cut
    try:
        gated_graphs._cuts.clear()
        keys = []
        for n in range(1, gated_graphs.MAX_CUTS + 3):
            cut_at([i // n for i in range(12)])
            keys.append(gated_graphs._cut)
        assert keys == [1, 2, 3, 4, 4, 4]
        cut_at([i // 2 for i in range(12)])
        assert gated_graphs._cut == 2
    finally:
        gated_graphs._cuts.clear()
        gated_graphs._cuts.update(saved[0])
        gated_graphs._cut = saved[1]


def test_graphs_are_cut_at_the_partition_of_each_parameters_first_element():
    from commsched.layout.grad_layout import build_layout
    from commsched.layout.partitions import make_partitions

    params = [nn.Parameter(torch.zeros(10)) for _ in range(4)]

    def cut(bucket_set):
        return make_partitions([b.flat.numel() for b in bucket_set.buckets], [4] * len(bucket_set.buckets),
                               bucket_set.priorities, 20 * 4)

    layout = build_layout([f"p{i}" for i in range(4)], params, [0, 1, 2, 3], [1000 * 4], False, cut)
    # One bucket, in reverse forward order (slots 3, 2, 1, 0 at 0, 10, 20, 30), in two partitions of 20.
    assert len(layout.buckets) == 1 and len(layout.partitions) == 2
    first, second = sorted(layout.partitions, key=lambda p: p.start)
    assert layout.partition_of_slots() == (second.pid, second.pid, first.pid, first.pid)

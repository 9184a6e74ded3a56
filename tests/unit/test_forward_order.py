"""The first forward pass's parameter order: priorities and gates are derived from it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from commsched.layout.grad_layout import gating_modules
from commsched.watch.first_forward import ForwardRecorder
from commsched.watch.reads import ParameterReads
from commsched.testing.models import ReadsLateEarlyLater


def record(model: nn.Module, *inputs: torch.Tensor) -> tuple[list[str], dict[str, nn.Module]]:
    """The parameter order, and per parameter read before its module ran, the module that read it."""
    params = list(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    recorder = ForwardRecorder(model, params)
    model(*inputs)
    recorder.finish()
    order = [names[id(params[slot])] for slot in recorder.parameter_order(params)]
    return order, {names[id(params[slot])]: module for slot, module in recorder.read_by.items()}


def recorded_order(model: nn.Module, *inputs: torch.Tensor) -> tuple[list[str], set[str]]:
    order, read_by = record(model, *inputs)
    return order, set(read_by)


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 2)  # registered first, runs last
        self.body = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class UsesChildWeightEarly(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)  # its weight is read by the parent; proj itself never runs

    def forward(self, x):
        return F.linear(self.body(x), self.proj.weight)


def test_execution_order_not_registration_order():
    order, early = recorded_order(Chain(), torch.randn(2, 8))
    assert order == ["body.weight", "body.bias", "head.weight", "head.bias"]
    assert early == set()


def test_a_parameter_read_before_its_module_comes_first():
    """Its bucket is waited for when the forward pass starts, so it must be the most urgent;
    ordered after the rest (its module never ran), it was the least urgent of all."""
    order, early = recorded_order(UsesChildWeightEarly(), torch.randn(2, 8))
    assert early == {"proj.weight"}
    assert order[0] == "proj.weight"
    assert order[1:3] == ["body.weight", "body.bias"]
    assert order[-1] == "proj.bias"  # never used: last


def test_multihead_attention_out_proj_is_ordered_where_it_is_waited_for():
    """``nn.MultiheadAttention`` reads ``out_proj``'s parameters without calling ``out_proj``: the
    attention module's gate waits for them, so they are ordered with that module's own parameters.
    Ordered first (waited for when the forward pass starts), every layer's ``out_proj`` shared one
    bucket that was ready only when the backward pass ended, and the next forward pass waited for it."""
    layers = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                   enable_nested_tensor=False)
    order, read_by = record(layers, torch.randn(2, 5, 16))
    out_proj = [n for n in order if "out_proj" in n]
    assert set(read_by) == set(out_proj) and len(out_proj) == 4
    for i in range(2):
        assert read_by[f"layers.{i}.self_attn.out_proj.weight"] is layers.layers[i].self_attn
        position = order.index(f"layers.{i}.self_attn.in_proj_bias")
        assert order[position + 1: position + 3] == [f"layers.{i}.self_attn.out_proj.weight",
                                                     f"layers.{i}.self_attn.out_proj.bias"]
    assert order[0] == "layers.0.self_attn.in_proj_weight"


class ReadsGrandchildWeight(nn.Module):
    """A block that reads its child's child's weight (as attention reads ``out_proj``'s)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8))

    def forward(self, x):
        return F.linear(x, self.inner[0].weight)


def test_the_innermost_running_module_is_the_reader():
    model = nn.Sequential(nn.Linear(8, 8), ReadsGrandchildWeight(), nn.Linear(8, 2))
    order, read_by = record(model, torch.randn(2, 8))
    assert read_by == {"1.inner.0.weight": model[1]}
    assert order == ["0.weight", "0.bias", "1.inner.0.weight", "2.weight", "2.bias", "1.inner.0.bias"]
    # A module that raised is no longer running: later reads go to the module running then.
    failing = UsesChildWeightEarly()
    params = list(failing.parameters())
    recorder = ForwardRecorder(failing, params)
    try:
        failing.body(torch.randn(2, 3))  # wrong shape: raises inside body
    except RuntimeError:
        pass
    F.linear(torch.randn(2, 8), failing.proj.weight)
    recorder.finish()
    proj_slot = next(slot for slot, p in enumerate(params) if p is failing.proj.weight)
    assert recorder.read_by == {proj_slot: failing}


def first_pass_gates(model: nn.Module, *inputs: torch.Tensor) -> tuple[list[nn.Parameter], list[list[nn.Module]]]:
    params = list(model.parameters())
    recorder = ForwardRecorder(model, params)
    model(*inputs)
    recorder.finish()
    return params, gating_modules(model, params, recorder.read_by)


def test_a_parameter_is_gated_by_its_owners_and_its_first_reader():
    model = nn.Sequential(nn.Linear(8, 8), ReadsGrandchildWeight(), nn.Linear(8, 2))
    params, gates = first_pass_gates(model, torch.randn(2, 8))
    gates_by_name = {name: gates[slot] for slot, (name, _) in enumerate(model.named_parameters())}
    assert gates_by_name["0.weight"] == [model[0]]
    assert gates_by_name["1.inner.0.weight"] == [model[1].inner[0], model[1]]
    assert gates_by_name["1.inner.0.bias"] == [model[1].inner[0]]


def test_a_later_pass_reading_a_parameter_before_its_gates_is_noted():
    """[Note: reads before the gate]: the first pass's gates, checked against a pass whose control flow differs."""
    model = ReadsLateEarlyLater()
    params, gates = first_pass_gates(model, torch.randn(2, 8))
    reads = ParameterReads(model, params, gates)
    reads.start()
    try:
        model(torch.randn(2, 8))
        assert reads.before_gate == {}
        model.read_late_first = True
        model(torch.randn(2, 8))
        model.late(torch.randn(2, 8))  # outside the forward pass: a read after it, not before a gate
    finally:
        reads.stop()
    late_bias = next(slot for slot, p in enumerate(params) if p is model.late.bias)
    late_weight = next(slot for slot, p in enumerate(params) if p is model.late.weight)
    assert list(reads.before_gate) == [late_bias]
    assert reads.after_forward == {late_weight, late_bias}

"""The first forward pass's parameter order: priorities and gates are derived from it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from commsched.order import ForwardRecorder


def recorded_order(model: nn.Module, *inputs: torch.Tensor) -> tuple[list[str], set[str]]:
    params = list(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    recorder = ForwardRecorder(model, params)
    model(*inputs)
    recorder.finish()
    order = [names[id(params[slot])] for slot in recorder.parameter_order(params)]
    return order, {names[id(params[slot])] for slot in recorder.used_before_owner}


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
    """``nn.MultiheadAttention`` reads ``out_proj``'s parameters without calling ``out_proj``."""
    layers = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                   enable_nested_tensor=False)
    order, early = recorded_order(layers, torch.randn(2, 5, 16))
    out_proj = [n for n in order if "out_proj" in n]
    assert early == set(out_proj) and len(out_proj) == 4
    assert order[: len(out_proj)] == [
        "layers.0.self_attn.out_proj.weight", "layers.0.self_attn.out_proj.bias",
        "layers.1.self_attn.out_proj.weight", "layers.1.self_attn.out_proj.bias",
    ]

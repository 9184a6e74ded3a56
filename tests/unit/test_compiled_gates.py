"""Where a compiled model's forward gates go (`commsched.layout.compiled_gates`): pure module-tree logic."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from commsched.layout.compiled_gates import CompiledGates, refuse_gates_in_full_graphs, repeated_blocks
from commsched.layout.grad_layout import gating_modules
from commsched.testing.models import TinyGPT, TinyResNet


def gates_by_name(prepared: nn.Module) -> dict[str, list[str]]:
    """Per parameter name, the names of the modules whose gates wait for it, in forward (definition) order."""
    params = list(prepared.parameters())
    names = {id(m): n for n, m in prepared.named_modules()}
    coarse = CompiledGates(prepared).coarsen(gating_modules(prepared, params, {}), list(range(len(params))))
    param_names = [n for n, _ in prepared.named_parameters()]
    return {param_names[s]: [names[id(m)] for m in gates] for s, gates in enumerate(coarse)}


def test_eager_model_keeps_a_gate_per_module():
    model = TinyGPT()
    gates = gates_by_name(model)
    assert gates["blocks.0.qkv.weight"] == ["blocks.0.qkv"]
    assert gates["tokens.weight"] == ["tokens", "head"]


def test_whole_compiled_gpt_is_gated_per_block_and_before_its_first_use_outside_them():
    model = torch.compile(TinyGPT(), backend="eager")
    gates = gates_by_name(model)
    assert gates["_orig_mod.blocks.1.fc.weight"] == ["_orig_mod.blocks.1"]
    assert gates["_orig_mod.tokens.weight"] == [""]  # the wrapper's gate: before the first block
    assert gates["_orig_mod.positions.weight"] == [""]
    assert gates["_orig_mod.norm.weight"] == ["_orig_mod.blocks.2"]  # after the last block
    assert {g for gs in gates.values() for g in gs} == {"", "_orig_mod.blocks.0", "_orig_mod.blocks.1",
                                                        "_orig_mod.blocks.2"}


def test_blocks_are_the_repeated_modules_nearest_the_top():
    assert [type(b).__name__ for b in repeated_blocks(TinyResNet())] == ["ResidualBlock"] * 2
    assert len(repeated_blocks(TinyGPT(layers=4))) == 4
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == []


def test_regions_without_blocks_and_full_graphs_are_gated_at_their_entry():
    mlp = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
    model = torch.compile(mlp, backend="eager")
    assert set(sum(gates_by_name(model).values(), [])) == {""}
    whole = torch.compile(TinyGPT(), backend="eager", fullgraph=True)
    assert set(sum(gates_by_name(whole).values(), [])) == {""}
    per_block = TinyGPT()
    per_block.blocks[0] = torch.compile(per_block.blocks[0], backend="eager", fullgraph=True)
    gates = gates_by_name(per_block)
    assert gates["blocks.0._orig_mod.qkv.weight"] == ["blocks.0"]
    assert gates["blocks.1.qkv.weight"] == ["blocks.1.qkv"]


def test_in_place_full_graph_is_refused_with_the_fix():
    model = TinyGPT()
    model.blocks[1].compile(backend="eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"'blocks\.1'.*fullgraph=True.*torch\.compile\(block, fullgraph=True\)"):
        refuse_gates_in_full_graphs(model)
    model.blocks[1].compile(backend="eager")
    refuse_gates_in_full_graphs(model)

"""Measuring a model's profile in one process (`commsched.profiling.model`): what it records, not how fast."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from commsched.profiling.link import measure_link
from commsched.profiling.model import profile_model, scaled_compute
from commsched.profiling.profile import PROFILE_VERSION, Profile, fit_link

LAYERS = ("0", "2", "4")
"""The Linear layers of `three_linear`, in forward order."""


def three_linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 32), torch.randint(5, (8,))


def profile_three_linear(model: nn.Module | None = None, **kwargs) -> Profile:
    model = model if model is not None else three_linear()
    return profile_model(model, batch, F.cross_entropy, iterations=3, warmup=1, name="three", **kwargs)


def by_name(profile: Profile) -> dict:
    return {p.name: p for p in profile.parameters}


def test_the_forward_pass_reads_layers_in_order_and_the_backward_pass_finishes_them_in_reverse():
    params = by_name(profile_three_linear())
    for kind in ("weight", "bias"):
        first_use = [params[f"{layer}.{kind}"].first_use_s for layer in LAYERS]
        ready = [params[f"{layer}.{kind}"].ready_s for layer in LAYERS]
        assert first_use == sorted(first_use) and len(set(first_use)) == 3, first_use
        assert ready == sorted(ready, reverse=True) and len(set(ready)) == 3, ready


def test_sizes_order_and_totals():
    model = three_linear()
    profile = profile_three_linear(model)
    assert [p.name for p in profile.parameters] == [n for n, _ in model.named_parameters()]
    assert profile.parameters, "no parameter profiled"
    for p, (_, param) in zip(profile.parameters, model.named_parameters(), strict=True):
        assert (p.numel, p.element_size) == (param.numel(), 4)
    assert profile.gradient_bytes == 4 * sum(p.numel() for p in model.parameters())
    assert profile.model == "three" and profile.device == "cpu" and profile.batch_size == 8
    assert profile.forward_s > 0 and profile.update_s > 0
    assert profile.backward_s == max(p.ready_s for p in profile.parameters)
    assert all(0 < p.first_use_s < profile.forward_s for p in profile.parameters)
    assert profile.link is None


def test_a_float64_parameter_counts_eight_bytes_an_element():
    model = three_linear().double()
    profile = profile_model(model, lambda: (torch.randn(4, 32, dtype=torch.float64), torch.randint(5, (4,))),
                            F.cross_entropy, iterations=1, warmup=0)
    assert {p.element_size for p in profile.parameters} == {8}


def test_the_leaf_modules_that_ran_with_their_own_times():
    profile = profile_three_linear()
    assert [m.name for m in profile.modules] == ["0", "1", "2", "3", "4"]
    linear = [m for m in profile.modules if m.name in LAYERS]
    assert all(m.forward_s > 0 and m.backward_s > 0 for m in linear)


def test_the_optimizer_given_is_the_one_stepped():
    model = three_linear()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    profile_three_linear(model, optimizer=optimizer)
    assert optimizer.state[model[0].weight]["step"] == 4  # one warm-up and three measured iterations


def test_a_frozen_parameter_is_left_out():
    model = three_linear()
    model[2].weight.requires_grad_(False)
    names = [p.name for p in profile_three_linear(model).parameters]
    assert "2.weight" not in names and "2.bias" in names and len(names) == 5


def test_no_trainable_parameter_is_refused():
    model = three_linear().requires_grad_(False)
    with pytest.raises(ValueError, match="has no trainable parameters"):
        profile_three_linear(model)


class ReadsAHeadInItsOwnForward(nn.Module):
    """``head`` is never called: its weight is read by the root after ``body`` ran; ``scale`` by the loss."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.stem(x).mean((2, 3)))
        return F.linear(h, self.head.weight, self.head.bias)


def test_parameters_read_outside_their_module_and_in_place_activations():
    model = ReadsAHeadInItsOwnForward()
    profile = profile_model(
        model, lambda: (torch.randn(4, 3, 8, 8), torch.randint(4, (4,))),
        lambda output, y: F.cross_entropy(output * model.scale, y), iterations=2, warmup=1,
    )
    params = by_name(profile)
    assert params["stem.0.weight"].first_use_s < params["body.weight"].first_use_s
    assert params["body.weight"].first_use_s < params["head.weight"].first_use_s
    assert params["head.weight"].first_use_s < params["scale"].first_use_s < profile.forward_s
    modules = {m.name: m for m in profile.modules}
    assert "head" not in modules  # never called as a module
    assert all(modules[name].backward_s > 0 for name in ("stem.0", "stem.1", "stem.2", "body"))


def test_every_hook_is_removed_afterwards():
    model = ReadsAHeadInItsOwnForward()
    profile_model(model, lambda: (torch.randn(2, 3, 8, 8), torch.randint(4, (2,))),
                  lambda output, y: F.cross_entropy(output, y), iterations=1, warmup=0)
    modules, params = list(model.modules()), list(model.parameters())
    assert modules and params
    for module in modules:
        assert not module._forward_pre_hooks and not module._forward_hooks, module
    for param in params:
        assert not param._post_accumulate_grad_hooks


def test_save_and_load_give_the_same_profile(tmp_path):
    profile = profile_three_linear()
    path = tmp_path / "three.json"
    profile.save(path)
    assert Profile.load(path) == profile


def test_a_link_survives_the_round_trip_and_a_missing_slowdown_reads_as_none(tmp_path):
    from commsched.profiling.profile import LinkProfile, LinkSample

    link = LinkProfile(2, (LinkSample(2**16, 1e-3), LinkSample(2**20, 9e-3)), 5e-4, 1.2e8,
                       compute_slowdown=0.25, collective_slowdown=0.75, in_flight=2)
    profile = profile_three_linear().with_link(link)
    path = tmp_path / "linked.json"
    profile.save(path)
    assert Profile.load(path) == profile
    data = profile.to_dict()
    del data["link"]["collective_slowdown"], data["link"]["compute_slowdown"], data["link"]["in_flight"]
    # A profile taken before these were measured: nothing slows anything, one collective at a time.
    assert Profile.from_dict(data).link == dataclasses.replace(link, compute_slowdown=0.0, collective_slowdown=0.0,
                                                               in_flight=1)


def test_a_profile_of_another_version_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "old.json"
    data = profile_three_linear().to_dict()
    data["version"] = PROFILE_VERSION + 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"format version {PROFILE_VERSION + 1}.*--save-profile"):
        Profile.load(path)


def test_scaled_compute_scales_every_compute_time_and_nothing_else():
    profile = profile_three_linear()
    faster = scaled_compute(profile, 0.5)
    assert faster.forward_s == profile.forward_s * 0.5 and faster.update_s == profile.update_s * 0.5
    assert faster.backward_s == profile.backward_s * 0.5
    assert profile.parameters and profile.modules, "nothing profiled: nothing to compare"
    for a, b in zip(profile.parameters, faster.parameters, strict=True):
        assert (b.first_use_s, b.ready_s, b.numel) == (a.first_use_s * 0.5, a.ready_s * 0.5, a.numel)
    for a, b in zip(profile.modules, faster.modules, strict=True):
        assert (b.forward_s, b.backward_s) == (a.forward_s * 0.5, a.backward_s * 0.5)
    with pytest.raises(ValueError, match="compute scale must be a finite number > 0"):
        scaled_compute(profile, 0)


def test_the_link_fit_finds_a_line_and_keeps_to_the_floor():
    sizes = [2**16, 2**20, 2**23]
    latency, bandwidth = fit_link(sizes, [30e-6 + n / 1e9 for n in sizes])
    assert latency == pytest.approx(30e-6) and bandwidth == pytest.approx(1e9)
    assert fit_link(sizes, [30e-6 + n / 1e9 for n in sizes], floor_s=50e-6)[0] == 50e-6
    latency, bandwidth = fit_link(sizes, [1e-3, 1e-3, 1e-3], floor_s=1e-4)  # flat: noise
    assert latency == 1e-4 and bandwidth == pytest.approx(2**23 / 0.9e-3)
    latency, _ = fit_link(sizes, [1e-3, 1e-3, 1e-3], floor_s=5e-3)  # a slow one-element all-reduce
    assert latency == 1e-3


def test_one_link_size_cannot_make_a_line():
    with pytest.raises(ValueError, match="at least two different sizes"):
        measure_link(None, "cpu", (2**16, 2**16 + 1))  # refused before any collective


def test_lazy_modules_take_their_shapes_before_profiling():
    model = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 5))
    profile = profile_model(model, batch, F.cross_entropy, iterations=1, warmup=0)
    assert by_name(profile)["0.weight"].numel == 16 * 32

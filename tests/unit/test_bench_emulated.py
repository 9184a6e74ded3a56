"""Emulated workloads: real gradients at the profile's sizes, charged the profile's times as sleep."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from commsched.bench.emulated import (
    EMULATED_WORKLOADS,
    MIN_SLEEP_S,
    EmulatedLayer,
    EmulatedNet,
    _Clock,
    _Layer,
    gpt2_small_profile,
    load_profile,
)
from commsched.bench.models import WORKLOADS, input_layer_share
from commsched.profiling.profile import ModuleProfile, ParameterProfile, Profile


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """As each emulated host runs (`commsched.bench.grid`): a second thread only waits on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batch(name: str, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return next(WORKLOADS[name].batches(size, seed))


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


@pytest.mark.parametrize("profile_name", ["resnet50", "gpt2-small"])
def test_every_parameter_gets_a_finite_nonzero_gradient(profile_name):
    torch.manual_seed(0)
    net = EmulatedNet(load_profile(profile_name), size_scale=0.001, time_scale=0.001)
    x, y = batch("resnet50-emulated", 8)
    F.cross_entropy(net(x), y).backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert (p.grad != 0).all(), name


def test_gradients_become_ready_in_reverse_forward_order_at_the_profile_times():
    profile, scale = load_profile("vgg16"), 0.2
    torch.manual_seed(0)
    net = EmulatedNet(profile, size_scale=0.0001, time_scale=scale)
    ready: dict[str, float] = {}

    def note(name: str):
        def hook(_: torch.Tensor) -> None:
            ready.setdefault(name, time.perf_counter())
        return hook

    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(note(name))
    x, y = batch("vgg16-emulated", 4)
    start = time.perf_counter()
    loss = F.cross_entropy(net(x), y)
    forward_s = time.perf_counter() - start
    start = time.perf_counter()
    loss.backward()
    backward_s = time.perf_counter() - start

    assert forward_s >= 0.9 * scale * profile.forward_s
    assert backward_s >= 0.9 * scale * profile.backward_s
    by_name = {p.name: p for p in profile.parameters}
    modules = list(dict.fromkeys(module_of(by_name[i].name) for i in
                                 sorted(by_name, key=lambda n: by_name[n].first_use_s)))
    layer_ready = [max(t for n, t in ready.items() if module_of(n) == m) for m in modules]
    assert layer_ready == sorted(layer_ready, reverse=True), "the backward pass runs the layers in reverse"
    for name, when in ready.items():
        assert when - start >= scale * by_name[name].ready_s - MIN_SLEEP_S - 1e-4, name


@pytest.mark.parametrize("workload", sorted(EMULATED_WORKLOADS))
def test_gradient_bytes_are_the_profiles_times_the_size_scale(workload):
    emulated = EMULATED_WORKLOADS[workload]
    profile = emulated.profile()
    net = EmulatedNet(profile, emulated.size_scale, time_scale=0.0)
    params = list(net.named_parameters())
    assert [name for name, _ in params] == [p.name for p in profile.parameters]
    nbytes = sum(p.numel() * p.element_size() for _, p in params)
    assert nbytes == emulated.gradient_bytes
    assert abs(nbytes - profile.gradient_bytes * emulated.size_scale) <= 4 * len(params)


@pytest.mark.parametrize("workload", sorted(EMULATED_WORKLOADS))
def test_the_profile_as_emulated_has_the_nets_sizes_and_scaled_times(workload):
    emulated = EMULATED_WORKLOADS[workload]
    profile, as_run = emulated.profile(), emulated.as_emulated()
    net = emulated.build()
    assert [p.numel for p in as_run.parameters] == [p.numel() for p in net.parameters()]
    assert as_run.gradient_bytes == emulated.gradient_bytes
    assert as_run.forward_s + as_run.backward_s == pytest.approx(emulated.compute_s)
    times = [t for a in as_run.parameters for t in (a.ready_s, a.first_use_s)]
    scaled = [t * emulated.time_scale for p in profile.parameters for t in (p.ready_s, p.first_use_s)]
    assert times == pytest.approx(scaled)


@pytest.mark.parametrize("workload", sorted(EMULATED_WORKLOADS))
def test_factors_balance_compute_and_a_ring_all_reduce_from_a_quarter_to_one_gbit(workload):
    emulated = EMULATED_WORKLOADS[workload]
    assert 0.1 <= emulated.compute_s <= 0.3
    for hosts in (8, 16):
        for gbit in (0.25, 1.0):
            allreduce_s = 2 * (hosts - 1) / hosts * emulated.gradient_bytes * 8 / (gbit * 1e9)
            assert 0.45 <= allreduce_s / emulated.compute_s <= 2.3, (hosts, gbit)


def test_data_parallel_halves_average_to_the_whole_batch():
    torch.manual_seed(0)
    net = EmulatedNet(load_profile("resnet50"), size_scale=0.001, time_scale=0.001)
    x, y = batch("resnet50-emulated", 8, seed=3)

    def grads(inputs, labels):
        net.zero_grad()
        F.cross_entropy(net(inputs), labels).backward()
        return [p.grad.clone() for p in net.parameters()]

    whole = grads(x, y)
    halves = zip(grads(x[:4], y[:4]), grads(x[4:], y[4:]))
    for full, (first, second) in zip(whole, halves):
        torch.testing.assert_close((first + second) / 2, full, rtol=1e-5, atol=1e-6 * float(full.abs().max()))


def test_the_written_out_backward_is_the_derivative():
    torch.manual_seed(0)
    layer = EmulatedLayer([("weight", 7), ("bias", 3)], _Clock(), 0.0, 0.0, gain=0.7).double()
    h = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight, bias = (p.detach().clone().requires_grad_() for p in layer.parameters())
    assert torch.autograd.gradcheck(lambda h, w, b: _Layer.apply(h, layer, w, b), (h, weight, bias))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_hundred_steps_stay_finite(optimizer):
    torch.manual_seed(0)
    net = EmulatedNet(load_profile("vgg16"), size_scale=0.001, time_scale=0.001)
    opt = (torch.optim.SGD(net.parameters(), lr=0.1) if optimizer == "sgd"
           else torch.optim.Adam(net.parameters(), lr=0.01))
    batches = WORKLOADS["vgg16-emulated"].batches(16)
    for _ in range(200):
        x, y = next(batches)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    for name, p in net.named_parameters():
        assert torch.isfinite(p).all() and torch.isfinite(p.grad).all(), name


def test_deepcopy_and_state_dict_round_trip():
    profile = load_profile("resnet50")
    torch.manual_seed(0)
    net = EmulatedNet(profile, size_scale=0.001, time_scale=0.001)
    x, y = batch("resnet50-emulated", 4)
    twin = copy.deepcopy(net)
    torch.testing.assert_close(twin(x), net(x), rtol=0, atol=0)
    F.cross_entropy(twin(x), y).backward()
    assert all(p.grad is None for p in net.parameters()), "the copy shares nothing with the original"

    torch.manual_seed(1)
    other = EmulatedNet(profile, size_scale=0.001, time_scale=0.001)
    assert not torch.equal(other(x), net(x))
    state = net.state_dict()
    assert list(state) == [p.name for p in profile.parameters]
    other.load_state_dict(state)
    torch.testing.assert_close(other(x), net(x), rtol=0, atol=0)


def test_gpt2_small_profile_is_124m_parameters_with_the_tied_embedding_first_and_last():
    profile = gpt2_small_profile()
    assert sum(p.numel for p in profile.parameters) == 124_439_808
    assert profile.gradient_bytes == 4 * 124_439_808
    wte = profile.parameters[0]
    assert wte.name == "transformer.wte.weight" and wte.numel == 50257 * 768
    assert wte.first_use_s == 0.0 and wte.ready_s == max(p.ready_s for p in profile.parameters)
    assert wte.ready_s == pytest.approx(profile.backward_s)
    assert "derived" in profile.device and "not measured" in profile.device

    tokens, linear = 8 * 1024, 12 * (768 * 2304 + 2304 + 768 * 768 + 768 + 2 * (768 * 3072) + 3072 + 768)
    flops = 2 * tokens * (linear + 50257 * 768) + 12 * 4 * 1024 * 768 * tokens
    assert profile.forward_s == pytest.approx(flops / 40e12)
    assert profile.backward_s == pytest.approx(2 * profile.forward_s)
    assert gpt2_small_profile(tflops=80).forward_s == pytest.approx(profile.forward_s / 2)
    assert input_layer_share("gpt2-emulated") == pytest.approx(wte.numel / 124_439_808, rel=1e-3)


def test_module_times_place_the_layers_where_the_parameters_have_no_timeline():
    flat = Profile("flat", "cpu", 1, forward_s=0.3, backward_s=0.6, update_s=0.0,
                   parameters=(ParameterProfile("a.weight", 10, 4, 0.0, 0.0),
                               ParameterProfile("b.weight", 10, 4, 0.0, 0.0)),
                   modules=(ModuleProfile("a", 0.05, 0.2), ModuleProfile("b", 0.1, 0.1)))
    net = EmulatedNet(flat, time_scale=2.0)
    assert [net.a._forward_s, net.b._forward_s] == pytest.approx([0.2, 0.4])
    assert [net.a._backward_s, net.b._backward_s] == pytest.approx([0.8, 0.4])


def test_the_sleeps_leave_the_gil_and_the_core_to_others():
    torch.manual_seed(0)
    net = EmulatedNet(load_profile("vgg16"), size_scale=0.0001, time_scale=0.3)
    x, _ = batch("vgg16-emulated", 4)
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        time.sleep(0.02)
        before, cpu, wall = count[0], time.thread_time(), time.perf_counter()
        with torch.no_grad():
            net(x)
        cpu, wall, counted = time.thread_time() - cpu, time.perf_counter() - wall, count[0] - before
    finally:
        stop.set()
        thread.join()
    assert wall >= 0.9 * 0.3 * load_profile("vgg16").forward_s
    assert cpu < 0.25 * wall, "the forward pass kept its core busy"
    assert counted > 1000, "the other thread did not run during the forward pass"


def test_a_module_split_across_the_forward_order_is_run_layer_by_layer_in_that_order():
    split = Profile("split", "cpu", 1, forward_s=0.003, backward_s=0.003, update_s=0.0,
                    parameters=(ParameterProfile("a.x.weight", 4, 4, 0.0, 0.003),
                                ParameterProfile("a.y.weight", 4, 4, 0.002, 0.001),
                                ParameterProfile("b.weight", 4, 4, 0.001, 0.002)))
    net = EmulatedNet(split, time_scale=0.0)
    called: list[str] = []
    for name, module in net.named_modules():
        if isinstance(module, EmulatedLayer):
            module.register_forward_pre_hook(lambda module, args, name=name: called.append(name))
    x, y = batch("vgg16-emulated", 2)
    F.cross_entropy(net(x), y).backward()
    assert called == ["a.x", "b", "a.y"]
    assert [name for name, _ in net.named_parameters()] == [p.name for p in split.parameters]

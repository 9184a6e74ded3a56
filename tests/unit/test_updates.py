"""Per-bucket updates equal torch.optim's step, on one process."""

from __future__ import annotations

import copy

import pytest
import torch

from commsched.update.fused import BucketUpdater
from commsched.update.kinds import unsupported_reason

CONFIGS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_momentum_dampening_wd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01)),
    "sgd_nesterov_maximize": (torch.optim.SGD, dict(lr=0.1, momentum=0.8, nesterov=True, maximize=True)),
    "adam": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=0.01, amsgrad=True, betas=(0.8, 0.95))),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "adamw_maximize": (torch.optim.AdamW, dict(lr=0.01, maximize=True, eps=1e-6)),
}


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (3,), (5, 2), (2,), (6,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(3, generator=generator, dtype=torch.float64)))
    return params


def stateless(cls, options) -> bool:
    """torch.optim keeps no per-parameter state for plain SGD (no momentum)."""
    return cls is torch.optim.SGD and not options.get("momentum")


def param_groups(params, options):
    # Two groups with different hyper-parameters (decay / no decay), as in real AdamW setups.
    no_decay = dict(options, weight_decay=0.0)
    return [{"params": params[:3], **options}, {"params": params[3:5], **no_decay}, {"params": params[5:], **options}]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bucket_updates_match_torch_optim(name, fused):
    cls, options = CONFIGS[name]
    expected_params, actual_params = make_params(), make_params()
    expected = cls(param_groups(expected_params, options))
    actual = cls(param_groups(actual_params, options))
    # Buckets cut across param groups; slot 4 never gets a gradient in the second step.
    buckets = [[0, 3], [1, 2, 4], [5]]
    grads = [torch.zeros_like(p) for p in actual_params]
    updater = BucketUpdater(
        actual,
        [[actual_params[s] for s in b] for b in buckets],
        [[grads[s] for s in b] for b in buckets],
        buckets,
        fused=fused,
    )
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        for s, (e, g) in enumerate(zip(expected_params, grads)):
            g.copy_(torch.randn(g.shape, generator=generator, dtype=g.dtype))
            e.grad = None if (step == 1 and s == 4) else g.clone()
        expected.step()
        hyperparameters = updater.snapshot()
        for group in actual.param_groups:
            group["lr"] *= 10  # an LR change after step() must not leak into this update
        for bucket in (2, 0, 1):  # any completion order
            updater.update(bucket, hyperparameters, frozenset({4}) if step == 1 else frozenset())
        for group in actual.param_groups:
            group["lr"] /= 10
        for e, a in zip(expected_params, actual_params):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    # The state is torch.optim's own: it loads into a plain optimizer and back.
    state = copy.deepcopy(actual.state_dict())
    plain = cls(param_groups(make_params(), options))
    plain.load_state_dict(state)
    reference_state = expected.state_dict()["state"]
    assert state["state"].keys() == reference_state.keys()
    compared = 0
    for index, entries in reference_state.items():
        assert state["state"][index].keys() == entries.keys()
        for key, value in entries.items():
            torch.testing.assert_close(state["state"][index][key], value, rtol=1e-5, atol=1e-6)
            compared += 1
    # Plain SGD (no momentum) keeps no state; every other optimizer here keeps some per parameter.
    assert compared >= (0 if stateless(cls, options) else len(expected_params)), compared


def test_parameters_the_optimizer_does_not_own_are_left_alone():
    params = make_params()
    optimizer = torch.optim.SGD(params[:2], lr=0.1)
    grads = [torch.ones_like(p) for p in params]
    before = params[2].detach().clone()
    updater = BucketUpdater(optimizer, [params[:3]], [grads[:3]], [[0, 1, 2]], fused=True)
    updater.update(0, updater.snapshot())
    assert torch.equal(params[2], before)
    assert not torch.equal(params[0], make_params()[0])


def test_unsupported_optimizers_and_options_are_named():
    params = make_params()
    assert "RMSprop has no per-bucket update" in unsupported_reason(torch.optim.RMSprop(params))
    assert "differentiable=True" in unsupported_reason(torch.optim.SGD(params, lr=0.1, differentiable=True))
    assert unsupported_reason(torch.optim.AdamW(params)) is None
    with pytest.raises(ValueError, match="RMSprop"):
        BucketUpdater(torch.optim.RMSprop(params), [], [], [], fused=True)


LOW_PRECISION_CONFIGS = {
    "sgd_momentum_wd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "sgd_nesterov_dampening": (torch.optim.SGD, dict(lr=0.1, momentum=0.8, dampening=0.0, nesterov=True)),
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "adam": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01, eps=1e-4)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=0.01, amsgrad=True, eps=1e-4)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, eps=1e-4)),
}
KERNEL_CHOICES = {"default": {}, "foreach": dict(foreach=True), "for_loop": dict(foreach=False), "fused": dict(fused=True)}
# Not SGD with fused=True: on CPU, torch's own fused SGD kernel leaves most elements of a
# float16/bfloat16 parameter unchanged and its momentum differs from run to run (torch 2.13).
LOW_PRECISION_CASES = [
    (name, kernel) for name in sorted(LOW_PRECISION_CONFIGS) for kernel in sorted(KERNEL_CHOICES)
    if not (kernel == "fused" and LOW_PRECISION_CONFIGS[name][0] is torch.optim.SGD)
]


@pytest.mark.parametrize(("name", "kernel"), LOW_PRECISION_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_low_precision_updates_are_torch_optims_bit_for_bit(dtype, name, kernel):
    """Strategy(fuse_optimizer=True) on float16/bfloat16 parameters: the update is the one
    torch.optim's step() runs on the same dtype with the optimizer's own kernel choice,
    bit for bit (torch's kernels differ among themselves on these dtypes)."""
    cls, options = LOW_PRECISION_CONFIGS[name]
    options = dict(options, **KERNEL_CHOICES[kernel])
    generator = torch.Generator().manual_seed(0)
    # Over 16 elements, so that vectorised kernel paths run as well as scalar tails.
    initial = [torch.randn(shape, generator=generator).to(dtype) for shape in [(8, 5), (40,), (3,)]]
    expected_params = [torch.nn.Parameter(t.clone()) for t in initial]
    actual_params = [torch.nn.Parameter(t.clone()) for t in initial]
    expected = cls([{"params": expected_params[:2]}, {"params": expected_params[2:], "lr": 0.05}], **options)
    actual = cls([{"params": actual_params[:2]}, {"params": actual_params[2:], "lr": 0.05}], **options)
    grads = [torch.zeros_like(p) for p in actual_params]
    buckets = [[0, 2], [1]]
    updater = BucketUpdater(
        actual, [[actual_params[s] for s in b] for b in buckets], [[grads[s] for s in b] for b in buckets],
        buckets, fused=True,
    )
    for _ in range(5):
        for e, g in zip(expected_params, grads):
            g.copy_(torch.randn(g.shape, generator=generator).to(dtype))
            e.grad = g.clone()
        expected.step()
        hyperparameters = updater.snapshot()
        for bucket in (1, 0):
            updater.update(bucket, hyperparameters)
        for index, (a, e) in enumerate(zip(actual_params, expected_params)):
            assert torch.equal(a, e), f"parameter {index} differs by up to {(a - e).abs().max().item():.3g}"
    compared = 0
    for a, e in zip(actual_params, expected_params, strict=True):
        for key, value in expected.state[e].items():
            assert torch.equal(actual.state[a][key], value), key
            compared += 1
    assert compared >= (0 if stateless(cls, options) else len(expected_params)), compared


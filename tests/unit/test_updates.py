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
    for index, entries in reference_state.items():
        assert state["state"][index].keys() == entries.keys()
        for key, value in entries.items():
            torch.testing.assert_close(state["state"][index][key], value, rtol=1e-5, atol=1e-6)


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

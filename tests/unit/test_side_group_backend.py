"""A side group takes CPU tensors (control messages) and the user group's devices (buffers)."""

from __future__ import annotations

import pytest

from commsched.comm.side_groups import backend_device_types, side_group_backend


@pytest.mark.parametrize(("user_backend", "side_backend"), [
    ("gloo", "gloo"),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
    ("nccl", "cpu:gloo,cuda:nccl"),
    ("xccl", "cpu:gloo,xpu:xccl"),
    ("cuda:gloo", "cpu:gloo,cuda:gloo"),
])
def test_gloo_is_added_for_cpu_tensors_only_where_the_backend_has_none(user_backend, side_backend):
    assert side_group_backend(user_backend) == side_backend
    assert backend_device_types(side_backend) >= backend_device_types(user_backend) | {"cpu"}

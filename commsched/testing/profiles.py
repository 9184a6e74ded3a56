"""Synthetic profiles for tests of the cost model and the simulator."""

from __future__ import annotations

from commsched.profiling.profile import ParameterProfile, Profile
from commsched.strategy import MIB


def make_profile(sizes_mb, forward_s=0.05, backward_s=0.1, update_s=0.01, element_size=4) -> Profile:
    """Parameters used in order by the forward pass, evenly over it; gradients ready in reverse,
    evenly over the backward pass (the first parameter's last, when the backward pass ends)."""
    count = len(sizes_mb)
    params = tuple(
        ParameterProfile(f"layer{i}", max(1, int(mb * MIB) // element_size), element_size,
                         forward_s * i / count, backward_s * (count - i) / count)
        for i, mb in enumerate(sizes_mb)
    )
    return Profile("synthetic", "cpu", 8, forward_s, backward_s, update_s, params)


def balanced_profile(**overrides) -> Profile:
    """20 layers from 0.1 MiB at the input to 8 MiB at the output (about 60 MiB)."""
    return make_profile([0.1 + 7.9 * (i / 19) ** 2 for i in range(20)], **overrides)

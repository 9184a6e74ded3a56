"""``torch.profiler`` labels on the phases a user sees in a profile: ``commsched::gate`` (a module
waiting for its buckets), ``commsched::reduce_wait`` (the host waiting for a bucket's reduction),
``commsched::update`` (a bucket's update), ``commsched::step`` and ``commsched::warmup`` (the end
of warm-up: the cost model's choice, the plan).

A label costs about 13 microseconds where no profiler runs (``record_function``'s own entry), too
much for a hook run per module per iteration; so one is made only while a profiler records.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch.profiler import record_function

_NOTHING = contextlib.nullcontext()

try:
    _profiler_enabled = torch._C._autograd._profiler_enabled
except AttributeError:  # a torch without it: always label
    def _profiler_enabled() -> bool:
        return True


def phase(name: str) -> ContextManager[object]:
    """``with phase("commsched::update"):`` labels what runs inside in a profile, if one is being taken."""
    return record_function(name) if _profiler_enabled() else _NOTHING

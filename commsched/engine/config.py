"""`RunConfig`: the user's `Strategy`, resolved once by ``prepare()`` into what the engine reads.

Below `commsched.api` nothing reads a `Strategy`: the engine reads this, and
hands each part it builds only what that part needs (a timeout, a credit in
bytes). One field changes while the model trains: the layout in use, which
the cost model's choice at the end of warm-up and the auto-tuner's settings
replace (`with_layout`); every other field is fixed at ``prepare()``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from commsched.layout.setting import LayoutSetting
from commsched.strategy import ParameterServer, Strategy
from commsched.tuning.controller import TuningConfig


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What a prepared model runs with."""

    layout: LayoutSetting
    """The layout in use: the configured one until the cost model or the auto-tuner replaces it."""
    overlap_requested: bool
    """``Strategy.overlap_forward``: whether forward overlap may be on at all."""
    priority: bool
    adaptive: bool
    """The cost model picks the partitioning at the end of warm-up (``Strategy.adaptive`` where it
    applies: the all-reduce backend with priority)."""
    tuning: TuningConfig | None
    """``Strategy(autotune=True)``: the search's budget and seed; None: no auto-tuning."""
    measures_choice: bool = False
    """``Strategy.measures_its_choice``: the cost model's choice is measured against the configured
    buckets sent whole after warm-up."""
    broadcast_buffers: bool
    check_finite: str | None
    """``Strategy.check_finite``: None, ``"skip"`` or ``"raise"``."""
    timeout_s: float
    trace_dir: str | os.PathLike | None
    block_mb: float | None = None
    """With parameter servers: their largest block, which caps the buckets too."""

    @classmethod
    def of(cls, strategy: Strategy) -> RunConfig:
        backend = strategy.backend
        return cls(
            layout=LayoutSetting.of(strategy),
            overlap_requested=strategy.overlap_forward,
            priority=strategy.priority,
            adaptive=strategy.cost_model_picks_partitioning,
            tuning=TuningConfig.of(strategy) if strategy.autotune else None,
            measures_choice=strategy.measures_its_choice,
            broadcast_buffers=strategy.broadcast_buffers,
            check_finite=strategy.check_finite,
            timeout_s=strategy.timeout_s,
            trace_dir=strategy.trace_dir,
            block_mb=backend.block_mb if isinstance(backend, ParameterServer) else None,
        )

    def with_layout(self, layout: LayoutSetting) -> RunConfig:
        return dataclasses.replace(self, layout=layout)

    @property
    def bucket_size_limits_bytes(self) -> list[int]:
        return self.layout.bucket_size_limits_bytes(self.block_mb)

    @property
    def partition_bytes(self) -> int | None:
        return self.layout.partition_bytes

    @property
    def credit_bytes(self) -> int | None:
        return self.layout.credit_bytes

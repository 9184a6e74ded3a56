"""What a parameter server reports: `ServerReport` when it finishes, `ParameterServerError` when it
cannot go on."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


class ParameterServerError(RuntimeError):
    """A worker was lost or the workers disagree; the server stops."""


@dataclass
class ServerReport:
    """What one server did, returned by `ParameterServer.serve` and logged."""

    rank: int
    blocks: int
    bytes: int
    updates: int = 0
    iterations: int = 0
    staleness: list[int] = field(default_factory=list)
    max_lead: int = 0
    """Async: the most iterations a worker was ahead of the slowest one still
    training when it was sent new values."""

    @property
    def staleness_mean(self) -> float:
        return statistics.fmean(self.staleness) if self.staleness else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.staleness, default=0)

    def describe(self) -> str:
        text = (f"parameter server rank {self.rank}: {self.blocks} blocks ({self.bytes / 1e6:.2f} MB), "
                f"{self.iterations} iterations, {self.updates} block updates")
        if self.staleness:
            text += (f", staleness mean {self.staleness_mean:.2f} max {self.staleness_max} updates, "
                     f"workers at most {self.max_lead} iterations apart")
        return text

"""`JobConfig`: what both sides of a parameter-server job run with, resolved once from the `Strategy`.

Workers and servers must derive the same blocks from the same numbers, so both
take them from here (`join_parameter_server_job` builds it).
"""

from __future__ import annotations

from dataclasses import dataclass

from commsched.strategy import ParameterServer as ParameterServerConfig
from commsched.strategy import Strategy


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    mode: str
    """``"sync"`` or ``"async"`` (`commsched.ParameterServer.mode`)."""
    max_staleness: int | None
    """With ``mode="async"``: how many iterations a worker may run ahead of the slowest one."""
    block_bytes: int
    """Target size of a block (`Strategy.ps_block_bytes`)."""
    bucket_size_limits_bytes: tuple[int, ...]
    fuse_optimizer: bool
    """The servers update with torch's fused kernels where they can."""
    timeout_s: float

    @classmethod
    def of(cls, strategy: Strategy) -> JobConfig:
        backend = strategy.backend
        assert isinstance(backend, ParameterServerConfig)
        return cls(mode=backend.mode, max_staleness=backend.max_staleness, block_bytes=strategy.ps_block_bytes,
                   bucket_size_limits_bytes=tuple(strategy.bucket_size_limits_bytes),
                   fuse_optimizer=strategy.fuse_optimizer, timeout_s=strategy.timeout_s)

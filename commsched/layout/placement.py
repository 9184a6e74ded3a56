"""Where parameter-server blocks go, and how large they are: shared by the backend and the simulator.

Pure logic. The parameter-server backend (`commsched.ps.sharding`) cuts a model
into blocks and places them with these rules; the simulator
(`commsched.simulator`) must place them the same way to predict the busiest
server link, so both take them from here.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_BLOCK_BYTES = 64 * 1024
"""Smallest block worth a message of its own, unless smaller blocks are asked for."""

BLOCKS_PER_SERVER = 4
"""Blocks are made small enough for about this many per server, so that placement
can balance the bytes (a model of five 1 MiB blocks cannot be split evenly over
four servers), but not below `MIN_BLOCK_BYTES`."""


def server_block_bytes(block_bytes: int, total_bytes: int, num_servers: int) -> int:
    """``block_bytes``, lowered if needed to about `BLOCKS_PER_SERVER` blocks per server."""
    return min(block_bytes, max(MIN_BLOCK_BYTES, total_bytes // (BLOCKS_PER_SERVER * num_servers)))


def place_blocks(block_nbytes: Sequence[int], num_servers: int) -> list[int]:
    """Largest block first onto the least loaded server; ties go to the lower index."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    loads = [0] * num_servers
    servers = [0] * len(block_nbytes)
    for block in sorted(range(len(block_nbytes)), key=lambda b: (-block_nbytes[b], b)):
        server = min(range(num_servers), key=lambda s: (loads[s], s))
        servers[block] = server
        loads[server] += block_nbytes[block]
    return servers

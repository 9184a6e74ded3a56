"""commsched: communication scheduling for data-parallel PyTorch training.

Glossary
--------
block
    with parameter servers: a row-aligned slice of a bucket, held by one server
    (`commsched.ps.sharding`); each block is one partition on the wire.
bucket
    parameters whose gradients live contiguously in one flat buffer (one dtype
    and device); each ``param.grad`` is a view into it.
credit
    the most bytes in flight during the backward pass; a partition is issued
    only if it fits.
gate
    a forward pre-hook on a module that waits for its own buckets' updates
    (forward overlap).
handle
    an operation in flight (a partition's reduction); ``wait()`` it before reading.
partition
    a contiguous slice of a bucket: the unit on the wire and of scheduling.
plan
    the sequence in which partitions are issued; the same on every rank.
reducer
    the per-model object that turns "gradient ready" into "parameter updated",
    issuing partitions in one order on every rank.
server
    with ``Strategy(backend=ParameterServer(...))``, one of the last
    ``num_servers`` ranks (`is_server_rank`): it calls `serve`, holds blocks,
    runs the optimizer on them and sends the new values back.
strategy
    the single, validated object holding every knob (`Strategy`).
transport / update policy
    the two parts of a backend: what goes on the wire for a partition, and
    where the optimizer runs.
"""

from commsched.api import ServingFinished, prepare, release, serve, status
from commsched.engine.lifecycle import Lifecycle
from commsched.errors import CommunicationTimeout, NonFiniteGradients
from commsched.integrations.ddp import DistributedDataParallel
from commsched.layout.buckets import compute_bucket_assignment_by_size
from commsched.prepared.module import CommschedModule
from commsched.prepared.optimizer import CommschedOptimizer
from commsched.ps.roles import is_server_rank
from commsched.status import Status
from commsched.strategy import AllReduce, ParameterServer, PowerSGD, Strategy

__all__ = [
    "AllReduce",
    "CommschedModule",
    "CommschedOptimizer",
    "CommunicationTimeout",
    "DistributedDataParallel",
    "Lifecycle",
    "NonFiniteGradients",
    "ParameterServer",
    "PowerSGD",
    "ServingFinished",
    "Status",
    "Strategy",
    "compute_bucket_assignment_by_size",
    "is_server_rank",
    "prepare",
    "release",
    "serve",
    "status",
]
__version__ = "0.1.0"

"""commsched: communication scheduling for data-parallel PyTorch training.

Glossary
--------
block
    with parameter servers: a row-aligned slice of a bucket, held by one server
    (`commsched.sharding`); each block is one partition on the wire.
bucket
    parameters whose gradients live contiguously in one flat buffer (one dtype
    and device); each ``param.grad`` is a view into it.
handle
    an operation in flight (a bucket's reduction); ``wait()`` it before reading.
reducer
    the per-model object that turns "gradient ready" into "gradient averaged
    over all ranks", launching buckets in one order on every rank.
server
    with ``Strategy(backend="ps")``, one of the last ``num_servers`` ranks: it
    holds blocks, runs the optimizer on them and sends the new values back.
strategy
    the single, validated object holding every knob (`Strategy`).
"""

from commsched.api import prepare, release
from commsched.backends.base import CommunicationTimeout
from commsched.buckets import compute_bucket_assignment_by_size
from commsched.module import CommschedModule
from commsched.optim import CommschedOptimizer
from commsched.strategy import Strategy

__all__ = [
    "CommschedModule",
    "CommschedOptimizer",
    "CommunicationTimeout",
    "Strategy",
    "compute_bucket_assignment_by_size",
    "prepare",
    "release",
]
__version__ = "0.1.0"

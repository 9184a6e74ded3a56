"""commsched: communication scheduling for data-parallel PyTorch training.

Glossary
--------
bucket
    parameters whose gradients live contiguously in one flat buffer (one dtype
    and device); each ``param.grad`` is a view into it.
handle
    an operation in flight (a bucket's reduction); ``wait()`` it before reading.
reducer
    the per-model object that turns "gradient ready" into "gradient averaged
    over all ranks", launching buckets in one order on every rank.
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

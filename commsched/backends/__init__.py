"""Backends put a bucket's reduction on the wire and hand back a `Handle`."""

from commsched.backends.allreduce import AllReduceBackend
from commsched.backends.base import Backend, CommunicationTimeout, CompletedHandle, Handle

__all__ = ["AllReduceBackend", "Backend", "CommunicationTimeout", "CompletedHandle", "Handle"]

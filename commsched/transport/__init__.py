"""Transports: what goes on the wire for one partition (all-reduce; parameter-server push and pull)."""

from commsched.transport.base import COMPLETED, CompletedHandle, Handle, Transport, TransportStatus

__all__ = ["COMPLETED", "CompletedHandle", "Handle", "Transport", "TransportStatus"]

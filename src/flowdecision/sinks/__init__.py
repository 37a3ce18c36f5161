"""Sinks: the boundary where accepted decisions leave for the workflow engine."""

from .base import InvalidSinkError, JointSink, Sink
from .outbox import (
    OutboxConflictError,
    OutboxEntry,
    OutboxError,
    OutboxMissingError,
    OutboxSchemaError,
    OutboxSink,
)
from .relay import OutboxRelay, RelayStatus

__all__ = [
    "InvalidSinkError",
    "JointSink",
    "OutboxConflictError",
    "OutboxEntry",
    "OutboxError",
    "OutboxMissingError",
    "OutboxRelay",
    "OutboxSchemaError",
    "OutboxSink",
    "RelayStatus",
    "Sink",
]

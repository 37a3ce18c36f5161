"""Sinks: the boundary where accepted decisions leave for the workflow engine."""

from .base import InvalidSinkError, JointSink, Sink, TransactionalSink
from .outbox import (
    OutboxConflictError,
    OutboxEntry,
    OutboxError,
    OutboxMissingError,
    OutboxSchemaError,
    OutboxSink,
)

__all__ = [
    "InvalidSinkError",
    "JointSink",
    "OutboxConflictError",
    "OutboxEntry",
    "OutboxError",
    "OutboxMissingError",
    "OutboxSchemaError",
    "OutboxSink",
    "Sink",
    "TransactionalSink",
]

"""Sinks: the boundary where accepted decisions leave for the workflow engine."""

from .base import Sink
from .outbox import (
    OutboxConflictError,
    OutboxEntry,
    OutboxError,
    OutboxSchemaError,
    OutboxSink,
)

__all__ = [
    "OutboxConflictError",
    "OutboxEntry",
    "OutboxError",
    "OutboxSchemaError",
    "OutboxSink",
    "Sink",
]

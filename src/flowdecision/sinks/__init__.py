"""Sinks: the boundary where accepted decisions leave for the workflow engine."""

from .base import Sink
from .outbox import (
    OutboxConflictError,
    OutboxEntry,
    OutboxError,
    OutboxMissingError,
    OutboxSchemaError,
    OutboxSink,
)

__all__ = [
    "OutboxConflictError",
    "OutboxEntry",
    "OutboxError",
    "OutboxMissingError",
    "OutboxSchemaError",
    "OutboxSink",
    "Sink",
]

"""Sinks: the boundary where accepted decisions leave for the workflow engine."""

from .base import Sink

__all__ = ["Sink"]

"""Async context management shared by every object that holds connections.

A neutral module (it imports nothing from flowdecision) so that the stores, the
sinks and the HTTP client all use one ``__aenter__``/``__aexit__`` pair.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["Closable", "Openable"]


class Closable:
    """An async context manager that calls :meth:`close` on exit."""

    async def close(self) -> None:
        """Release connections and handles. The object is unusable afterwards."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class Openable(Closable):
    """A :class:`Closable` whose ``async with`` also calls :meth:`open` on entry."""

    async def open(self) -> Self:
        """Acquire what the object needs (idempotent); return it."""
        return self

    async def __aenter__(self) -> Self:
        return await self.open()

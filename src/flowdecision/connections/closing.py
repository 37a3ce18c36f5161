"""Opening and closing what holds connections: the one ``__aenter__``/``__aexit__``
pair, and start-or-close.

A neutral module (it imports nothing from flowdecision) so that the stores, the
sinks and the HTTP client all use it.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

__all__ = ["Closable", "Openable", "started"]


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


class _Startable(Protocol):
    async def start(self) -> Any: ...

    async def close(self) -> None: ...


S = TypeVar("S", bound=_Startable)


async def started(store: S) -> S:
    """``store`` after ``await store.start()``; closed again if starting fails."""
    try:
        await store.start()
    except BaseException:
        await store.close()
        raise
    return store

"""Opening and closing stores: the pieces every store class shares."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from ..closing import Closable  # re-exported: the stores' base

__all__ = ["Closable", "check_group_commit", "started"]


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


def check_group_commit(
    what: str, max_batch: object, max_wait_ms: object, error: type[Exception]
) -> tuple[int, float]:
    """Validated group-commit settings ``(max_batch, max_wait_ms)``; ``what`` names
    the store in the message of ``error``."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise error(f"{what} max_batch must be a positive integer, got {max_batch!r}")
    if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, int | float):
        raise error(f"{what} max_wait_ms must be a number >= 0, got {max_wait_ms!r}")
    if not max_wait_ms >= 0:
        raise error(f"{what} max_wait_ms must be >= 0, got {max_wait_ms!r}")
    return max_batch, float(max_wait_ms)

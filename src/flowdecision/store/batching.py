"""Pieces of group commit shared by the SQLite connection thread and the PostgreSQL ledger.

A queued operation carries a future; once its batch has committed (or
failed), :func:`settle` answers every caller with its own result or error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Protocol

__all__ = ["Queued", "check_group_commit", "copy_error", "settle"]


class Queued(Protocol):
    """What :func:`settle` reads of a queued operation."""

    @property
    def future(self) -> asyncio.Future[Any] | None: ...

    @property
    def result(self) -> Any: ...

    @property
    def error(self) -> BaseException | None: ...


def settle(items: Iterable[Queued]) -> None:
    """Resolve each item's future; skip callers that were cancelled meanwhile.

    Call only after the batch's commit is durable (or has failed): that is
    what makes "a caller gets its outcome only after the commit" hold.
    """
    for item in items:
        future = item.future
        if future is None or future.done():  # the caller was cancelled; work may have committed
            continue
        if item.error is not None:
            future.set_exception(item.error)
        else:
            future.set_result(item.result)


def copy_error(error: BaseException) -> BaseException:
    """A fresh exception of the same type and message (one per failed caller).

    Raising one exception object from several awaiting tasks would tangle
    their tracebacks.
    """
    try:
        fresh = type(error)(*error.args)
    except Exception:  # pragma: no cover - exotic constructor
        return error
    fresh.__cause__ = error.__cause__
    return fresh


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

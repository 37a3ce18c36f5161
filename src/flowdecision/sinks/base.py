"""The sink protocols: :class:`Sink`, and :class:`JointSink` for a sink that can
write inside the ledger's own transaction (the joint path)."""

from __future__ import annotations

import inspect
from typing import Protocol, cast, runtime_checkable

from ..core.model import DecisionRequest
from ..errors import InvalidArgumentError, InvalidSinkError
from ..store.joint import JointRow, StoreKey

__all__ = [
    "HasStoreKey",
    "InvalidSinkError",
    "JointSink",
    "Sink",
    "check_attempt",
    "check_sink",
    "has_async_submit",
    "is_joint",
]


@runtime_checkable
class Sink(Protocol):
    """Where the dispatcher delivers a claimed decision.

    ``attempt`` is the claim's attempt number, a fencing token that grows on
    every takeover. A sink **must deduplicate on** ``request.decision_id``: if a
    process crashes after the sink accepted a decision but before the ledger
    recorded completion, the lease expires and another owner delivers the same
    decision again (with a higher ``attempt``). Raising means "not accepted";
    the claim is released so a retry can deliver it.
    """

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        """Deliver ``request``; return only once the engine has accepted it."""
        ...


class HasStoreKey(Protocol):
    """Anything that says where it is stored (a ledger: ``Ledger.store_key``)."""

    def store_key(self) -> StoreKey | None:
        """The store, or None when nothing can join its transactions."""
        ...


@runtime_checkable
class JointSink(Sink, Protocol):
    """A sink that can take part in the ledger's transaction when they share a store.

    When ``joint_with(ledger)`` is true, the dispatcher does not claim, submit
    under a lease and complete: it asks :meth:`prepare` for the row (plain
    data: a :class:`~flowdecision.store.joint.JointRow` naming its table's
    statements) and hands it to ``ledger.joint_commit``, which claims, writes
    the row and completes in one transaction; no code of the sink runs in it.
    A crash then leaves either all three or none, so the sink sees each
    decision exactly once (no replay to absorb). When it is false (another
    store) the sink is used through :meth:`Sink.submit` as usual.
    """

    def joint_with(self, ledger: HasStoreKey) -> bool:
        """True if this sink's rows can be written in ``ledger``'s transactions."""
        ...

    async def prepare(self, request: DecisionRequest) -> JointRow:
        """The row for ``request``, ready for the ledger to write (no write yet)."""
        ...

    def committed(self, row: JointRow) -> None:
        """The transaction that inserted ``row`` committed (called once, after it,
        only for a new row): e.g. the outbox wakes the readers waiting for rows."""
        ...


def is_joint(sink: object, ledger: HasStoreKey) -> bool:
    """True when ``sink`` is a :class:`JointSink` sharing ``ledger``'s store."""
    return isinstance(sink, JointSink) and sink.joint_with(ledger)


def check_attempt(attempt: object) -> int:
    """``attempt`` if it is a non-negative int (not a bool), else :class:`InvalidArgumentError`."""
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise InvalidArgumentError(f"attempt must be a non-negative integer, got {attempt!r}")
    return attempt


def has_async_submit(sink: object) -> bool:
    """True if ``sink.submit`` is a coroutine function (or an object with an async ``__call__``)."""
    submit = getattr(sink, "submit", None)
    if submit is None:
        return False
    return inspect.iscoroutinefunction(submit) or inspect.iscoroutinefunction(
        getattr(submit, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


def check_sink(sink: object) -> Sink:
    """Return ``sink`` if it has an ``async def submit``; raise :class:`InvalidSinkError` if not.

    A plain ``def submit`` would be called, and its side effect would happen,
    before the dispatcher found it could not await the result: the claim would
    then be released and every retry would submit again.
    """
    if not has_async_submit(sink):
        submit = getattr(sink, "submit", None)
        found = "missing" if submit is None else f"a plain {type(submit).__name__}"
        raise InvalidSinkError(
            f"sink `{type(sink).__qualname__}` must define `async def submit(request, attempt)`, "
            f"but its `submit` is {found}"
        )
    return cast(Sink, sink)

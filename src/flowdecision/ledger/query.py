"""Operator queries over a ledger: decisions by run, state and age, and the audit trail.

One query shape (:class:`DecisionQuery`, :class:`AuditQuery`) for the library,
the service (``GET /v1/decisions``, ``GET /v1/runs/{run_id}``, ``GET
/v1/audit``), the CLI (``flowdecision list``, ``flowdecision audit``) and the
status page. Pages are **keyset** pages: decisions come in the order they were
first claimed (``created_at_ms``, then ``decision_id``), which for one run is
the order its decisions were caused, or, asked ``by`` :attr:`TimeField.COMPLETED`,
in the order they completed (``completed_at_ms``, then ``decision_id``: only
completed and tombstoned decisions have that time); the cursor is the last position shown,
never an offset, so decisions inserted while an operator pages never shift or
repeat what is still to come. A page holds at most :data:`MAX_PAGE_LIMIT`.

The SQL ledgers answer from indexes; the memory and JSON-file ledgers answer
with the scan helpers here (:func:`scan_page`, :func:`scan_count`,
:func:`scan_audit`), which are the reference the conformance tests hold the
SQL answers to.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..core.limits import I64_MAX, U64_MAX, identifier_problem
from ..errors import InvalidArgumentError
from .machine import ClaimRecord, ClaimStatus, Creation, decision_state
from .states import AuditEntry, DecisionState, RunState

__all__ = [
    "DEFAULT_PAGE_LIMIT",
    "MAX_PAGE_LIMIT",
    "AuditPage",
    "AuditQuery",
    "DecisionPage",
    "DecisionQuery",
    "DecisionRow",
    "StoredDecision",
    "TimeField",
    "decode_cursor",
    "encode_cursor",
    "scan_audit",
    "scan_count",
    "scan_page",
]

#: The hard ceiling of one page, whatever a caller asks for.
MAX_PAGE_LIMIT = 1000
#: A page's size when none is asked for.
DEFAULT_PAGE_LIMIT = 100


def encode_cursor(position: list[Any]) -> str:
    """An opaque cursor for a keyset position (URL-safe base64 of its JSON)."""
    raw = json.dumps(position, separators=(",", ":")).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(cursor: str, shape: tuple[type, ...]) -> list[Any]:
    """The position a cursor holds; raises :class:`InvalidArgumentError` naming ``cursor``."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        value = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
    except (ValueError, UnicodeError, binascii.Error):
        value = None
    if (
        not isinstance(value, list)
        or len(value) != len(shape)
        or not all(
            isinstance(item, kind) and not isinstance(item, bool)
            for item, kind in zip(value, shape, strict=True)
        )
        # A lone surrogate (a tampered cursor) that no store can bind as text.
        or not all(_storable(item) for item in value)
    ):
        raise InvalidArgumentError(f"`cursor` is not a cursor this query returned: {cursor!r}")
    return value


def _storable(item: object) -> bool:
    """Whether a store can bind a cursor's value: a tampered cursor may hold an integer
    past 64 bits or a lone surrogate, which the drivers refuse with their own errors."""
    if isinstance(item, int):
        return 0 <= item <= I64_MAX
    if not isinstance(item, str) or item.isascii():
        return True
    try:
        item.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_time(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U64_MAX:
        raise InvalidArgumentError(f"`{name}` must be a Unix time in milliseconds, got {value!r}")
    return value


def _check_limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE_LIMIT:
        raise InvalidArgumentError(
            f"`limit` must be an integer in 1..={MAX_PAGE_LIMIT}, got {limit!r}"
        )
    return limit


class TimeField(StrEnum):
    """Which time a decision query's age filter reads and its pages are ordered by.

    ``claimed``: when the decision was first claimed (every decision has one).
    ``completed``: when it completed; only completed and tombstoned decisions
    have a completion time, so only they are listed.
    """

    CLAIMED = "claimed"
    COMPLETED = "completed"


#: States without a completion time (a ``by=completed`` query refuses them).
_UNFINISHED = (DecisionState.PENDING_LIVE, DecisionState.PENDING_EXPIRED, DecisionState.HELD)


def _choice(name: str, value: Any, kind: type[StrEnum]) -> Any:
    if value is None or isinstance(value, kind):
        return value
    try:
        return kind(str(value))
    except ValueError:
        names = ", ".join(member.value for member in kind)
        raise InvalidArgumentError(f"`{name}` must be one of {names}, got {value!r}") from None


@dataclass(frozen=True, slots=True)
class DecisionQuery:
    """Which decisions to list; every filter given must match.

    ``run_id``: the run's decisions. ``state``: a :class:`DecisionState` (or
    its value). ``after_ms`` / ``before_ms``: at or after / before that time
    (Unix ms), the time ``by`` names. ``by``: :attr:`TimeField.CLAIMED` (the
    default): first claimed, pages in first-claim order; records written
    before the query migration carry their completion time, or 0 when pending.
    :attr:`TimeField.COMPLETED`: completed, pages in completion order; lists
    only completed and tombstoned decisions (a pending ``state`` is refused).
    ``cursor``: the ``next_cursor`` of the previous page of the same query.
    ``limit``: 1..:data:`MAX_PAGE_LIMIT`. Invalid values raise
    :class:`InvalidArgumentError` naming the field.
    """

    run_id: str | None = None
    state: DecisionState | None = None
    before_ms: int | None = None
    after_ms: int | None = None
    cursor: str | None = None
    limit: int = DEFAULT_PAGE_LIMIT
    by: TimeField = TimeField.CLAIMED

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", _choice("state", self.state, DecisionState))
        object.__setattr__(self, "by", _choice("by", self.by, TimeField) or TimeField.CLAIMED)
        if self.run_id is not None:
            if not isinstance(self.run_id, str):
                raise InvalidArgumentError(f"`run_id` must be a string, got {self.run_id!r}")
            problem = identifier_problem(self.run_id)
            if problem is not None:  # no decision can have it: a 1 MB filter is a mistake
                raise InvalidArgumentError(f"`run_id` {problem}")
        if self.by is TimeField.COMPLETED and self.state in _UNFINISHED:
            assert self.state is not None
            raise InvalidArgumentError(
                f"`by` completed lists completed and tombstoned decisions only; "
                f"a `state` of {self.state.value} has no completion time"
            )
        _check_time("before_ms", self.before_ms)
        _check_time("after_ms", self.after_ms)
        _check_limit(self.limit)
        self.position()

    def position(self) -> tuple[int, str] | None:
        """The keyset position after which this page starts, from the cursor.

        ``(time, decision_id)``, the time being the one ``by`` names. A cursor
        from a query ordered by the other time is refused.
        """
        if self.cursor is None:
            return None
        if self.by is TimeField.CLAIMED:
            at, decision_id = decode_cursor(self.cursor, (int, str))
        else:
            at, decision_id, tag = decode_cursor(self.cursor, (int, str, str))
            if tag != TimeField.COMPLETED.value:
                raise InvalidArgumentError(
                    f"`cursor` is not a cursor this query returned: {self.cursor!r}"
                )
        return at, decision_id

    def counting(self) -> DecisionQuery:
        """The same filters, without cursor (what :meth:`Ledger.count_decisions` counts)."""
        return DecisionQuery(self.run_id, self.state, self.before_ms, self.after_ms, by=self.by)

    def next_page(self, cursor: str | None, limit: int | None = None) -> DecisionQuery:
        """The same filters from ``cursor`` on (``limit``: this query's unless given)."""
        return dataclasses.replace(
            self, cursor=cursor, limit=self.limit if limit is None else limit
        )


@dataclass(frozen=True, slots=True)
class StoredDecision:
    """A record together with what the ledger keeps beside it (creation, origin)."""

    decision_id: str
    record: ClaimRecord
    created: Creation | None


@dataclass(frozen=True, slots=True)
class DecisionRow:
    """One listed decision: its query state and what an operator needs to act on it.

    Redacted like :class:`~flowdecision.ledger.base.LedgerEntry`: no owner id.
    """

    decision_id: str
    state: DecisionState
    request_hash: str
    attempts: int
    created_at_ms: int
    lease_expires_at_ms: int | None
    completed_at_ms: int | None
    run_id: str | None
    causation_event_id: str | None
    receipt_digest: str | None
    #: While held: when the hold expires (None: never, or not held).
    hold_expires_at_ms: int | None = None

    @classmethod
    def of(cls, stored: StoredDecision, now_ms: int) -> DecisionRow:
        """The row for a stored decision, its state taken at ``now_ms``."""
        record = stored.record
        created = stored.created
        origin = None if created is None else created.origin
        state = decision_state(record, now_ms)
        pending = state in (DecisionState.PENDING_LIVE, DecisionState.PENDING_EXPIRED)
        return cls(
            decision_id=stored.decision_id,
            state=state,
            request_hash=record.request_hash,
            attempts=record.attempts,
            created_at_ms=created_at(stored),
            lease_expires_at_ms=record.lease_expires_at_ms if pending else None,
            completed_at_ms=record.completed_at_ms,
            run_id=None if origin is None else origin.run_id,
            causation_event_id=None if origin is None else origin.causation_event_id,
            receipt_digest=record.receipt_digest,
            hold_expires_at_ms=record.hold_expires_at_ms,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape (``GET /v1/decisions``, ``flowdecision list --json``)."""
        body = {
            "decision_id": self.decision_id,
            "state": self.state.value,
            "request_hash": self.request_hash,
            "attempts": self.attempts,
            "created_at_ms": self.created_at_ms,
            "lease_expires_at_ms": self.lease_expires_at_ms,
            "completed_at_ms": self.completed_at_ms,
            "run_id": self.run_id,
            "causation_event_id": self.causation_event_id,
            "receipt_digest": self.receipt_digest,
        }
        if self.state is DecisionState.HELD:
            body["hold_expires_at_ms"] = self.hold_expires_at_ms
        return body

    @classmethod
    def from_dict(cls, obj: Any) -> DecisionRow:
        """Read back :meth:`to_dict`'s shape (the client)."""
        return cls(
            decision_id=str(obj["decision_id"]),
            state=DecisionState(obj["state"]),
            request_hash=str(obj["request_hash"]),
            attempts=int(obj["attempts"]),
            created_at_ms=int(obj["created_at_ms"]),
            lease_expires_at_ms=obj.get("lease_expires_at_ms"),
            completed_at_ms=obj.get("completed_at_ms"),
            run_id=obj.get("run_id"),
            causation_event_id=obj.get("causation_event_id"),
            receipt_digest=obj.get("receipt_digest"),
            hold_expires_at_ms=obj.get("hold_expires_at_ms"),
        )


@dataclass(frozen=True, slots=True)
class DecisionPage:
    """One page of decisions; ``next_cursor`` is None on the last page.

    ``run``: the run's state, on a page of one run's decisions asked of the
    service (``GET /v1/runs/{id}``, the clients' ``run()``); None otherwise.
    """

    decisions: tuple[DecisionRow, ...]
    next_cursor: str | None
    run: RunState | None = None

    def to_dict(self) -> dict[str, Any]:
        """``{"decisions": [...], "next_cursor": ...}`` (and ``"run"`` when known)."""
        body: dict[str, Any] = {
            "decisions": [row.to_dict() for row in self.decisions],
            "next_cursor": self.next_cursor,
        }
        if self.run is not None:
            body["run"] = self.run.to_dict()
        return body

    @classmethod
    def from_dict(cls, obj: Any) -> DecisionPage:
        """Read back :meth:`to_dict`'s shape (the client)."""
        run = obj.get("run")
        return cls(
            tuple(DecisionRow.from_dict(row) for row in obj["decisions"]),
            obj.get("next_cursor"),
            None if run is None else RunState.from_dict(run),
        )


def page_of(rows: list[DecisionRow], limit: int, by: TimeField = TimeField.CLAIMED) -> DecisionPage:
    """A page from up to ``limit + 1`` rows in ``by``'s order (the extra one says "more")."""
    if len(rows) <= limit:
        return DecisionPage(tuple(rows), None)
    shown = rows[:limit]
    last = shown[-1]
    if by is TimeField.CLAIMED:
        return DecisionPage(tuple(shown), encode_cursor([last.created_at_ms, last.decision_id]))
    # Tagged, so that a cursor of one order is never taken for the other's.
    position = [last.completed_at_ms, last.decision_id, TimeField.COMPLETED.value]
    return DecisionPage(tuple(shown), encode_cursor(position))


@dataclass(frozen=True, slots=True)
class AuditQuery:
    """Which audit entries to list, oldest first: by decision, by time, after a cursor."""

    decision_id: str | None = None
    before_ms: int | None = None
    after_ms: int | None = None
    cursor: str | None = None
    limit: int = DEFAULT_PAGE_LIMIT

    def __post_init__(self) -> None:
        _check_time("before_ms", self.before_ms)
        _check_time("after_ms", self.after_ms)
        _check_limit(self.limit)
        self.after_seq()

    def after_seq(self) -> int:
        """The last ``seq`` the previous page showed (0: from the start)."""
        if self.cursor is None:
            return 0
        (seq,) = decode_cursor(self.cursor, (int,))
        return int(seq)


@dataclass(frozen=True, slots=True)
class AuditPage:
    """One page of the audit trail; ``next_cursor`` is None on the last page."""

    entries: tuple[AuditEntry, ...]
    next_cursor: str | None

    def to_dict(self) -> dict[str, Any]:
        """``{"entries": [...], "next_cursor": ...}``."""
        return {
            "entries": [entry.to_dict() for entry in self.entries],
            "next_cursor": self.next_cursor,
        }

    @classmethod
    def from_dict(cls, obj: Any) -> AuditPage:
        """Read back :meth:`to_dict`'s shape (the client)."""
        return cls(
            tuple(AuditEntry.from_dict(entry) for entry in obj["entries"]), obj.get("next_cursor")
        )


def audit_page_of(entries: list[AuditEntry], limit: int) -> AuditPage:
    """A page from up to ``limit + 1`` entries in ``seq`` order."""
    if len(entries) <= limit:
        return AuditPage(tuple(entries), None)
    shown = entries[:limit]
    return AuditPage(tuple(shown), encode_cursor([shown[-1].seq]))


# ------------------------------------------------------------------ the scanning answer


def created_at(stored: StoredDecision) -> int:
    """When the decision was first claimed; for records that predate it, as migrated."""
    if stored.created is not None:
        return stored.created.at_ms
    completed = stored.record.completed_at_ms
    return 0 if completed is None else completed


def completed_at(stored: StoredDecision) -> int | None:
    """When the decision completed (None: pending, or a seed record without the time)."""
    if stored.record.status is ClaimStatus.PENDING:
        return None
    return stored.record.completed_at_ms


def _time(query: DecisionQuery, stored: StoredDecision) -> int | None:
    return created_at(stored) if query.by is TimeField.CLAIMED else completed_at(stored)


def _matches(query: DecisionQuery, stored: StoredDecision, now_ms: int) -> bool:
    if query.run_id is not None:
        origin = None if stored.created is None else stored.created.origin
        if origin is None or origin.run_id != query.run_id:
            return False
    if query.state is not None and decision_state(stored.record, now_ms) is not query.state:
        return False
    at = _time(query, stored)
    if at is None:
        return False
    if query.after_ms is not None and at < query.after_ms:
        return False
    return query.before_ms is None or at < query.before_ms


def scan_page(
    decisions: Iterable[StoredDecision], query: DecisionQuery, now_ms: int
) -> DecisionPage:
    """Answer ``query`` by looking at every decision (memory and JSON-file ledgers)."""
    position = query.position()

    def key(stored: StoredDecision) -> tuple[int, str]:
        at = _time(query, stored)
        assert at is not None  # _matches let only timed decisions through
        return at, stored.decision_id

    found = [
        stored
        for stored in decisions
        if _matches(query, stored, now_ms) and (position is None or key(stored) > position)
    ]
    found.sort(key=key)
    rows = [DecisionRow.of(stored, now_ms) for stored in found[: query.limit + 1]]
    return page_of(rows, query.limit, query.by)


def scan_count(decisions: Iterable[StoredDecision], query: DecisionQuery, now_ms: int) -> int:
    """How many decisions match ``query``'s filters (its cursor and limit ignored)."""
    return sum(1 for stored in decisions if _matches(query, stored, now_ms))


def audit_matches(query: AuditQuery, entry: AuditEntry) -> bool:
    """Whether ``entry`` is one ``query`` asks for (cursor aside)."""
    if query.decision_id is not None and entry.decision_id != query.decision_id:
        return False
    if query.after_ms is not None and entry.at_ms < query.after_ms:
        return False
    return query.before_ms is None or entry.at_ms < query.before_ms


def scan_audit(entries: Iterable[AuditEntry], query: AuditQuery) -> AuditPage:
    """Answer an audit query by reading the whole trail (memory and JSON-file ledgers)."""
    after = query.after_seq()
    found = sorted(
        (entry for entry in entries if entry.seq > after and audit_matches(query, entry)),
        key=lambda entry: entry.seq,
    )
    return audit_page_of(found[: query.limit + 1], query.limit)

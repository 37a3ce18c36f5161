"""The operator queries as SQL, written once for both dialects.

Each query is one keyset range scan over an index of schema 3:
``(created_at_ms, decision_id)``, ``(status, created_at_ms, decision_id)`` or
``(run_id, created_at_ms, decision_id)``, or, ordered by completion time, of
schema 4: ``(completed_at_ms, decision_id)`` or ``(status, completed_at_ms,
decision_id)`` (partial: completed rows only), resumed after the cursor's position
with a row-value comparison (never OFFSET) and cut at ``limit + 1`` rows (the
extra row only says that there is a next page). Live and expired pending
claims differ by the lease in the record's JSON: expired ones (most pending
claims, the oldest first) are read from the state index with the lease as a
residual filter; live ones (few) from schema 5's index of pending claims by
lease expiry, then sorted. PostgreSQL compares ``decision_id`` with the
"C" collation (code point order, as SQLite and the scanning ledgers do),
which its indexes are built with.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, TypeVar

from .base import Ledger
from .query import (
    AuditPage,
    AuditQuery,
    DecisionPage,
    DecisionQuery,
    DecisionRow,
    StoredDecision,
    TimeField,
    audit_page_of,
    page_of,
)
from .rows import AUDIT_COLUMNS, AUDIT_TABLE, I64_MAX, TABLE, DecodedRecords, creation_of
from .states import AuditEntry, DecisionState

__all__ = ["SqlLedger", "audit_sql", "decision_sql", "due_holds_sql"]

R = TypeVar("R")

Style = Literal["?", "$"]

#: A pending claim's lease expiry, as schema 5's lease index holds it (the same
#: expression, or the index does not apply). SQLite's skips a record that is not JSON
#: (NULL), so such a row stays writable and is reported when read, never at write.
_LEASE = {
    "?": "(CASE WHEN json_valid(record) THEN json_extract(record, '$.lease_expires_at_ms') END)",
    "$": "(record::json ->> 'lease_expires_at_ms')::numeric",
}
_ID = {"?": "decision_id", "$": 'decision_id COLLATE "C"'}
_FINISHED = (DecisionState.COMPLETED, DecisionState.TOMBSTONED)
_STATUS = {
    DecisionState.COMPLETED: "completed",
    DecisionState.TOMBSTONED: "tombstone",
    DecisionState.PENDING_LIVE: "pending",
    DecisionState.PENDING_EXPIRED: "pending",
    DecisionState.HELD: "held",
    DecisionState.REJECTED: "rejected",
}


class _Params:
    def __init__(self, style: Style) -> None:
        self.style = style
        self.values: list[Any] = []

    def __call__(self, value: Any, cast: str = "") -> str:
        self.values.append(value)
        if self.style == "?":
            return "?"
        return f"${len(self.values)}{cast}"


#: The index of pending claims by lease expiry (schema 5).
LEASE_INDEX = "flowdecision_claims_lease"


def _by_lease(state: DecisionState, count: bool) -> bool:
    """Whether the lease index answers best: live claims are few (found by lease, then
    sorted); expired ones are many, and the oldest come first in the status index,
    except to count them all."""
    return state is DecisionState.PENDING_LIVE or (count and state is DecisionState.PENDING_EXPIRED)


def decision_sql(
    query: DecisionQuery, now_ms: int, style: Style, *, count: bool
) -> tuple[str, list[Any]]:
    """``(sql, params)`` for a page (or, with ``count``, the number) of ``query``'s decisions.

    A page's rows are ``decision_id, record, created_at_ms, run_id,
    causation_event_id`` in keyset order.
    """
    param = _Params(style)
    ident = _ID[style]
    where: list[str] = []
    top: int | None  # the largest time the column holds (None: every u64)
    if query.by is TimeField.CLAIMED:
        column = "created_at_ms"
        # bigint in both dialects, clamped to i64 on the way in.
        cast, top = "::bigint", I64_MAX
    else:
        column = "completed_at_ms"
        # Named, so the partial indexes (completed rows only) apply without a time filter.
        where.append("completed_at_ms IS NOT NULL")
        # SQLite keeps it clamped to i64; PostgreSQL as NUMERIC(20, 0), every u64 exact.
        cast, top = ("", I64_MAX) if style == "?" else ("::numeric", None)

    def at(value: int) -> str:
        return param(value if top is None else min(value, top), cast)

    if query.run_id is not None:
        where.append(f"run_id = {param(query.run_id)}")
    source = TABLE
    if query.state is not None:
        # A constant of this module, written into the statement so that the planners
        # see which status, and so which partial index, a query is about.
        where.append(f"status = '{_STATUS[query.state]}'")
        if query.state is DecisionState.PENDING_LIVE:
            where.append(f"{_LEASE[style]} > {param(now_ms, '::bigint')}")
        elif query.state is DecisionState.PENDING_EXPIRED:
            where.append(f"{_LEASE[style]} <= {param(now_ms, '::bigint')}")
        if style == "?" and query.run_id is None and _by_lease(query.state, count):
            # SQLite, without statistics, prefers the status index and would read every
            # pending row's JSON to find the few live leases (PostgreSQL's statistics
            # pick the lease index by themselves).
            source = f"{TABLE} INDEXED BY {LEASE_INDEX}"
    if query.after_ms is not None:
        where.append(f"{column} >= {at(query.after_ms)}")
    if query.before_ms is not None:
        where.append(f"{column} < {at(query.before_ms)}")
    if count:
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        return f"SELECT count(*) FROM {source}{clause}", param.values
    position = query.position()
    if position is not None:
        after_at, after_id = position
        where.append(f"({column}, {ident}) > ({at(after_at)}, {param(after_id, '::text')})")
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    limit = param(query.limit + 1, "::bigint")
    if style == "$" and query.run_id is None and query.state in _FINISHED:
        # PostgreSQL assumes one status's rows are spread evenly over time and walks
        # the first-claim index past every row of the others (all the tombstones
        # before the first completed decision). Asked for keys only, the status
        # index answers alone (an index-only scan), and the page's rows are then
        # fetched by id, in the same order.
        return (
            "SELECT c.decision_id, c.record, c.created_at_ms, c.run_id, c.causation_event_id "
            f"FROM (SELECT decision_id, {column} AS k_at FROM {TABLE}{clause} "
            f"ORDER BY {column}, {ident} LIMIT {limit}) AS k "
            f"JOIN {TABLE} AS c ON c.decision_id = k.decision_id "
            f'ORDER BY k.k_at, k.decision_id COLLATE "C"'
        ), param.values
    sql = (
        f"SELECT decision_id, record, created_at_ms, run_id, causation_event_id FROM {source}"
        f"{clause} ORDER BY {column}, {ident} LIMIT {limit}"
    )
    return sql, param.values


def audit_sql(query: AuditQuery, style: Style) -> tuple[str, list[Any]]:
    """``(sql, params)`` for a page of the audit trail (rows in :data:`AUDIT_COLUMNS` order)."""
    param = _Params(style)
    where = [f"seq > {param(query.after_seq(), '::bigint')}"]
    if query.decision_id is not None:
        where.append(f"decision_id = {param(query.decision_id)}")
    if query.after_ms is not None:
        where.append(f"at_ms >= {param(min(query.after_ms, I64_MAX), '::bigint')}")
    if query.before_ms is not None:
        where.append(f"at_ms < {param(min(query.before_ms, I64_MAX), '::bigint')}")
    sql = (
        f"SELECT {AUDIT_COLUMNS} FROM {AUDIT_TABLE} WHERE {' AND '.join(where)} "
        f"ORDER BY seq LIMIT {param(query.limit + 1, '::bigint')}"
    )
    return sql, param.values


#: A held decision's hold expiry, as its record's JSON holds it (per dialect).
_HOLD_EXPIRY = {
    "?": "(CASE WHEN json_valid(record) THEN json_extract(record, '$.hold_expires_at_ms') END)",
    "$": "(record::json ->> 'hold_expires_at_ms')::numeric",
}


def due_holds_sql(now_ms: int, style: Style) -> tuple[str, list[Any]]:
    """``(sql, params)`` for the ids of the held decisions whose hold expired by ``now_ms``:
    the state index's ``held`` range, the expiry read from each held record's JSON."""
    param = _Params(style)
    at = param(min(now_ms, I64_MAX) if style == "?" else now_ms, "::numeric")
    return (
        f"SELECT decision_id FROM {TABLE} WHERE status = 'held' AND {_HOLD_EXPIRY[style]} <= {at}"
    ), param.values


class SqlLedger(Ledger):
    """A :class:`~.base.Ledger` in a SQL store: the operator queries are this
    module's, run by the backend (SQLite and PostgreSQL).

    A backend names its parameter :data:`Style`, keeps its :class:`DecodedRecords`
    in ``_decoded`` and runs a query with :meth:`_select`.
    """

    _style: ClassVar[Style]
    _decoded: DecodedRecords

    @property
    def runs_supported(self) -> bool:
        """Both SQL ledgers can keep the run invariants (their runs table, schema 6)."""
        return True

    @abc.abstractmethod
    async def _select(self, sql: str, params: list[Any], convert: Callable[[Any], R]) -> list[R]:
        """The rows of ``sql``, each passed through ``convert`` where the backend reads them."""

    async def _list(self, query: DecisionQuery, now_ms: int) -> DecisionPage:
        sql, params = decision_sql(query, now_ms, self._style, count=False)
        # A summary: a listing shows neither identity nor receipt (see DecodedRecords).
        decode = self._decoded.summary

        def row(found: Sequence[Any]) -> DecisionRow:
            key, text, at, run, cause = found
            return DecisionRow.of(
                StoredDecision(key, decode(key, text), creation_of(at, run, cause)), now_ms
            )

        return page_of(await self._select(sql, params, row), query.limit, query.by)

    async def _count(self, query: DecisionQuery, now_ms: int) -> int:
        sql, params = decision_sql(query, now_ms, self._style, count=True)
        return int((await self._select(sql, params, _first))[0])

    async def _due_holds(self, now_ms: int) -> list[str]:
        sql, params = due_holds_sql(now_ms, self._style)
        return await self._select(sql, params, _first)

    async def _audit(self, query: AuditQuery) -> AuditPage:
        sql, params = audit_sql(query, self._style)
        entries = await self._select(sql, params, lambda found: AuditEntry(*found))
        return audit_page_of(entries, query.limit)


def _first(found: Sequence[Any]) -> Any:
    return found[0]

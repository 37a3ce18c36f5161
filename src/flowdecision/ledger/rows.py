"""How the SQL ledgers store a claim record in a row, and read it back cheaply.

A row is ``(decision_id, status, completed_at_ms, record, traceparent)`` where
``record`` is the seed's JSON text of the :class:`ClaimRecord` (so it
round-trips exactly), ``status`` / ``completed_at_ms`` are copies kept for the
prune index, and ``traceparent`` is side data (schema version 2) that never
enters ``record``.
Since schema 3 a row also keeps, from its first claim, ``created_at_ms``,
``run_id`` and ``causation_event_id`` (:func:`creation_values`), for operator
queries.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from ..core.limits import I64_MAX
from ..errors import (
    LedgerCorruptError,
    LedgerError,
    LedgerSchemaError,
    LedgerUnavailableError,
    StoreFullError,
    StoreMissingError,
)
from ..store.component import Component, ErrorKinds
from .machine import ClaimRecord, ClaimStatus, Creation, DecisionOrigin
from .states import AuditEntry, RunState

__all__ = [
    "AUDIT_COLUMNS",
    "AUDIT_INSERTED",
    "AUDIT_TABLE",
    "I64_MAX",
    "LAST_AUDIT_HASH_SQL",
    "LEDGER",
    "RUNS_COLUMNS",
    "RUNS_TABLE",
    "TABLE",
    "DecodedRecords",
    "audit_values",
    "creation_of",
    "creation_values",
    "encode_row",
    "run_of",
    "run_values",
]

#: The SQL ledgers' claims table.
TABLE = "flowdecision_claims"
#: The append-only audit trail (schema 2).
AUDIT_TABLE = "flowdecision_audit"
#: Its columns, in :class:`~.states.AuditEntry` order.
AUDIT_COLUMNS = (
    "seq, at_ms, action, decision_id, actor, reason, state_before, attempts, prev_hash, row_hash"
)
#: The columns an insert gives (the store assigns ``seq``).
AUDIT_INSERTED = AUDIT_COLUMNS.split(", ", 1)[1]

#: The runs table (schema 6): a run's terminal decision and its close.
RUNS_TABLE = "flowdecision_runs"
#: Its columns, in :func:`run_values` order.
RUNS_COLUMNS = "run_id, terminal_decision_id, terminal_kind, terminal_claimed_at_ms, closed_at_ms"

#: The ledger as a SQL store: its schema, version table and errors.
LEDGER = Component(
    name="ledger",
    package="flowdecision.ledger",
    version_table="flowdecision_schema_version",
    main_table=TABLE,
    pg_lock=0x666C6F7764656369,  # "flowdeci" in ASCII
    errors=ErrorKinds(
        base=LedgerError,
        unavailable=LedgerUnavailableError,
        schema=LedgerSchemaError,
        corrupt=LedgerCorruptError,
        missing=StoreMissingError,
        full=StoreFullError,
    ),
    migrate_hint="run `flowdecision migrate` (or the ledger's migrate()) against it first",
    legacy_user_version=True,
    refuse_foreign=True,
    # The outbox may live in the ledger's file (the transactional outbox's layout).
    shares_with=(
        "flow_decision_outbox",
        "flow_decision_outbox_schema",
        "flow_decision_outbox_cursor",
        "flow_decision_outbox_parked",
        "flow_decision_outbox_audit",
    ),
)

# SQLite integers and PostgreSQL's index column are signed 64-bit (I64_MAX);
# larger completion times are clamped in the index copy (the record keeps the truth).


def encode_row(
    decision_id: str, record: ClaimRecord, *, index_max: int | None = I64_MAX
) -> tuple[str, str, int | None, str, str | None]:
    """``(decision_id, status, completed_at_ms, record, traceparent)`` for one claim record.

    ``traceparent`` is the record's side data (its own column, never in ``record``).

    ``index_max`` clamps the indexed completion time (None: the column holds u64).
    """
    completed_at: int | None = None
    if record.status is not ClaimStatus.PENDING and record.completed_at_ms is not None:
        completed_at = record.completed_at_ms
        if index_max is not None:
            completed_at = min(completed_at, index_max)
    return (
        decision_id,
        record.status._value_,  # (the enum's own name: ``.value`` is two Python calls)
        completed_at,
        record.json_text(),
        record.traceparent,
    )


def creation_values(created: Creation | None, now_ms: int) -> tuple[int, str | None, str | None]:
    """``(created_at_ms, run_id, causation_event_id)`` for a new row (time clamped to i64)."""
    if created is None:  # not made by a claim (never happens today): the store's clock
        return min(now_ms, I64_MAX), None, None
    origin = created.origin
    return (
        min(created.at_ms, I64_MAX),
        None if origin is None else origin.run_id,
        None if origin is None else origin.causation_event_id,
    )


def creation_of(created_at_ms: Any, run_id: Any, causation_event_id: Any) -> Creation:
    """The :class:`Creation` a row's columns hold."""
    origin = None
    if run_id is not None or causation_event_id is not None:
        origin = DecisionOrigin(run_id, causation_event_id)
    return Creation(int(created_at_ms), origin)


def run_values(run: RunState) -> tuple[str, str | None, str | None, int, int | None]:
    """A run's :data:`RUNS_COLUMNS` values (times clamped to i64)."""
    claimed = run.terminal_claimed_at_ms
    closed = run.closed_at_ms
    return (
        run.run_id,
        run.terminal_decision_id,
        run.terminal_kind,
        0 if claimed is None else min(claimed, I64_MAX),
        None if closed is None else min(closed, I64_MAX),
    )


def run_of(row: Any) -> RunState:
    """The :class:`RunState` a runs row (:data:`RUNS_COLUMNS`) holds."""
    run_id, terminal, kind, claimed, closed = row
    return RunState(
        str(run_id),
        terminal,
        kind,
        None if claimed is None else int(claimed),
        None if closed is None else int(closed),
    )


def audit_values(entry: AuditEntry) -> tuple[object, ...]:
    """An audit entry's :data:`AUDIT_INSERTED` values: its content (time clamped to
    i64) and its chain hashes."""
    return (*entry.content(), entry.prev_hash, entry.row_hash)


#: The last audit row's ``row_hash``, read in the appending transaction.
LAST_AUDIT_HASH_SQL = f"SELECT row_hash FROM {AUDIT_TABLE} ORDER BY seq DESC LIMIT 1"


class DecodedRecords:
    """Decoded records remembered per decision id together with their stored text.

    Decoding re-validates identities and receipts, which costs more than the
    SQL itself; a row whose text has not changed since we wrote or read it (the
    ``complete`` right after a ``claim``) is not decoded again.
    """

    def __init__(self, where: str, limit: int = 4096) -> None:
        self.where = where  # e.g. "sqlite ledger `path`", for error messages
        self.limit = limit
        self._known: dict[str, tuple[str, ClaimRecord]] = {}

    def remember(self, decision_id: str, text: str, record: ClaimRecord) -> None:
        known = self._known
        if decision_id not in known and len(known) >= self.limit:
            del known[next(iter(known))]  # oldest first
        known[decision_id] = (text, record)

    def decode(self, decision_id: str, text: Any, traceparent: str | None = None) -> ClaimRecord:
        """The record a row's text (and side-data column) holds; raises
        :class:`LedgerCorruptError`."""
        record = self._decode(decision_id, text)
        if record.traceparent != traceparent:
            record = replace(record, traceparent=traceparent)
        return record

    def summary(self, decision_id: str, text: Any) -> ClaimRecord:
        """A row's record for a listing: without identity and receipt unless already known.

        A page of a thousand records decodes in a few milliseconds this way
        instead of tens; summaries are not remembered (they are not the record).
        """
        known = self._known.get(decision_id)
        if known is not None and known[0] == text:
            return known[1]
        obj = self._loads(decision_id, text)
        try:
            return ClaimRecord.from_dict(decision_id, obj, summary=True)
        except LedgerCorruptError as error:
            raise LedgerCorruptError(f"{error} ({self.where})") from error

    def _loads(self, decision_id: str, text: Any) -> Any:
        try:
            return json.loads(text)
        except (TypeError, ValueError) as error:
            raise LedgerCorruptError(
                f"decode decision `{decision_id}` in {self.where}: {error}"
            ) from error

    def _decode(self, decision_id: str, text: Any) -> ClaimRecord:
        known = self._known.get(decision_id)
        if known is not None and known[0] == text:
            return known[1]
        obj = self._loads(decision_id, text)
        try:
            record = ClaimRecord.from_dict(decision_id, obj)
        except LedgerCorruptError as error:
            raise LedgerCorruptError(f"{error} ({self.where})") from error
        if isinstance(text, str):
            self.remember(decision_id, text, record)
        return record

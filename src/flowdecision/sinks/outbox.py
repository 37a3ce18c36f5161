"""The outbox sink: each accepted decision becomes one row of ``flow_decision_outbox``.

``OutboxSink("sqlite:///path")`` or ``OutboxSink("postgresql://...")``.

Delivery is **insert-if-absent** keyed by ``decision_id``:

* the first delivery inserts the row (``first_attempt = highest_attempt =
  attempt``) and gets the next ``seq``, the consumers' cursor;
* a replay with the same request hash (a crash between the sink and the ledger's
  completion, or a late delivery by a stale owner) has no second effect: it only
  raises ``highest_attempt``;
* a replay whose content differs raises :class:`OutboxConflictError` and changes
  nothing.

``seq`` order is commit order (SQLite serializes writers; on PostgreSQL new rows
are inserted under a transaction-scoped advisory lock), so a consumer reading
``fetch(after=last_seq)`` never skips a row.

**The joint path.** An outbox in the ledger's own store (same SQLite file,
same PostgreSQL database: :meth:`OutboxSink.joint_with`) is a
:class:`~flowdecision.sinks.JointSink`: the dispatcher hands the row
(:meth:`OutboxSink.prepare`, plain data) to ``Ledger.joint_commit``, which
runs the outbox's own statements (:data:`OUTBOX_ROWS`, the same
insert-if-absent as :meth:`OutboxSink.submit`) through
:mod:`flowdecision.store.joint` in the ledger's group-committed transaction.
A decision is then never delivered twice. On PostgreSQL a batch takes the
advisory lock once, before inserting its rows, and holds it to its commit:
seq order stays commit order.

The schema is versioned in ``flow_decision_outbox_schema`` with migrations in
``sinks/sql/<dialect>/`` and follows the same policy as the ledger's (see
:mod:`flowdecision.store.migrations`): a SQLite outbox is created or upgraded
when it opens; a PostgreSQL outbox only by :meth:`OutboxSink.migrate`
(``flowdecision migrate --outbox URL``), and opening one that is not current
raises :class:`OutboxSchemaError`. A store written by a newer version is
refused. SQLite work runs on the store's connection thread (WAL,
``synchronous=FULL``); PostgreSQL goes through an asyncpg pool and stamps
``accepted_at_ms`` with the database clock. Both are thin dialect adapters over
:mod:`flowdecision.store`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

from ..connections.closing import Closable, started
from ..connections.urls import OUTBOX_KINDS, describe_dsn, parse_store_url
from ..core.bodies import OutboxEntryBody, outbox_entry_body
from ..core.defaults import SQLITE_BUSY_TIMEOUT_MS
from ..core.limits import OUTBOX_FETCH_MAX
from ..core.model import DecisionRequest, request_hash
from ..errors import (
    ActionRefusedError,
    InvalidArgumentError,
    OutboxConflictError,
    OutboxCursorLeasedError,
    OutboxError,
    OutboxMissingError,
    OutboxSchemaError,
)
from ..observability.tracing import current_traceparent
from ..store.chain import ChainReport, verify_rows
from ..store.component import Component, ErrorKinds
from ..store.joint import (
    JointResult,
    JointRow,
    JointTable,
    StoreKey,
    pg_insert_rows,
    postgres_key,
    sqlite_insert_rows,
    sqlite_key,
)
from ..store.postgres import CLOCK_SQL, PgPool, asyncpg
from ..store.sqlite import SqliteOpener
from ..store.sqlite_thread import SqliteThread
from ..store.transactions import sqlite_transaction
from .base import HasStoreKey, check_attempt
from .cursor import (
    CursorLease,
    CursorState,
    LeaseHeld,
    check_cursor_name,
    pg_acquire,
    pg_advance,
    pg_cursors,
    pg_release,
    pg_set,
    sqlite_acquire,
    sqlite_advance,
    sqlite_cursors,
    sqlite_release,
    sqlite_set,
)
from .parking import (
    OutboxAuditEntry,
    ParkedRow,
    check_action,
    pg_act,
    pg_audit,
    pg_park,
    pg_parked,
    pg_ready_runs,
    pg_run_rows,
    pg_unpark,
    sqlite_act,
    sqlite_audit,
    sqlite_park,
    sqlite_parked,
    sqlite_ready_runs,
    sqlite_run_rows,
    sqlite_unpark,
)
from .wake import Wakeup, wakeup_for

__all__ = [
    "NOTIFY_CHANNEL",
    "OUTBOX_ROWS",
    "OUTBOX_SCHEMA_VERSION",
    "OUTBOX_TABLE",
    "OutboxConflictError",
    "OutboxCursorLeasedError",
    "OutboxEntry",
    "OutboxError",
    "OutboxMissingError",
    "OutboxSchemaError",
    "OutboxSink",
    "load_outbox_migrations",
    "parse_outbox_url",
]


log = logging.getLogger("flowdecision.outbox")
T = TypeVar("T")

OUTBOX_TABLE = "flow_decision_outbox"
#: pg_advisory_xact_lock key serializing new rows so seq order is commit order ("fdoutbox").
_INSERT_LOCK = 0x66646F7574626F78
#: The channel the outbox's trigger NOTIFYs on every insert (PostgreSQL, schema >= 2).
NOTIFY_CHANNEL = "flow_decision_outbox"
#: Waiting for rows on SQLite, other processes' commits are found by a poll that
#: starts this often and backs off to ``poll_max_s``.
POLL_MIN_S = 0.005
#: Waiting on PostgreSQL, the rows are read again this often even without a
#: NOTIFY (a LISTEN connection lost and not yet noticed costs at most this much).
LISTEN_RECHECK_S = 5.0
_COLUMNS = (
    "seq, decision_id, request_json, request_hash, first_attempt, highest_attempt, "
    "accepted_at_ms, traceparent"
)

#: The outbox as a table of the joint path: its insert-if-absent, per dialect, run by
#: ``store/joint.py`` (in the ledger's transaction, and in :meth:`OutboxSink.deliver`'s
#: own). Parameters as :class:`~flowdecision.store.joint.JointTable` says; a row's
#: ``values`` are ``(request_json, traceparent)``.
_INSERTED = (
    "decision_id, request_hash, first_attempt, highest_attempt, accepted_at_ms, "
    "request_json, traceparent"
)
OUTBOX_ROWS = JointTable(
    conflict=OutboxConflictError,
    sqlite_insert=(
        f"INSERT INTO {OUTBOX_TABLE} ({_INSERTED}) VALUES {{rows}} "
        "ON CONFLICT (decision_id) DO NOTHING"
    ),
    sqlite_row="(?, ?, ?, ?, ?, ?, ?)",
    sqlite_newest=(
        f"SELECT decision_id FROM {OUTBOX_TABLE} WHERE decision_id IN ({{marks}}) "
        "ORDER BY seq DESC LIMIT ?"
    ),
    sqlite_stored=(
        f"SELECT decision_id, request_hash FROM {OUTBOX_TABLE} WHERE decision_id IN ({{marks}})"
    ),
    sqlite_raise=(
        f"UPDATE {OUTBOX_TABLE} SET highest_attempt = ?2 "
        "WHERE decision_id = ?1 AND highest_attempt < ?2"
    ),
    pg_insert=(
        f"INSERT INTO {OUTBOX_TABLE} ({_INSERTED}) "
        f"SELECT d, h, a, a, {CLOCK_SQL}, j, tp "
        "FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[]) "
        "WITH ORDINALITY AS t(d, h, a, j, tp, n) ORDER BY n "
        "ON CONFLICT (decision_id) DO NOTHING RETURNING decision_id"
    ),
    pg_stored=(
        f"SELECT decision_id, request_hash FROM {OUTBOX_TABLE} "
        "WHERE decision_id = ANY($1::text[]) ORDER BY decision_id FOR UPDATE"
    ),
    pg_raise=(
        f"UPDATE {OUTBOX_TABLE} AS o SET highest_attempt = t.a "
        "FROM unnest($1::text[], $2::bigint[]) AS t(d, a) "
        "WHERE o.decision_id = t.d AND o.highest_attempt < t.a"
    ),
    # Serializes new rows (held to the commit) so that seq order is commit order.
    pg_lock=f"SELECT pg_advisory_xact_lock({_INSERT_LOCK})",
)


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """One outbox row.

    ``traceparent`` is the W3C trace context of the dispatch that wrote the row
    (None when tracing was off): a consumer continues the decision's trace from
    it (:func:`flowdecision.observability.tracing.context_of`).
    """

    seq: int
    decision_id: str
    request_json: bytes
    request_hash: str
    first_attempt: int
    highest_attempt: int
    accepted_at_ms: int
    traceparent: str | None = None

    @property
    def request(self) -> DecisionRequest:
        """The stored request, parsed."""
        return DecisionRequest.parse(self.request_json)

    def to_dict(self) -> OutboxEntryBody:
        """The one JSON shape of an outbox entry: an entry of ``GET /v1/outbox``,
        a line of ``flowdecision outbox tail --json`` and the client's
        ``OutboxItem.to_dict()``. ``request`` is the stored request, parsed."""
        return outbox_entry_body(self, json.loads(self.request_json))

    def to_json(self) -> bytes:
        """:meth:`to_dict` encoded, with the stored request bytes embedded verbatim
        (they are the exact wire JSON, so nothing is parsed or re-encoded)."""
        head = (
            b'{"seq":%d,"decision_id":%s,"request_hash":%s,"first_attempt":%d,'
            b'"highest_attempt":%d,"accepted_at_ms":%d,"traceparent":%s,"request":'
            % (
                self.seq,
                json.dumps(self.decision_id).encode(),
                json.dumps(self.request_hash).encode(),
                self.first_attempt,
                self.highest_attempt,
                self.accepted_at_ms,
                json.dumps(self.traceparent).encode(),
            )
        )
        return head + self.request_json + b"}"


def _entry(row: Any) -> OutboxEntry:
    text = row[2]
    return OutboxEntry(
        seq=int(row[0]),
        decision_id=str(row[1]),
        request_json=text.encode("utf-8") if isinstance(text, str) else bytes(text),
        request_hash=str(row[3]),
        first_attempt=int(row[4]),
        highest_attempt=int(row[5]),
        accepted_at_ms=int(row[6]),
        traceparent=row[7],
    )


#: The outbox as a SQL store: its schema, version table and errors.
OUTBOX = Component(
    name="outbox",
    package="flowdecision.sinks",
    version_table="flow_decision_outbox_schema",
    main_table=OUTBOX_TABLE,
    pg_lock=0x66646F757462786D,  # "fdoutbxm"
    errors=ErrorKinds(
        base=OutboxError,
        unavailable=OutboxError,
        schema=OutboxSchemaError,
        corrupt=OutboxError,
        missing=OutboxMissingError,
    ),
    migrate_hint="run `flowdecision migrate --outbox URL` (or OutboxSink.migrate()) first",
)


def load_outbox_migrations(dialect: str) -> tuple[tuple[int, str, str], ...]:
    """The ``(version, name, sql)`` outbox migrations shipped for ``dialect``, in order."""
    return OUTBOX.migrations(dialect)


OUTBOX_SCHEMA_VERSION = OUTBOX.newest("sqlite")


def parse_outbox_url(url: str) -> tuple[str, str]:
    """``(kind, target)`` of an outbox URL; anything but SQLite or PostgreSQL raises
    :class:`OutboxError` offering only those two schemes."""
    return parse_store_url(url, what="outbox", error=OutboxError, kinds=OUTBOX_KINDS)


class OutboxSink(Closable):
    """A :class:`~flowdecision.sinks.Sink` that records each decision once in a table.

    Open it with ``await sink.open()`` or ``async with OutboxSink(url) as sink``;
    :meth:`submit` opens it on first use too. Not thread-safe; one event loop.
    A new SQLite outbox file is created ``0600`` (it holds full payloads).

    ``create=False`` opens an existing outbox only (to read it): no file,
    directory or table is created and no migration runs; a missing store, or
    one without the outbox tables, raises :class:`OutboxMissingError`.

    A PostgreSQL outbox must have been migrated (:meth:`migrate`) before it
    opens; a SQLite one migrates itself when it opens.
    """

    def __init__(
        self,
        url: str,
        *,
        busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS,
        create: bool = True,
        poll_max_s: float = 0.25,
    ) -> None:
        self.url = url
        #: SQLite: the longest pause between polls while waiting for rows (:meth:`fetch`).
        self.poll_max_s = float(poll_max_s)
        self.create = bool(create)
        self.kind, self._target = parse_outbox_url(url)
        self.busy_timeout_ms = busy_timeout_ms
        self._store_key = (
            sqlite_key(self._target) if self.kind == "sqlite" else postgres_key(self._target)
        )
        self._backend: _SqliteOutbox | _PostgresOutbox | None = None
        self._wakeup: Wakeup = wakeup_for(self._store_key)
        self._lock = asyncio.Lock()
        self._closed = False

    @property
    def where(self) -> str:
        """The store, for messages (a file path, or host/database without credentials)."""
        if self.kind == "sqlite":
            return f"`{self._target}`"
        return describe_dsn(self._target)

    async def open(self) -> OutboxSink:
        """Connect; on SQLite also create or upgrade the outbox table."""
        await self._ready()
        return self

    async def migrate(self) -> tuple[int, int]:
        """Create or upgrade the schema (either dialect); ``(version_before, version_after)``.

        Safe to run from several processes or hosts at once.
        """
        if self._closed:
            raise OutboxError(f"outbox {self.where} is closed")
        if self.kind == "sqlite":
            backend = await self._ready()
            assert isinstance(backend, _SqliteOutbox)
            return await backend.migrate()
        pg = PgPool(OUTBOX, self._target)
        try:
            return await pg.migrate()
        finally:
            await pg.close()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def close(self) -> None:
        """Release the connection or pool; the sink is unusable afterwards."""
        self._closed = True
        backend, self._backend = self._backend, None
        if backend is not None:
            await backend.close()

    async def _ready(self) -> _SqliteOutbox | _PostgresOutbox:
        if self._closed:
            raise OutboxError(f"outbox {self.where} is closed")
        if self._backend is not None:
            return self._backend
        async with self._lock:
            if self._backend is None:
                backend: _SqliteOutbox | _PostgresOutbox
                if self.kind == "sqlite":
                    backend = _SqliteOutbox(Path(self._target), self.busy_timeout_ms, self.create)
                else:
                    backend = _PostgresOutbox(self._target, self.create)
                self._backend = await started(backend)
            return self._backend

    # -- the sink ---------------------------------------------------------------

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        """Insert-if-absent (see the module docs); raises :class:`OutboxConflictError`."""
        await self.deliver(request, attempt)

    async def deliver(self, request: DecisionRequest, attempt: int) -> bool:
        """Like :meth:`submit`; True when this call inserted the row, False for a replay."""
        check_attempt(attempt)
        backend = await self._ready()
        row = self._row(request)
        done = await backend.deliver(row, attempt)
        if isinstance(done, BaseException):
            raise done
        if done:
            self._wakeup.notify()
        return done

    # -- the joint path (a JointSink) ---------------------------------------------------

    def store_key(self) -> StoreKey:
        """Where the outbox lives (the resolved SQLite file, or the PostgreSQL database)."""
        return self._store_key

    def joint_with(self, ledger: HasStoreKey) -> bool:
        """True when ``ledger`` lives in the same store: deliveries then take part in
        the ledger's own transaction (see :meth:`prepare`), so each accepted decision
        is claimed, written here and completed in one commit: exactly once."""
        return ledger.store_key() == self._store_key

    async def prepare(self, request: DecisionRequest) -> JointRow:
        """The row for ``request`` (plain data), to write in the ledger's transaction.

        Opens the outbox first (a SQLite outbox creates or upgrades its tables in
        the shared file), so the ledger's connection finds them.
        """
        await self._ready()
        return self._row(request)

    def _row(self, request: DecisionRequest) -> JointRow:
        """``request``'s row: encoded and hashed here, on the caller's thread."""
        values = (request.to_json().decode("utf-8"), current_traceparent())
        return JointRow(
            OUTBOX_ROWS, self._store_key, request.decision_id, request_hash(request), values
        )

    def committed(self, row: JointRow) -> None:
        """The ledger's transaction that inserted ``row`` committed: wake this process's
        readers waiting for rows (the dispatcher calls it; see :mod:`.wake`)."""
        self._wakeup.notify()

    # -- reading ------------------------------------------------------------------

    async def fetch(
        self, after: int = 0, limit: int = 100, *, wait_s: float = 0.0
    ) -> list[OutboxEntry]:
        """Rows with ``seq > after``, ordered by ``seq``, at most ``limit`` (<= 10000).

        With ``wait_s`` > 0 and no such row yet, wait up to ``wait_s`` seconds
        for one (an empty list after that). The wait is no busy poll: rows this
        process commits wake it at once; on PostgreSQL so does every writer's
        commit (``LISTEN``); on SQLite other processes' rows are found by a poll
        that backs off from 5 ms to :attr:`poll_max_s`.
        """
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise InvalidArgumentError(f"after must be a non-negative integer, got {after!r}")
        if (
            isinstance(limit, bool)
            or not isinstance(limit, int)
            or not 1 <= limit <= OUTBOX_FETCH_MAX
        ):
            raise InvalidArgumentError(
                f"limit must be an integer in 1..={OUTBOX_FETCH_MAX}, got {limit!r}"
            )
        backend = await self._ready()
        if not wait_s > 0:
            return await backend.fetch(after, limit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        wakeup = self._wakeup
        # LISTEN before the first read: a commit after that read then always wakes us.
        listening = await backend.listen(wakeup)
        pause = LISTEN_RECHECK_S if listening else POLL_MIN_S
        while True:
            seen = wakeup.generation
            rows = await backend.fetch(after, limit)
            left = deadline - loop.time()
            if rows or left <= 0:
                return rows
            woken = await wakeup.wait(seen, min(left, pause))
            if not woken and not listening:
                pause = min(pause * 2, max(self.poll_max_s, POLL_MIN_S))

    async def get(self, decision_id: str) -> OutboxEntry | None:
        """The row for ``decision_id``, or None."""
        return await (await self._ready()).get(decision_id)

    async def count(self) -> int:
        """How many rows the outbox holds."""
        return await (await self._ready()).count()

    # -- relay cursors (see :mod:`.cursor`) ----------------------------------------------

    async def acquire_cursor(self, name: str, owner: str, lease_ms: int) -> CursorLease | LeaseHeld:
        """Lease cursor ``name`` for ``owner`` (created at position 0 on first use)."""
        check_cursor_name(name)
        return await (await self._ready()).acquire_cursor(name, owner, lease_ms)

    async def advance_cursor(
        self, lease: CursorLease, position: int, *, delivered: int = 0, lease_ms: int
    ) -> bool:
        """Move the cursor to ``position`` and renew the lease; False when it was lost."""
        return await (await self._ready()).advance_cursor(lease, position, delivered, lease_ms)

    async def release_cursor(self, lease: CursorLease) -> bool:
        """Give the lease up (False when it was no longer ours)."""
        return await (await self._ready()).release_cursor(lease)

    async def cursors(self, name: str | None = None) -> list[CursorState]:
        """Every relay cursor of this outbox (or the one named), with its lag."""
        return await (await self._ready()).cursors(name)

    async def set_cursor(self, name: str, position: int) -> None:
        """Move relay ``name``'s cursor to ``position`` (an operator's skip or replay).

        Raises :class:`OutboxCursorLeasedError` while a relay of that name holds
        it: stop that relay first.
        """
        check_cursor_name(name)
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise InvalidArgumentError(f"position must be a non-negative integer, got {position!r}")
        held = await (await self._ready()).set_cursor(name, position)
        if held is not None:
            raise OutboxCursorLeasedError(held.name, held.owner)

    # -- parked rows (see :mod:`.parking`) -----------------------------------------------

    async def park(
        self,
        lease: CursorLease,
        rows: Sequence[OutboxEntry],
        run_id: str,
        *,
        state: str,
        error: str | None = None,
        attempts: int = 0,
    ) -> bool:
        """Record run ``run_id``'s ``rows`` as ``parked`` or ``held`` for the relay holding
        ``lease``; False, writing nothing, when that lease was lost."""
        keys = [(row.seq, row.decision_id, run_id) for row in rows]
        return await (await self._ready()).park(lease, keys, state, error, attempts)

    async def unpark(self, lease: CursorLease, seq: int) -> bool:
        """Delete a held row its sink accepted; False when the lease was lost."""
        return await (await self._ready()).unpark(lease, seq)

    async def parked(self, name: str | None = None) -> list[ParkedRow]:
        """Every parked and held row (of relay ``name``), by relay and seq."""
        return await (await self._ready()).parked(name)

    async def ready_runs(self, name: str) -> tuple[set[str], list[str]]:
        """For relay ``name``: the runs with rows parked or held, and those of them
        whose first row is held (deliverable now), oldest first."""
        return await (await self._ready()).ready_runs(name)

    async def run_rows(self, name: str, run_id: str) -> list[tuple[str, int, OutboxEntry]]:
        """Run ``run_id``'s parked and held rows for relay ``name`` in seq order (up to
        100): ``(state, attempts, row)``."""
        rows = await (await self._ready()).run_rows(name, run_id)
        return [(str(row[0]), int(row[1]), _entry(row[2:])) for row in rows]

    async def act_on_parked(
        self, name: str, action: str, decision_id: str, *, actor: str, reason: str
    ) -> OutboxAuditEntry:
        """``retry`` (deliver it again, next in its run) or ``skip`` (drop it: its run goes
        on) the row relay ``name`` parked for ``decision_id``, audited in the same
        transaction. Raises :class:`~flowdecision.errors.UnknownDecisionError` when no
        such row is parked, :class:`~flowdecision.errors.ActionRefusedError` when it is
        only held behind another."""
        check_cursor_name(name)
        check_action(action, decision_id, actor, reason)
        return await (await self._ready()).act(name, action, decision_id, actor, reason)

    async def audit(self, name: str | None = None) -> list[OutboxAuditEntry]:
        """The outbox's audit trail of operator actions on parked rows, oldest first."""
        return await (await self._ready()).audit(name)

    async def verify_audit(self) -> ChainReport:
        """Recompute the audit trail's hash chain (every relay's rows, in ``seq``
        order); the report names the first row that does not match
        (docs/OPERATIONS.md, "Verifying the audit trail")."""
        return verify_rows(await self.audit())


# ------------------------------------------------------------------------------- SQLite


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _SqliteOutbox:
    """The outbox in a SQLite file, on the store's connection thread."""

    def __init__(self, path: Path, busy_timeout_ms: int, create: bool = True) -> None:
        self._opener = SqliteOpener(OUTBOX, path, busy_timeout_ms=busy_timeout_ms, create=create)
        self._thread = SqliteThread(self._opener)

    async def start(self) -> None:
        await self._thread.run(lambda conn: None)

    async def migrate(self) -> tuple[int, int]:
        await self.start()  # opening migrates
        version = self._opener.version_at_open
        assert version is not None
        return version, OUTBOX.newest("sqlite")

    async def close(self) -> None:
        await self._thread.close()

    async def listen(self, wakeup: Wakeup) -> bool:
        return False  # other processes' commits are found by polling

    async def acquire_cursor(self, name: str, owner: str, lease_ms: int) -> CursorLease | LeaseHeld:
        def work(conn: sqlite3.Connection) -> CursorLease | LeaseHeld:
            with sqlite_transaction(conn):
                return sqlite_acquire(conn, name, owner, lease_ms, _now_ms())

        return await self._thread.run(work)

    async def advance_cursor(
        self, lease: CursorLease, position: int, delivered: int, lease_ms: int
    ) -> bool:
        def work(conn: sqlite3.Connection) -> bool:
            with sqlite_transaction(conn):
                return sqlite_advance(conn, lease, position, delivered, lease_ms, _now_ms())

        return await self._thread.run(work)

    async def release_cursor(self, lease: CursorLease) -> bool:
        def work(conn: sqlite3.Connection) -> bool:
            with sqlite_transaction(conn):
                return sqlite_release(conn, lease, _now_ms())

        return await self._thread.run(work)

    async def cursors(self, name: str | None) -> list[CursorState]:
        return await self._thread.run(lambda conn: sqlite_cursors(conn, name, _now_ms()))

    async def set_cursor(self, name: str, position: int) -> LeaseHeld | None:
        def work(conn: sqlite3.Connection) -> LeaseHeld | None:
            with sqlite_transaction(conn):
                return sqlite_set(conn, name, position, _now_ms())

        return await self._thread.run(work)

    async def park(
        self,
        lease: CursorLease,
        rows: Sequence[tuple[int, str, str]],
        state: str,
        error: str | None,
        attempts: int,
    ) -> bool:
        def work(conn: sqlite3.Connection) -> bool:
            with sqlite_transaction(conn):
                return sqlite_park(conn, lease, rows, state, error, attempts, _now_ms())

        return await self._thread.run(work)

    async def unpark(self, lease: CursorLease, seq: int) -> bool:
        def work(conn: sqlite3.Connection) -> bool:
            with sqlite_transaction(conn):
                return sqlite_unpark(conn, lease, seq)

        return await self._thread.run(work)

    async def parked(self, name: str | None) -> list[ParkedRow]:
        return await self._thread.run(lambda conn: sqlite_parked(conn, name))

    async def ready_runs(self, name: str) -> tuple[set[str], list[str]]:
        return await self._thread.run(lambda conn: sqlite_ready_runs(conn, name))

    async def run_rows(self, name: str, run_id: str) -> list[tuple[Any, ...]]:
        return await self._thread.run(lambda conn: sqlite_run_rows(conn, name, run_id))

    async def act(
        self, name: str, action: str, decision_id: str, actor: str, reason: str
    ) -> OutboxAuditEntry:
        def work(conn: sqlite3.Connection) -> OutboxAuditEntry:
            with sqlite_transaction(conn):
                return sqlite_act(conn, name, action, decision_id, actor, reason, _now_ms())

        return await self._thread.run(work)

    async def audit(self, name: str | None) -> list[OutboxAuditEntry]:
        return await self._thread.run(lambda conn: sqlite_audit(conn, name))

    async def deliver(self, row: JointRow, attempt: int) -> JointResult:
        def work(conn: sqlite3.Connection) -> JointResult:
            with sqlite_transaction(conn):
                return sqlite_insert_rows(conn, [(row, attempt)])[0]

        return await self._thread.run(work)

    async def fetch(self, after: int, limit: int) -> list[OutboxEntry]:
        def work(conn: sqlite3.Connection) -> list[OutboxEntry]:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM {OUTBOX_TABLE} WHERE seq > ? ORDER BY seq LIMIT ?",
                (after, limit),
            ).fetchall()
            return [_entry(row) for row in rows]

        return await self._thread.run(work)

    async def get(self, decision_id: str) -> OutboxEntry | None:
        def work(conn: sqlite3.Connection) -> OutboxEntry | None:
            row = conn.execute(
                f"SELECT {_COLUMNS} FROM {OUTBOX_TABLE} WHERE decision_id = ?", (decision_id,)
            ).fetchone()
            return None if row is None else _entry(row)

        return await self._thread.run(work)

    async def count(self) -> int:
        def work(conn: sqlite3.Connection) -> int:
            row = conn.execute(f"SELECT count(*) FROM {OUTBOX_TABLE}").fetchone()
            return int(row[0]) if row else 0

        return await self._thread.run(work)


# ---------------------------------------------------------------------------- PostgreSQL


class _PostgresOutbox:
    """The outbox in PostgreSQL, through the store's pool; never migrates on open."""

    def __init__(self, dsn: str, create: bool = True) -> None:
        self._pg = PgPool(OUTBOX, dsn, create=create)
        self._listener: Any = None
        self._listen_lock = asyncio.Lock()

    async def start(self) -> None:
        await self._pg.ready()

    async def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.terminate()
        await self._pg.close()

    async def listen(self, wakeup: Wakeup) -> bool:
        """LISTEN on a connection of its own (session state no pooled connection keeps).

        True while it is up; False when it cannot be opened (the waiter then
        polls). A lost connection wakes the waiters, who reopen it.
        """
        if self._listener is not None and not self._listener.is_closed():
            return True
        async with self._listen_lock:
            if self._listener is not None and not self._listener.is_closed():
                return True
            try:
                conn = await asyncpg.connect(self._pg.dsn, timeout=10)
            except Exception as error:
                log.warning(
                    "outbox LISTEN connection failed; polling instead",
                    extra={"cause": str(self._pg.translate(error, connecting=True))},
                )
                return False
            try:
                await conn.add_listener(NOTIFY_CHANNEL, lambda *_: wakeup.notify())
            except Exception as error:
                conn.terminate()
                log.warning(
                    "outbox LISTEN failed; polling instead",
                    extra={"cause": str(self._pg.translate(error))},
                )
                return False
            conn.add_termination_listener(lambda _conn: wakeup.notify())
            self._listener = conn
            return True

    async def acquire_cursor(self, name: str, owner: str, lease_ms: int) -> CursorLease | LeaseHeld:
        return await self._with_conn(lambda conn: pg_acquire(conn, name, owner, lease_ms))

    async def advance_cursor(
        self, lease: CursorLease, position: int, delivered: int, lease_ms: int
    ) -> bool:
        return await self._with_conn(
            lambda conn: pg_advance(conn, lease, position, delivered, lease_ms)
        )

    async def release_cursor(self, lease: CursorLease) -> bool:
        return await self._with_conn(lambda conn: pg_release(conn, lease))

    async def cursors(self, name: str | None) -> list[CursorState]:
        return await self._with_conn(lambda conn: pg_cursors(conn, name))

    async def set_cursor(self, name: str, position: int) -> LeaseHeld | None:
        return await self._with_conn(lambda conn: pg_set(conn, name, position))

    async def park(
        self,
        lease: CursorLease,
        rows: Sequence[tuple[int, str, str]],
        state: str,
        error: str | None,
        attempts: int,
    ) -> bool:
        return await self._with_conn(
            lambda conn: pg_park(conn, lease, rows, state, error, attempts)
        )

    async def unpark(self, lease: CursorLease, seq: int) -> bool:
        return await self._with_conn(lambda conn: pg_unpark(conn, lease, seq))

    async def parked(self, name: str | None) -> list[ParkedRow]:
        return await self._with_conn(lambda conn: pg_parked(conn, name))

    async def ready_runs(self, name: str) -> tuple[set[str], list[str]]:
        return await self._with_conn(lambda conn: pg_ready_runs(conn, name))

    async def run_rows(self, name: str, run_id: str) -> list[tuple[Any, ...]]:
        return await self._with_conn(lambda conn: pg_run_rows(conn, name, run_id))

    async def act(
        self, name: str, action: str, decision_id: str, actor: str, reason: str
    ) -> OutboxAuditEntry:
        return await self._with_conn(
            lambda conn: pg_act(conn, name, action, decision_id, actor, reason)
        )

    async def audit(self, name: str | None) -> list[OutboxAuditEntry]:
        return await self._with_conn(lambda conn: pg_audit(conn, name))

    async def _with_conn(self, work: Callable[[Any], Awaitable[T]]) -> T:
        try:
            async with self._pg.connection() as conn:
                return await work(conn)
        except ActionRefusedError:
            raise  # the rules' own answer, not a store failure
        except Exception as error:
            raise self._pg.translate(error) from error

    async def deliver(self, row: JointRow, attempt: int) -> JointResult:
        try:
            async with self._pg.connection() as conn, conn.transaction():
                return (await pg_insert_rows(conn, [(row, attempt)]))[0]
        except Exception as error:
            raise self._pg.translate(error) from error

    async def fetch(self, after: int, limit: int) -> list[OutboxEntry]:
        return await self._query(
            f"SELECT {_COLUMNS} FROM {OUTBOX_TABLE} WHERE seq > $1 ORDER BY seq LIMIT $2",
            after,
            limit,
        )

    async def get(self, decision_id: str) -> OutboxEntry | None:
        rows = await self._query(
            f"SELECT {_COLUMNS} FROM {OUTBOX_TABLE} WHERE decision_id = $1", decision_id
        )
        return rows[0] if rows else None

    async def count(self) -> int:
        try:
            return int(await self._pg.fetchval(f"SELECT count(*) FROM {OUTBOX_TABLE}"))
        except Exception as error:
            raise self._pg.translate(error) from error

    async def _query(self, sql: str, *args: Any) -> list[OutboxEntry]:
        try:
            rows = await self._pg.fetch(sql, *args)
        except Exception as error:
            raise self._pg.translate(error) from error
        return [_entry(tuple(row)) for row in rows]

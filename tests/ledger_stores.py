"""One "store" per backend kind, so the same test can run against all four.

A :class:`LedgerStore` is where records live (a dict, a directory, a database
file, a PostgreSQL database); calling it opens a *new* ledger instance on that
same store, so tests can open two instances side by side or reopen after close.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from flowdecision.ledger import JsonFileLedger, Ledger, MemoryLedger
from flowdecision.ledger.jsonfile import AUDIT_FILE, DATA_FILE, SIDE_FILE
from flowdecision.ledger.sqlite import SqliteLedger

BACKENDS = ("memory", "file", "sqlite", "postgres")
DURABLE = frozenset({"file", "sqlite", "postgres"})

#: Examples the stateful test ran, per backend (reported in the terminal summary).
STATEFUL_EXAMPLES: dict[str, int] = {}
STATEFUL_STEPS: dict[str, int] = {}


def _canonical(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class LedgerStore:
    """Open ledgers on one store; remember them so :meth:`aclose` closes them all."""

    def __init__(self, kind: str, root: Path, pg_url: str | None = None, **options: Any) -> None:
        self.kind = kind
        self.durable = kind in DURABLE
        self.root = root
        self.pg_url = pg_url
        self.options = options
        self.opened: list[Ledger] = []
        self._memory: MemoryLedger | None = None
        self._prepared = False

    @property
    def sqlite_path(self) -> Path:
        return self.root / "ledger.db"

    async def __call__(self) -> Ledger:
        """A new ledger instance on this store (memory: the one shared instance)."""
        await self._prepare()
        ledger: Ledger
        if self.kind == "memory":
            if self._memory is None:
                self._memory = MemoryLedger()
            return self._memory
        if self.kind == "file":
            ledger = JsonFileLedger(self.root)
        elif self.kind == "sqlite":
            ledger = await SqliteLedger.open(self.sqlite_path, **self.options)
        elif self.kind == "postgres":
            from flowdecision.ledger.postgres import PostgresLedger

            assert self.pg_url is not None
            ledger = await PostgresLedger.connect(self.pg_url, **self.options)
        else:  # pragma: no cover
            raise ValueError(self.kind)
        self.opened.append(ledger)
        return ledger

    async def _prepare(self) -> None:
        if self._prepared:
            return
        self._prepared = True
        if self.kind == "postgres":
            await self.reset()

    async def reset(self) -> None:
        """Empty the store (every open instance sees the empty store)."""
        if self.kind == "memory":
            if self._memory is not None:
                self._memory._runs.clear()
                for kept in (self._memory._records, self._memory._created):
                    kept.clear()
                self._memory._audit_trail.clear()
        elif self.kind == "file":
            for name in (DATA_FILE, SIDE_FILE, AUDIT_FILE):
                (self.root / name).unlink(missing_ok=True)
        elif self.kind == "sqlite":
            import sqlite3

            if self.sqlite_path.exists():
                conn = sqlite3.connect(self.sqlite_path, isolation_level=None)
                try:
                    conn.execute("DELETE FROM flowdecision_claims")
                    conn.execute("DELETE FROM flowdecision_runs")
                finally:
                    conn.close()
        elif self.kind == "postgres":
            import asyncpg

            conn = await asyncpg.connect(self.pg_url)
            try:
                # TRUNCATE passes the audit table's append-only rules (DELETE would not).
                await conn.execute(
                    "TRUNCATE flowdecision_claims, flowdecision_audit, flowdecision_runs"
                )
            finally:
                await conn.close()

    async def insert_raw(self, decision_id: str, obj: dict[str, Any]) -> None:
        """Store a raw record dict as an older writer would have (e.g. without identity)."""
        await self._prepare()
        status = obj.get("status")
        completed = obj.get("completed_at_ms") if status == "completed" else None
        if self.kind == "memory":
            from flowdecision.ledger.machine import ClaimRecord

            if self._memory is None:
                self._memory = MemoryLedger()
            self._memory._records[decision_id] = ClaimRecord.from_dict(decision_id, obj)
        elif self.kind == "file":
            path = self.root / DATA_FILE
            document = (
                json.loads(path.read_bytes())
                if path.exists()
                else {"schema_version": 1, "records": {}}
            )
            document["records"][decision_id] = obj
            path.write_text(_canonical(document))
        elif self.kind == "sqlite":
            import sqlite3

            await (await SqliteLedger.open(self.sqlite_path)).close()  # create + migrate
            conn = sqlite3.connect(self.sqlite_path, isolation_level=None)
            try:
                conn.execute(
                    "INSERT OR REPLACE INTO flowdecision_claims "
                    "(decision_id, status, completed_at_ms, record) VALUES (?, ?, ?, ?)",
                    (decision_id, status, completed, _canonical(obj)),
                )
            finally:
                conn.close()
        elif self.kind == "postgres":
            import asyncpg

            conn = await asyncpg.connect(self.pg_url)
            try:
                await conn.execute(
                    "INSERT INTO flowdecision_claims "
                    "(decision_id, status, completed_at_ms, record) "
                    "VALUES ($1, $2, $3, $4) ON CONFLICT (decision_id) DO UPDATE SET "
                    "status = excluded.status, completed_at_ms = excluded.completed_at_ms, "
                    "record = excluded.record",
                    decision_id,
                    status,
                    completed,
                    _canonical(obj),
                )
            finally:
                await conn.close()

    async def aclose(self) -> None:
        opened, self.opened = self.opened, []
        for ledger in opened:
            await ledger.close()


def make_root(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def remove_root(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


def postgres_url_from_env() -> str | None:
    return os.environ.get("FLOWDECISION_TEST_POSTGRES_URL") or None

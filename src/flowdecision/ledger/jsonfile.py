"""The seed-format JSON file ledger: ``root/flow-decisions.json``.

Byte-compatible with the Rust ``FileFlowDecisionLedger`` so a Rust host and a
Python host can share one directory: same file name, same lock file, same
``{"schema_version":1,"records":{...}}`` layout and field names, same serde
encoding. Every mutation rewrites the whole file (as the seed does), so its cost
grows with the number of retained records and it stops at 16 MiB; use the
SQLite ledger for anything large.

What the seed's file cannot hold lives **beside** it, never in it:
``flow-decisions.ops.json`` keeps each decision's first-claim time, run and
causing event (for operator queries) and the tombstones ``prune
--keep-tombstones`` leaves; ``flow-decisions.audit.jsonl`` is the append-only
audit trail of operator actions. Both are written under the same lock, before
the ledger file, so a crash can leave an audit line or a creation time for a
change the ledger file never got, never the reverse. A Rust host sharing the
directory ignores them (its claims just carry no run). Operator queries read
everything and scan it (no index).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import uuid
from pathlib import Path
from typing import Any, TypeVar

from ..core.jsonwire import encode_json
from ..core.limits import JSON_LEDGER_MAX_BYTES
from ..errors import (
    LedgerCorruptError,
    LedgerError,
    LedgerSchemaError,
    LedgerUnavailableError,
    StoreMissingError,
)
from .base import Operation, PruneMode, PruneProgress, RunBound, ScanningLedger
from .machine import ClaimRecord, ClaimStatus, Creation, DecisionOrigin, tombstone_of
from .query import StoredDecision
from .states import AuditEntry

__all__ = [
    "AUDIT_FILE",
    "DATA_FILE",
    "LOCK_FILE",
    "MAX_DECISION_LEDGER_BYTES",
    "SCHEMA_VERSION",
    "SIDE_FILE",
    "JsonFileLedger",
    "decode_ledger",
    "encode_ledger",
]

T = TypeVar("T")

MAX_DECISION_LEDGER_BYTES = JSON_LEDGER_MAX_BYTES
SCHEMA_VERSION = 1
DATA_FILE = "flow-decisions.json"
LOCK_FILE = ".flow-decisions.lock"
#: Beside the seed's file: creation times, runs and tombstones (not the seed's format).
SIDE_FILE = "flow-decisions.ops.json"
#: Beside the seed's file: the audit trail, one JSON object per line.
AUDIT_FILE = "flow-decisions.audit.jsonl"
_TEMP_PREFIX = "flow-decisions.tmp-"


def _too_large(path: Path) -> LedgerError:
    return LedgerCorruptError(
        f"decision ledger exceeds {MAX_DECISION_LEDGER_BYTES} bytes (file `{path}`)"
    )


def decode_ledger(data: bytes, path: Path) -> dict[str, ClaimRecord]:
    """Decode and validate a ledger file's bytes; errors name ``path``."""
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise LedgerCorruptError(f"decode decision ledger `{path}`: {error}") from error
    if not isinstance(document, dict):
        raise LedgerCorruptError(f"decode decision ledger `{path}`: not a JSON object")
    version = document.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise LedgerCorruptError(
            f"decode decision ledger `{path}`: missing or invalid field `schema_version`"
        )
    if version > SCHEMA_VERSION:
        raise LedgerSchemaError(
            f"decision ledger schema {version} is newer than supported schema {SCHEMA_VERSION} "
            f"(file `{path}`)"
        )
    raw = document.get("records")
    if not isinstance(raw, dict):
        raise LedgerCorruptError(
            f"decode decision ledger `{path}`: missing or invalid field `records`"
        )
    try:
        records = {key: ClaimRecord.from_dict(key, value) for key, value in raw.items()}
    except LedgerCorruptError as error:
        raise LedgerCorruptError(f"{error} (file `{path}`)") from error
    for key, record in records.items():
        if record.status is ClaimStatus.TOMBSTONE:
            raise LedgerCorruptError(
                f"decision `{key}` is a tombstone, which the seed's file never holds "
                f"(file `{path}`)"
            )
    return records


class _Side:
    """What the JSON ledger keeps beside the seed's file (``SIDE_FILE``)."""

    def __init__(self) -> None:
        self.created: dict[str, Creation] = {}
        self.tombstones: dict[str, ClaimRecord] = {}
        self.changed = False
        #: Tombstones changed: written (fsynced) before the ledger file. Otherwise
        #: only creation times and runs changed, which a crash may lose harmlessly
        #: (queries then fall back, as for records from before them): written after
        #: the ledger file without fsync, so a claim costs one durable write, as before.
        self.durable = False

    @classmethod
    def decode(cls, data: bytes, path: Path) -> _Side:
        side = cls()
        try:
            document = json.loads(data)
            for key, value in document["created"].items():
                origin = DecisionOrigin(value.get("run_id"), value.get("causation_event_id"))
                side.created[key] = Creation(int(value["at_ms"]), origin)
            for key, value in document["tombstones"].items():
                side.tombstones[key] = ClaimRecord.from_dict(key, value)
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as error:
            raise LedgerCorruptError(
                f"decode decision ledger side file `{path}`: {error}"
            ) from error
        return side

    def encode(self) -> bytes:
        created = {
            key: {
                "at_ms": value.at_ms,
                "run_id": None if value.origin is None else value.origin.run_id,
                "causation_event_id": (
                    None if value.origin is None else value.origin.causation_event_id
                ),
            }
            for key, value in sorted(self.created.items())
        }
        tombstones = {key: value.to_dict() for key, value in sorted(self.tombstones.items())}
        return encode_json({"schema_version": 1, "created": created, "tombstones": tombstones})


def encode_ledger(records: dict[str, ClaimRecord]) -> bytes:
    """Encode exactly as ``serde_json::to_vec`` of the seed's ``DecisionLedgerFile``."""
    # BTreeMap<String, _> orders keys by UTF-8 bytes, which is code point order.
    body: dict[str, Any] = {key: records[key].to_dict() for key in sorted(records)}
    return encode_json({"schema_version": SCHEMA_VERSION, "records": body})


class JsonFileLedger(ScanningLedger):
    """Seed-compatible file ledger, safe across processes on one host.

    Each mutation holds an exclusive ``flock`` on ``root/.flow-decisions.lock``
    (plus an in-process lock) for the whole read-modify-write, and publishes
    the new generation with write-temp, fsync, rename, fsync-directory. All
    blocking file work runs in a worker thread so the event loop keeps going.

    ``create=False`` uses an existing ledger only: the directory is never
    created, and a directory holding neither the ledger file nor its lock file
    raises :class:`~flowdecision.errors.StoreMissingError`.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, create: bool = True, keep_tombstones: bool = False
    ) -> None:
        self.root = Path(root)
        self.create = bool(create)
        self.keep_tombstones = bool(keep_tombstones)
        self.path = self.root / DATA_FILE
        self.side_path = self.root / SIDE_FILE
        self.audit_path = self.root / AUDIT_FILE
        self._lock_path = self.root / LOCK_FILE
        self._process_lock = asyncio.Lock()
        self._swept = False

    @property
    def run_invariants(self) -> bool:
        """Always off: Rust hosts share the file live and would neither honour nor keep
        a run record (docs/PROTOCOL.md, "Runs")."""
        return False

    @run_invariants.setter
    def run_invariants(self, on: bool) -> None:
        if on:
            raise LedgerError(
                "the JSON file ledger cannot keep the run invariants: Rust hosts share its "
                "file and would not honour a run record (use SQLite or PostgreSQL)"
            )

    # -- primitives ---------------------------------------------------------

    async def _apply(self, decision_id: str, op: Operation[T] | RunBound[T]) -> T:
        # Never keeps the run invariants (runs_supported is False): no run-bound op comes.
        assert not isinstance(op, RunBound)

        def mutate(records: dict[str, ClaimRecord], side: _Side) -> tuple[bool, T]:
            record = records.get(decision_id) or side.tombstones.get(decision_id)
            transition = op(record, self.now_ms())
            if transition.changed and transition.record is not None:
                records[decision_id] = transition.record
                if transition.created is not None:
                    side.created[decision_id] = transition.created
                    side.changed = True
            return transition.changed, transition.result

        async with self._process_lock:
            return await asyncio.to_thread(self._locked_mutation, mutate)

    async def _read(self, decision_id: str) -> ClaimRecord | None:
        # Like the seed, reads take no lock: rename makes every generation whole.
        records = await asyncio.to_thread(self._read_records)
        found = records.get(decision_id)
        if found is None:
            side = await asyncio.to_thread(self._read_side)
            found = side.tombstones.get(decision_id)
        return found

    async def _prune(self, before_ms: int, progress: PruneProgress | None, mode: PruneMode) -> int:
        def mutate(records: dict[str, ClaimRecord], side: _Side) -> tuple[bool, int]:
            if mode is PruneMode.TOMBSTONES:
                doomed = [
                    key for key, rec in side.tombstones.items() if mode.selects(rec, before_ms)
                ]
                for key in doomed:
                    del side.tombstones[key]
                    side.created.pop(key, None)
                side.changed = side.durable = bool(doomed)
                return False, len(doomed)
            doomed = [key for key, rec in records.items() if mode.selects(rec, before_ms)]
            for key in doomed:
                record = records.pop(key)
                if mode is PruneMode.TOMBSTONE:
                    side.tombstones[key] = tombstone_of(record)
                    side.durable = True
                else:
                    side.created.pop(key, None)
                side.changed = True
            return bool(doomed), len(doomed)

        async with self._process_lock:
            pruned: int = await asyncio.to_thread(self._locked_mutation, mutate)
        if progress is not None:
            progress(pruned)  # one rewrite of the whole file: one "batch"
        return pruned

    async def _act(self, decision_id: str, op: Operation[AuditEntry]) -> AuditEntry:
        def mutate(records: dict[str, ClaimRecord], side: _Side) -> tuple[bool, AuditEntry]:
            in_file = decision_id in records
            record = records.get(decision_id) or side.tombstones.get(decision_id)
            transition = op(record, self.now_ms())
            trail = self._read_audit()
            last = trail[-1].row_hash if trail else None
            entry = dataclasses.replace(
                transition.result.chained(last), seq=trail[-1].seq + 1 if trail else 1
            )
            # The audit line first (appended, fsynced): a crash after it leaves a line
            # for a change the ledger never got, never a change without its line.
            self._append_audit(entry)
            if transition.record is None:
                records.pop(decision_id, None)
                if (
                    side.tombstones.pop(decision_id, None) is not None
                    or decision_id in side.created
                ):
                    side.created.pop(decision_id, None)
                    side.changed = side.durable = True
            elif in_file:
                records[decision_id] = transition.record
            else:
                side.tombstones[decision_id] = transition.record
                side.changed = side.durable = True
            return in_file, entry

        async with self._process_lock:
            result: AuditEntry = await asyncio.to_thread(self._locked_mutation, mutate)
            return result

    def _stored(self) -> list[StoredDecision]:
        records = self._read_records()
        side = self._read_side()
        merged = {**side.tombstones, **records}
        return [
            StoredDecision(key, record, side.created.get(key)) for key, record in merged.items()
        ]

    async def _scanned(self) -> list[StoredDecision]:
        return await asyncio.to_thread(self._stored)

    async def _trail(self) -> list[AuditEntry]:
        return await asyncio.to_thread(self._read_audit)

    async def records(self) -> dict[str, ClaimRecord]:
        """Every record in the file (for operators and tests)."""
        return await asyncio.to_thread(self._read_records)

    # -- blocking helpers (run in a worker thread) --------------------------

    def _require_store(self) -> None:
        """With ``create=False``: refuse a directory that holds no ledger."""
        if self.create or self.path.exists() or self._lock_path.exists():
            return
        if self.root.is_dir():
            what = f"holds no {DATA_FILE}"
        else:
            what = "is not a directory" if self.root.exists() else "does not exist"
        raise StoreMissingError(f"decision ledger `{self.root}` {what} (nothing was created)")

    def _locked_mutation(self, mutate: Any) -> Any:
        self._require_store()
        try:
            if self.create:
                self.root.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise LedgerUnavailableError(
                f"open decision ledger lock `{self._lock_path}`: {error.strerror or error}"
            ) from error
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            if not self._swept:
                self._sweep_temp_files()
            records = self._read_records()
            side = self._read_side()
            changed, result = mutate(records, side)
            if side.changed and side.durable:  # beside the seed's file, and before it
                self._write_file(self.side_path, side.encode())
            if changed:
                self._write_records(records)
            if side.changed and not side.durable:
                self._write_file(self.side_path, side.encode(), durable=False)
            return result
        finally:
            os.close(lock_fd)  # closing drops the flock

    def _sweep_temp_files(self) -> None:
        # A writer that crashed between create and rename leaves a temp file.
        # Under the flock no other writer can own one, so they are all stale.
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.root):
                if entry.name.startswith(_TEMP_PREFIX):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        self._swept = True

    def _read_records(self) -> dict[str, ClaimRecord]:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            self._require_store()
            return {}
        except OSError as error:
            raise LedgerUnavailableError(
                f"read decision ledger `{self.path}`: {error.strerror or error}"
            ) from error
        try:
            # Bounded read: refuse before reading, and again if it grew meanwhile.
            if os.fstat(fd).st_size > MAX_DECISION_LEDGER_BYTES:
                raise _too_large(self.path)
            chunks: list[bytes] = []
            remaining = MAX_DECISION_LEDGER_BYTES + 1
            while remaining > 0:
                chunk = os.read(fd, min(remaining, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                remaining -= len(chunk)
            data = b"".join(chunks)
        except OSError as error:
            raise LedgerUnavailableError(
                f"read decision ledger `{self.path}`: {error.strerror or error}"
            ) from error
        finally:
            os.close(fd)
        if len(data) > MAX_DECISION_LEDGER_BYTES:
            raise _too_large(self.path)
        return decode_ledger(data, self.path)

    def _read_side(self) -> _Side:
        try:
            data = self.side_path.read_bytes()
        except FileNotFoundError:
            return _Side()
        except OSError as error:
            raise LedgerUnavailableError(
                f"read decision ledger side file `{self.side_path}`: {error.strerror or error}"
            ) from error
        return _Side.decode(data, self.side_path)

    def _read_audit(self) -> list[AuditEntry]:
        try:
            text = self.audit_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as error:
            raise LedgerUnavailableError(
                f"read audit trail `{self.audit_path}`: {error}"
            ) from error
        entries: list[AuditEntry] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entries.append(AuditEntry.from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError) as error:
                raise LedgerCorruptError(
                    f"audit trail `{self.audit_path}` line {number}: {error}"
                ) from error
        return entries

    def _append_audit(self, entry: AuditEntry) -> None:
        line = encode_json(entry.to_dict()) + b"\n"
        try:
            fd = os.open(self.audit_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as error:
            raise LedgerUnavailableError(
                f"append audit trail `{self.audit_path}`: {error.strerror or error}"
            ) from error

    def _write_records(self, records: dict[str, ClaimRecord]) -> None:
        data = encode_ledger(records)
        if len(data) > MAX_DECISION_LEDGER_BYTES:
            raise _too_large(self.path)
        self._write_file(self.path, data)

    def _write_file(self, path: Path, data: bytes, *, durable: bool = True) -> None:
        temp = self.root / f"{_TEMP_PREFIX}{uuid.uuid4()}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
            if durable:
                dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            kind = "disk full" if error.errno in (errno.ENOSPC, errno.EFBIG) else None
            detail = error.strerror or str(error)
            raise LedgerUnavailableError(
                f"write decision ledger `{path}`: {detail}" + (f" ({kind})" if kind else "")
            ) from error

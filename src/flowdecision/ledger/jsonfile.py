"""The seed-format JSON file ledger: ``root/flow-decisions.json``.

Byte-compatible with the Rust ``FileFlowDecisionLedger`` so a Rust host and a
Python host can share one directory: same file name, same lock file, same
``{"schema_version":1,"records":{...}}`` layout and field names, same serde
encoding. Every mutation rewrites the whole file (as the seed does), so its cost
grows with the number of retained records and it stops at 16 MiB; use the
SQLite ledger for anything large.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import uuid
from pathlib import Path
from typing import Any, TypeVar

from ..errors import (
    LedgerCorruptError,
    LedgerError,
    LedgerSchemaError,
    LedgerUnavailableError,
    StoreMissingError,
)
from ..jsonwire import encode_json
from ..limits import JSON_LEDGER_MAX_BYTES
from .base import Operation, PruneProgress, StoredLedger
from .machine import ClaimRecord, is_prunable

__all__ = [
    "DATA_FILE",
    "LOCK_FILE",
    "MAX_DECISION_LEDGER_BYTES",
    "SCHEMA_VERSION",
    "JsonFileLedger",
    "decode_ledger",
    "encode_ledger",
]

T = TypeVar("T")

MAX_DECISION_LEDGER_BYTES = JSON_LEDGER_MAX_BYTES
SCHEMA_VERSION = 1
DATA_FILE = "flow-decisions.json"
LOCK_FILE = ".flow-decisions.lock"
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
        return {key: ClaimRecord.from_dict(key, value) for key, value in raw.items()}
    except LedgerCorruptError as error:
        raise LedgerCorruptError(f"{error} (file `{path}`)") from error


def encode_ledger(records: dict[str, ClaimRecord]) -> bytes:
    """Encode exactly as ``serde_json::to_vec`` of the seed's ``DecisionLedgerFile``."""
    # BTreeMap<String, _> orders keys by UTF-8 bytes, which is code point order.
    body: dict[str, Any] = {key: records[key].to_dict() for key in sorted(records)}
    return encode_json({"schema_version": SCHEMA_VERSION, "records": body})


class JsonFileLedger(StoredLedger):
    """Seed-compatible file ledger, safe across processes on one host.

    Each mutation holds an exclusive ``flock`` on ``root/.flow-decisions.lock``
    (plus an in-process lock) for the whole read-modify-write, and publishes
    the new generation with write-temp, fsync, rename, fsync-directory. All
    blocking file work runs in a worker thread so the event loop keeps going.

    ``create=False`` uses an existing ledger only: the directory is never
    created, and a directory holding neither the ledger file nor its lock file
    raises :class:`~flowdecision.errors.StoreMissingError`.
    """

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        self.root = Path(root)
        self.create = bool(create)
        self.path = self.root / DATA_FILE
        self._lock_path = self.root / LOCK_FILE
        self._process_lock = asyncio.Lock()
        self._swept = False

    # -- primitives ---------------------------------------------------------

    async def _apply(self, decision_id: str, op: Operation[T]) -> T:
        def mutate(records: dict[str, ClaimRecord]) -> tuple[bool, T]:
            transition = op(records.get(decision_id), self.now_ms())
            if transition.changed and transition.record is not None:
                records[decision_id] = transition.record
            return transition.changed, transition.result

        async with self._process_lock:
            return await asyncio.to_thread(self._locked_mutation, mutate)

    async def _read(self, decision_id: str) -> ClaimRecord | None:
        # Like the seed, reads take no lock: rename makes every generation whole.
        records = await asyncio.to_thread(self._read_records)
        return records.get(decision_id)

    async def _prune(self, before_ms: int, progress: PruneProgress | None) -> int:
        def mutate(records: dict[str, ClaimRecord]) -> tuple[bool, int]:
            doomed = [key for key, rec in records.items() if is_prunable(rec, before_ms)]
            for key in doomed:
                del records[key]
            return bool(doomed), len(doomed)

        async with self._process_lock:
            pruned: int = await asyncio.to_thread(self._locked_mutation, mutate)
        if progress is not None:
            progress(pruned)  # one rewrite of the whole file: one "batch"
        return pruned

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
            changed, result = mutate(records)
            if changed:
                self._write_records(records)
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

    def _write_records(self, records: dict[str, ClaimRecord]) -> None:
        data = encode_ledger(records)
        if len(data) > MAX_DECISION_LEDGER_BYTES:
            raise _too_large(self.path)
        temp = self.root / f"{_TEMP_PREFIX}{uuid.uuid4()}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, self.path)
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
                f"write decision ledger `{self.path}`: {detail}" + (f" ({kind})" if kind else "")
            ) from error

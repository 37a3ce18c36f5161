"""The hash chain of an append-only audit trail, shared by the ledger's and the outbox's.

Each audit row carries ``prev_hash``, the ``row_hash`` of the row before it in
the same store (:data:`GENESIS` for the first), and its own ``row_hash``: a
SHA-256 over that ``prev_hash`` and the row's content (:func:`link_hash`),
computed in the transaction that appends the row, after the store's writers are
serialized (SQLite's write lock; a PostgreSQL advisory lock). :func:`verify_chain`
recomputes every link and names the first row that does not match.

What it protects against, and what not: docs/OPERATIONS.md, "Verifying the audit
trail". Rows written before the chain existed carry no hashes: they are reported
as an unchained prefix (``legacy``), and the chain starts after them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

__all__ = [
    "GENESIS",
    "LEDGER_AUDIT_LOCK",
    "OUTBOX_AUDIT_LOCK",
    "ChainBreak",
    "ChainReport",
    "ChainedRow",
    "chained",
    "link_hash",
    "pg_audit_lock_sql",
    "verify_chain",
    "verify_rows",
]

#: The ``prev_hash`` of a trail's first chained row.
GENESIS = "sha256:" + "0" * 64
#: PostgreSQL: the advisory lock an audit append holds to its commit, so that two
#: appends chain one after the other (two-key locks in a namespace of their own).
_PG_AUDIT_NAMESPACE = 0x61756474  # "audt"
LEDGER_AUDIT_LOCK = 1
OUTBOX_AUDIT_LOCK = 2


def pg_audit_lock_sql(key: int) -> str:
    """The statement taking the audit trail's transaction-scoped lock (``key``: whose)."""
    return f"SELECT pg_advisory_xact_lock({_PG_AUDIT_NAMESPACE}, {int(key)})"


class ChainedRow(Protocol):
    """An audit row of either trail: a frozen dataclass with these fields."""

    @property
    def seq(self) -> int: ...
    @property
    def prev_hash(self) -> str | None: ...
    @property
    def row_hash(self) -> str | None: ...
    def content(self) -> Sequence[object]:
        """What the chain hashes: the row's columns but ``seq`` and the hashes."""
        ...


R = TypeVar("R", bound=ChainedRow)


def chained(row: R, last_row_hash: str | None) -> R:
    """``row`` with its links, appended after the row whose ``row_hash`` is
    ``last_row_hash`` (None: no row yet, or only rows from before the chain: the
    chain starts at :data:`GENESIS`)."""
    prev = GENESIS if last_row_hash is None else last_row_hash
    linked: R = dataclasses.replace(  # type: ignore[type-var]
        row, prev_hash=prev, row_hash=link_hash(prev, row.content())
    )
    return linked


def verify_rows(rows: Iterable[ChainedRow]) -> ChainReport:
    """:func:`verify_chain` over audit rows in ``seq`` order."""
    return verify_chain((row.seq, row.prev_hash, row.row_hash, row.content()) for row in rows)


_DOMAIN = b"flowdecision.audit-chain.v1\x00"


def link_hash(prev_hash: str, content: Sequence[object]) -> str:
    """The ``row_hash`` of a row with ``content`` (its columns but ``seq`` and the
    hashes, in the store's column order) that follows ``prev_hash``."""
    text = json.dumps([prev_hash, *content], separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(_DOMAIN + text.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class ChainBreak:
    """The first row whose link does not match: its ``seq`` and what is wrong."""

    seq: int
    problem: str


@dataclass(frozen=True, slots=True)
class ChainReport:
    """What :func:`verify_chain` found: ``ok`` unless a row breaks the chain."""

    #: Rows read, chained and legacy.
    rows: int
    #: Rows before the first chained one, written before the chain existed.
    legacy: int
    #: The last row's ``row_hash`` (:data:`GENESIS` for an empty chain): keep it
    #: elsewhere to detect a truncated tail or a rewritten chain later.
    head: str
    #: The last row's ``seq`` (0 for an empty trail).
    head_seq: int
    first_break: ChainBreak | None = None

    @property
    def ok(self) -> bool:
        """True when every chained row's link matches."""
        return self.first_break is None

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape (``flowdecision audit --verify --json``)."""
        broken = self.first_break
        return {
            "ok": self.ok,
            "rows": self.rows,
            "legacy": self.legacy,
            "head": self.head,
            "head_seq": self.head_seq,
            "first_break": None
            if broken is None
            else {"seq": broken.seq, "problem": broken.problem},
        }


def verify_chain(
    rows: Iterable[tuple[int, str | None, str | None, Sequence[object]]],
) -> ChainReport:
    """Recompute the chain of ``rows`` -- ``(seq, prev_hash, row_hash, content)`` in
    ``seq`` order -- and report the first row that does not match.

    A row breaks the chain when its ``prev_hash`` is not the previous row's
    ``row_hash`` (a row deleted or inserted before it, or its link edited), or
    its ``row_hash`` is not :func:`link_hash` of its own content (the row
    edited), or it has no hashes after the chain began.
    """
    count = legacy = 0
    expected = GENESIS
    head_seq = 0
    chained = False
    for seq, prev_hash, row_hash, content in rows:
        count += 1
        head_seq = seq
        if prev_hash is None and row_hash is None and not chained:
            legacy += 1
            continue
        chained = True
        if prev_hash is None or row_hash is None:
            return _broken(count, legacy, expected, head_seq, seq, "it has no hashes")
        if prev_hash != expected:
            problem = (
                "its prev_hash is not the previous row's row_hash "
                "(a row before it was deleted, inserted or edited)"
            )
            return _broken(count, legacy, expected, head_seq, seq, problem)
        if link_hash(prev_hash, content) != row_hash:
            problem = "its row_hash does not match its content (the row was edited)"
            return _broken(count, legacy, expected, head_seq, seq, problem)
        expected = row_hash
    return ChainReport(count, legacy, expected, head_seq)


def _broken(
    count: int, legacy: int, head: str, head_seq: int, seq: int, problem: str
) -> ChainReport:
    return ChainReport(count, legacy, head, head_seq, ChainBreak(seq, problem))

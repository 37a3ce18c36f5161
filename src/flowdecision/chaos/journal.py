"""The evidence a worker leaves: an append-only journal, and the ledger that writes it.

Each line is one ``write(2)`` to an ``O_APPEND`` file, which a SIGKILL cannot
tear; a kill loses at most what happened after the last line, and nothing in
a journal is ever wrong.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

from ..errors import LedgerError, LedgerUnavailableError, StoreFullError
from ..ledger.base import Ledger
from ..ledger.delegating import DelegatingLedger
from ..ledger.states import AlreadyCompleted, Busy, Claimed, ClaimOutcome, Conflict, JointOutcome
from .config import wall_ms

__all__ = ["Journal", "JournalingLedger", "in_doubt", "outcome_unknown", "read_journal"]


class Journal:
    """Append-only JSON lines; each line is one ``write(2)`` on an ``O_APPEND`` fd.

    ``claims``, ``takeovers`` and ``outcomes`` count the lines of each kind
    written so far (a health report states them next to its snapshot).
    """

    def __init__(self, path: Path, base: dict[str, Any]) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._base = base
        self.claims = 0
        self.takeovers = 0
        self.outcomes = 0

    def write(self, **event: Any) -> None:
        """Append one event (merged into this journal's base fields)."""
        line = json.dumps({**self._base, **event}, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode("utf-8"))

    def close(self) -> None:
        os.close(self._fd)


def read_journal(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Events of one journal, and how many lines could not be parsed (a torn tail)."""
    events: list[dict[str, Any]] = []
    torn = 0
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return events, 0
    for line in data.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            torn += 1
    return events, torn


def outcome_unknown(error: LedgerError) -> bool:
    """Whether the call may have committed all the same: the store became unreachable
    (``ledger_unavailable``) once the call was under way, so the commit may have
    landed before the connection died (a failover). A refused connection, or a
    socket that is not there, sent nothing."""
    return (
        isinstance(error, LedgerUnavailableError)
        and not isinstance(error, StoreFullError)
        and not isinstance(error.__cause__, ConnectionRefusedError | FileNotFoundError)
    )


def in_doubt(event: dict[str, Any]) -> bool:
    """A journaled claim (or claim-and-complete) call whose error left its outcome
    unknown (:func:`outcome_unknown`): it may have committed all the same."""
    return event.get("e") == "claim" and event.get("r") == "error" and bool(event.get("u"))


_CLAIM_RESULT = {Busy: "busy", Conflict: "conflict", AlreadyCompleted: "completed"}
#: The line journaled *before* a mutation, so a call cut short by a kill is visible.
_BEFORE = {"renew": "renew0", "complete": "complete0", "joint_commit": "joint0"}
T = TypeVar("T")


class JournalingLedger(DelegatingLedger):
    """Delegates to a real ledger and journals every mutation with its timing.

    Renewals, completions and joint claim-and-completes are also journaled
    *before* the call (``renew0``, ``complete0``, ``joint0``), so a call cut
    short by a kill is visible.
    """

    def __init__(self, inner: Ledger, journal: Journal) -> None:
        super().__init__(inner)
        self.journal = journal

    async def around(self, operation: str, decision_id: str, call: Awaitable[T]) -> T:
        """Journal one mutation: the line before it (``renew0``, ``complete0``,
        ``joint0``), then its outcome or its error (see :meth:`_journal_done`)."""
        t0 = wall_ms()
        before = _BEFORE.get(operation)
        if before is not None:
            self.journal.write(e=before, d=decision_id, t0=t0)
        try:
            result = await super().around(operation, decision_id, call)
        except LedgerError as error:
            if operation in ("claim", "joint_commit"):
                self.journal.write(
                    e="claim",
                    d=decision_id,
                    t0=t0,
                    t1=wall_ms(),
                    r="error",
                    c=error.code,
                    u=outcome_unknown(error),
                    m=str(error),
                )
            elif operation != "release":
                self.journal.write(
                    e=operation, d=decision_id, t0=t0, t1=wall_ms(), ok=False, m=str(error)
                )
            raise
        self._journal_done(operation, decision_id, t0, result)
        return result

    def _journal_done(self, operation: str, decision_id: str, t0: int, result: object) -> None:
        t1 = wall_ms()
        write = self.journal.write
        if operation == "renew":
            write(e="renew", d=decision_id, t0=t0, t1=t1, ok=result)
        elif operation == "complete":
            write(e="complete", d=decision_id, t0=t0, t1=t1, ok=True, ours=result)
        elif operation == "release":
            write(e="release", d=decision_id, t1=t1)
        elif operation == "claim":
            assert isinstance(result, Claimed | AlreadyCompleted | Busy | Conflict)
            self._journal_claim(decision_id, t0, t1, result)
        else:
            # A joint commit is journaled as the claim, then the completion, then the
            # sink's row: the three happened in one transaction, inside the lease the
            # claim granted. A kill after the commit but before these lines leaves a
            # completion whose only trace is ``joint0`` (the verifier accepts it: the
            # claim and the completion were one transaction, so the completer held
            # the lease it completed under).
            assert operation == "joint_commit" and isinstance(result, JointOutcome)
            claimed = self._journal_claim(decision_id, t0, t1, result.claim)
            if claimed is not None:
                write(e="complete0", d=decision_id, t0=t0)
                write(e="complete", d=decision_id, t0=t0, t1=t1, ok=True, ours=True)
                inserted = "insert" if result.inserted else "replay"
                write(e="sink", d=decision_id, a=claimed.attempt, r=inserted)

    def _journal_claim(
        self, decision_id: str, t0: int, t1: int, outcome: ClaimOutcome
    ) -> Claimed | None:
        if not isinstance(outcome, Claimed):
            self.journal.write(
                e="claim", d=decision_id, t0=t0, t1=t1, r=_CLAIM_RESULT[type(outcome)]
            )
            return None
        self.journal.claims += 1
        if outcome.attempt > 1:
            self.journal.takeovers += 1
        self.journal.write(e="claim", d=decision_id, t0=t0, t1=t1, r="claimed", a=outcome.attempt)
        return outcome

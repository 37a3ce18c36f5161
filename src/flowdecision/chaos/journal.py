"""The evidence a worker leaves: an append-only journal, and the ledger that writes it.

Each line is one ``write(2)`` to an ``O_APPEND`` file, which a SIGKILL cannot
tear; a kill loses at most what happened after the last line, and nothing in
a journal is ever wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import LedgerError
from ..identity import ExecutionIdentity, ResultReceipt
from ..ledger.protocol import DelegatingLedger, Ledger
from ..ledger.states import AlreadyCompleted, Busy, Claimed, ClaimOutcome, Conflict, JointOutcome
from ..store.joint import JointWrite
from .config import wall_ms

__all__ = ["Journal", "JournalingLedger", "read_journal"]


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


_CLAIM_RESULT = {Busy: "busy", Conflict: "conflict", AlreadyCompleted: "completed"}


class JournalingLedger(DelegatingLedger):
    """Delegates to a real ledger and journals every mutation with its timing.

    Renewals, completions and joint claim-and-completes are also journaled
    *before* the call (``renew0``, ``complete0``, ``joint0``), so a call cut
    short by a kill is visible.
    """

    def __init__(self, inner: Ledger, journal: Journal) -> None:
        super().__init__(inner)
        self.journal = journal

    async def claim(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        now_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
    ) -> ClaimOutcome:
        t0 = wall_ms()
        try:
            outcome = await super().claim(
                decision_id, request_hash, owner_id, lease_ms=lease_ms, now_ms=now_ms,
                identity=identity,
            )  # fmt: skip
        except LedgerError as error:
            self.journal.write(
                e="claim", d=decision_id, t0=t0, t1=wall_ms(), r="error", m=str(error)
            )
            raise
        t1 = wall_ms()
        if isinstance(outcome, Claimed):
            self.journal.claims += 1
            if outcome.attempt > 1:
                self.journal.takeovers += 1
            self.journal.write(
                e="claim", d=decision_id, t0=t0, t1=t1, r="claimed", a=outcome.attempt
            )
        else:
            self.journal.write(
                e="claim", d=decision_id, t0=t0, t1=t1, r=_CLAIM_RESULT[type(outcome)]
            )
        return outcome

    async def renew(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        now_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
    ) -> bool:
        t0 = wall_ms()
        self.journal.write(e="renew0", d=decision_id, t0=t0)
        try:
            renewed = await super().renew(
                decision_id, request_hash, owner_id, lease_ms=lease_ms, now_ms=now_ms,
                identity=identity,
            )  # fmt: skip
        except LedgerError as error:
            self.journal.write(
                e="renew", d=decision_id, t0=t0, t1=wall_ms(), ok=False, m=str(error)
            )
            raise
        self.journal.write(e="renew", d=decision_id, t0=t0, t1=wall_ms(), ok=renewed)
        return renewed

    async def complete(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        completed_at_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
        receipt: ResultReceipt | None = None,
    ) -> bool:
        t0 = wall_ms()
        self.journal.write(e="complete0", d=decision_id, t0=t0)
        try:
            ours = await super().complete(
                decision_id, request_hash, owner_id, completed_at_ms=completed_at_ms,
                identity=identity, receipt=receipt,
            )  # fmt: skip
        except LedgerError as error:
            self.journal.write(
                e="complete", d=decision_id, t0=t0, t1=wall_ms(), ok=False, m=str(error)
            )
            raise
        self.journal.write(e="complete", d=decision_id, t0=t0, t1=wall_ms(), ok=True, ours=ours)
        return ours

    async def joint_commit(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        identity: ExecutionIdentity,
        receipt: ResultReceipt,
        write: JointWrite,
    ) -> JointOutcome:
        """Journaled as the claim, then the completion, then the sink's row: the
        three happened in one transaction, inside the lease the claim granted.

        ``joint0`` is journaled before the call: a kill after the commit but
        before the answer is journaled leaves a completion whose only trace is
        that line (the verifier accepts it: the claim and the completion were
        one transaction, so the completer held the lease it completed under).
        """
        t0 = wall_ms()
        self.journal.write(e="joint0", d=decision_id, t0=t0)
        try:
            done = await super().joint_commit(
                decision_id, request_hash, owner_id, lease_ms=lease_ms, identity=identity,
                receipt=receipt, write=write,
            )  # fmt: skip
        except LedgerError as error:
            self.journal.write(
                e="claim", d=decision_id, t0=t0, t1=wall_ms(), r="error", m=str(error)
            )
            raise
        t1 = wall_ms()
        outcome = done.claim
        if not isinstance(outcome, Claimed):
            self.journal.write(
                e="claim", d=decision_id, t0=t0, t1=t1, r=_CLAIM_RESULT[type(outcome)]
            )
            return done
        self.journal.claims += 1
        if outcome.attempt > 1:
            self.journal.takeovers += 1
        self.journal.write(e="claim", d=decision_id, t0=t0, t1=t1, r="claimed", a=outcome.attempt)
        self.journal.write(e="complete0", d=decision_id, t0=t0)
        self.journal.write(e="complete", d=decision_id, t0=t0, t1=t1, ok=True, ours=True)
        self.journal.write(
            e="sink", d=decision_id, a=outcome.attempt, r="insert" if done.inserted else "replay"
        )
        return done

    async def release(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        identity: ExecutionIdentity | None = None,
    ) -> None:
        await super().release(decision_id, request_hash, owner_id, identity=identity)
        self.journal.write(e="release", d=decision_id, t1=wall_ms())

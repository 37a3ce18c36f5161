"""One harness run's settings (:class:`ChaosConfig`), checked and completed."""

from __future__ import annotations

import random
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from ..connections.urls import parse_ledger_url
from ..errors import InvalidArgumentError

__all__ = ["BRANCH", "ChaosConfig", "wall_ms"]

#: ``--sink`` runs deliver every decision to one workflow: keep its history small.
SINK_DECISIONS_MAX = 1000
#: The only branch the harness dispatches on.
BRANCH = "production"


def wall_ms() -> int:
    """This host's wall clock in Unix-epoch milliseconds (journal timestamps)."""
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class ChaosConfig:
    """One harness run.

    ``layout`` is where the outbox lives: ``shared`` (the default for SQLite and
    PostgreSQL ledgers, as ``serve`` lays them out) puts it in the ledger's own
    store, so every decision is claimed, written and completed in one
    transaction; ``separate`` (the only choice for a file ledger) puts it in
    ``<workdir>/outbox.db`` (for PostgreSQL: still the ledger's database, but
    written on the claim, submit, complete path). ``outbox_url`` overrides it.
    """

    ledger_url: str
    outbox_url: str | None = None
    layout: str | None = None
    workers: int = 8
    decisions: int = 5000
    lease_ms: int = 200
    concurrency: int = 4
    kill_every_ms: int = 1000
    pause_every_ms: int = 1500
    pause_ms: int | None = None
    duplicate_rate: float = 0.2
    conflict_rate: float = 0.05
    slow_sink_rate: float = 0.1
    sink_raise_rate: float = 0.02
    seed: int | None = None
    workdir: str | None = None
    timeout_s: float = 900.0
    run_id: str = ""
    #: ``temporal://host:port[/namespace]``: drain the outbox into Temporal through
    #: relays that are killed and restarted, then check what Temporal applied.
    sink: str | None = None
    #: the failover fault: a command that fails the ledger's database over (kills
    #: the primary, promotes a standby, rebuilds the old primary), run every
    #: ``failover_every_ms`` while the workers dispatch, at most ``max_failovers``
    #: times (0: no limit); the ledger URL must reach whichever server is primary
    failover_command: str | None = None
    failover_every_ms: int = 0
    max_failovers: int = 0
    #: the approval phase: this many decisions held for approval, then approved in
    #: bulk by operator processes that race and are SIGKILLed (0: no such phase)
    approvals: int = 0

    def resolved(self) -> ChaosConfig:
        """A copy with defaults filled in and values checked."""
        if self.workers < 2:
            raise InvalidArgumentError(
                "chaos needs at least 2 workers (every decision has 2 proposers)"
            )
        if self.decisions < 1 or self.lease_ms < 10 or self.concurrency < 1:
            raise InvalidArgumentError(
                "decisions >= 1, lease_ms >= 10 and concurrency >= 1 are required"
            )
        kind, _ = parse_ledger_url(self.ledger_url)
        if kind == "memory":
            raise InvalidArgumentError("a memory ledger cannot be shared between processes")
        if self.failover_command and self.failover_every_ms < 1:
            raise InvalidArgumentError("failover_command needs failover_every_ms >= 1")
        if self.failover_every_ms and not self.failover_command:
            raise InvalidArgumentError("failover_every_ms needs failover_command")
        out = ChaosConfig(**asdict(self))
        out.seed = self.seed if self.seed is not None else random.randrange(1 << 30)
        out.run_id = self.run_id or uuid.uuid4().hex[:8]
        out.pause_ms = self.pause_ms if self.pause_ms is not None else 3 * self.lease_ms
        if out.workdir is None:
            out.workdir = tempfile.mkdtemp(prefix="flowdecision-chaos-")
        if self.layout not in (None, "shared", "separate"):
            raise InvalidArgumentError(
                f"layout must be `shared` or `separate`, got {self.layout!r}"
            )
        if self.layout == "shared" and kind == "file":
            raise InvalidArgumentError("a file ledger cannot share its store with the outbox")
        out.layout = self.layout or ("separate" if kind == "file" else "shared")
        if self.approvals < 0:
            raise InvalidArgumentError(f"approvals must be 0 or more, got {self.approvals}")
        if self.approvals and kind == "file":
            raise InvalidArgumentError(
                "the approval phase needs a ledger that keeps holds (sqlite:///, "
                "postgresql://): a file ledger is shared with Rust hosts, which know none"
            )
        if self.sink is not None and self.decisions + self.approvals > SINK_DECISIONS_MAX:
            raise InvalidArgumentError(
                f"with --sink, at most {SINK_DECISIONS_MAX} decisions and approvals in all "
                "(one workflow's history holds them all)"
            )
        if out.outbox_url is None:
            out.outbox_url = (
                self.ledger_url
                if kind == "postgresql" or out.layout == "shared"
                else f"sqlite:///{Path(out.workdir).resolve() / 'outbox.db'}"
            )
        return out

    @property
    def ledger_kind(self) -> str:
        """``file``, ``sqlite`` or ``postgresql``."""
        return parse_ledger_url(self.ledger_url)[0]

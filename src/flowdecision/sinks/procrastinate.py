"""The procrastinate sink: each accepted decision becomes exactly one procrastinate job.

Needs the ``procrastinate`` extra (``pip install flowdecision[procrastinate]``);
importing :mod:`flowdecision` never imports procrastinate.

Library::

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=DSN))
    sink = ProcrastinateSink(app, "myapp.tasks.handle_decision")
    await sink.open()            # opens the app if it is not open yet

Service: ``flowdecision serve --sink
'procrastinate+postgresql://user@host/db?task=myapp.tasks.handle_decision'``
(see :func:`parse_procrastinate_url`).

**What the task receives.** The job's keyword arguments are ``request_json``
(``str``: the request's exact wire JSON, so ``DecisionRequest.parse(request_json)``
rebuilds the same request with the same hashes; procrastinate stores arguments
as ``jsonb``, which would reorder keys of a dict) and ``attempt`` (``int``: the
claim attempt that deferred the job); with tracing on, also ``traceparent``
(``str``: the W3C trace context of the dispatch's ``flowdecision.sink.submit``
span) when the task takes it (a ``traceparent`` parameter or ``**kwargs``; see
``pass_traceparent``). The job's ``queueing_lock`` is the
decision id; with ``lock_by_run=True`` its ``lock`` is the run id, so the
decisions of one run execute one at a time, in the order they were deferred
(at equal priority).

**Why a job runs once.** procrastinate's ``queueing_lock`` is a unique index
over jobs in status ``todo`` only: once the job started or finished, deferring
with the same lock succeeds and the job runs again. The dispatcher submits a
completed decision only once, but a crash between the sink accepting a decision
and the ledger recording completion makes the next owner submit it again. So
the sink records every decision it deferred in ``flow_decision_procrastinate``
(in the same PostgreSQL database), **in the same transaction as the job
insert** (procrastinate's ``configure(connection=...)``): the marker row and
the job commit together or not at all. A submission first inserts the marker;
if the row already exists the decision was deferred before and nothing more
happens (a different request under the same id raises
:class:`ProcrastinateConflictError`). Concurrent submitters of one id queue on
the marker's primary key, so they cannot both defer. Jobs the worker later
deletes (``delete_jobs``) change nothing: the marker stays.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from ..connections.closing import Openable
from ..connections.urls import describe_dsn, redact_url
from ..core.model import DecisionRequest
from ..observability.redact import redact_text
from ..observability.tracing import current_traceparent
from .base import check_attempt

if TYPE_CHECKING:
    import procrastinate
from ..connections.urls import split_engine_url
from ..errors import ProcrastinateConflictError, ProcrastinateSinkError, SinkConfigError

__all__ = [
    "MARKER_TABLE",
    "ProcrastinateConflictError",
    "ProcrastinateDeferral",
    "ProcrastinateSink",
    "ProcrastinateSinkError",
    "ProcrastinateUrl",
    "parse_procrastinate_url",
]

#: The table recording which decisions were deferred, and as which job.
MARKER_TABLE = "flow_decision_procrastinate"
#: pg_advisory_xact_lock key serializing the marker table's creation ("fdprocrs").
_SCHEMA_LOCK = 0x66647072_6F637273

_CREATE_MARKER_TABLE = f"""
CREATE TABLE IF NOT EXISTS {MARKER_TABLE} (
    decision_id     text PRIMARY KEY,
    request_hash    text NOT NULL,
    job_id          bigint,
    first_attempt   bigint NOT NULL,
    highest_attempt bigint NOT NULL,
    deferred_at     timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


@dataclass(frozen=True, slots=True)
class ProcrastinateDeferral:
    """What the marker table records for one decision."""

    decision_id: str
    request_hash: str
    job_id: int
    first_attempt: int
    highest_attempt: int


class ProcrastinateSink(Openable):
    """A :class:`~flowdecision.sinks.Sink` deferring one procrastinate job per decision.

    ``app`` must use procrastinate's ``PsycopgConnector`` (the marker row and
    the job share one transaction). ``task_name`` is the task's procrastinate
    name (by default its dotted path); the task need not be importable here,
    only by the workers. ``queue`` overrides the task's queue. See the module
    docs for the job's arguments and why a decision runs once.
    """

    def __init__(
        self,
        app: procrastinate.App,
        task_name: str,
        *,
        queue: str | None = None,
        lock_by_run: bool = False,
        pass_traceparent: bool | None = None,
    ) -> None:
        if not isinstance(task_name, str) or not task_name.strip():
            raise ProcrastinateSinkError("procrastinate sink needs a non-empty task name")
        self.app = app
        self.task_name = task_name
        self.queue = queue
        self.lock_by_run = lock_by_run
        #: Add a ``traceparent`` job argument while tracing is on; None: when the
        #: task registered in ``app`` takes one (a ``traceparent`` or ``**kwargs``).
        self.pass_traceparent = pass_traceparent
        self._opened_app = False
        self._ready = False

    def _passes_traceparent(self) -> bool:
        if self.pass_traceparent is not None:
            return self.pass_traceparent
        task = self.app.tasks.get(self.task_name)
        if task is None:
            return False  # not registered here: its signature is unknown
        parameters = inspect.signature(task.func).parameters.values()
        return any(
            p.name == "traceparent" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters
        )

    async def open(self) -> Self:
        """Open the app if needed, check procrastinate's schema, create the marker table."""
        if self._ready:
            return self
        from procrastinate import PsycopgConnector
        from procrastinate.exceptions import AppNotOpen

        connector = self.app.connector
        if not isinstance(connector, PsycopgConnector):
            raise ProcrastinateSinkError(
                "procrastinate sink needs an App with a PsycopgConnector, "
                f"got {type(connector).__qualname__}"
            )
        try:
            connector.pool  # noqa: B018 (raises AppNotOpen when the app is closed)
        except AppNotOpen:
            await self.app.open_async()
            self._opened_app = True
        try:
            async with connector.pool.connection() as conn, conn.transaction():
                cursor = await conn.execute("SELECT to_regclass('procrastinate_jobs')")
                row = await cursor.fetchone()
                if row is None or row[0] is None:
                    raise ProcrastinateSinkError(
                        "procrastinate's schema is missing from this database: apply it first "
                        "(`procrastinate --app=... schema --apply`, or "
                        "`await app.schema_manager.apply_schema_async()`)"
                    )
                await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                await conn.execute(_CREATE_MARKER_TABLE)
        except ProcrastinateSinkError:
            await self.close()
            raise
        except Exception as error:
            await self.close()
            raise ProcrastinateSinkError(
                f"procrastinate sink cannot prepare its database: {error}"
            ) from error
        self._ready = True
        return self

    async def close(self) -> None:
        """Close the app if this sink opened it."""
        self._ready = False
        if self._opened_app:
            self._opened_app = False
            await self.app.close_async()

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        """Defer the decision's job unless it was deferred before (see the module docs)."""
        await self.defer(request, attempt)

    async def defer(self, request: DecisionRequest, attempt: int) -> bool:
        """Like :meth:`submit`; True when this call deferred the job, False for a replay."""
        check_attempt(attempt)
        await self.open()
        from procrastinate import PsycopgConnector
        from procrastinate.exceptions import AlreadyEnqueued

        connector = self.app.connector
        assert isinstance(connector, PsycopgConnector)
        decision_id = request.decision_id
        text = request.to_json().decode("utf-8")
        hash_ = hashlib.sha256(request.to_json()).hexdigest()
        try:
            async with connector.pool.connection() as conn, conn.transaction():
                # The marker row comes first: it locks the id until this transaction
                # ends, so a concurrent submitter of the same id waits here and then
                # sees the committed marker (or, if we rolled back, inserts its own).
                cursor = await conn.execute(
                    f"INSERT INTO {MARKER_TABLE} "
                    "(decision_id, request_hash, first_attempt, highest_attempt) "
                    "VALUES (%s, %s, %s, %s) ON CONFLICT (decision_id) DO NOTHING "
                    "RETURNING decision_id",
                    (decision_id, hash_, attempt, attempt),
                )
                if await cursor.fetchone() is None:
                    await self._replayed(conn, decision_id, hash_, attempt)
                    return False
                deferrer = self.app.configure_task(
                    self.task_name,
                    queueing_lock=decision_id,
                    lock=request.run_id if self.lock_by_run else None,
                    queue=self.queue,
                    connection=conn,
                )
                trace = current_traceparent() if self._passes_traceparent() else None
                if trace is None:
                    job_id = await deferrer.defer_async(request_json=text, attempt=attempt)
                else:
                    job_id = await deferrer.defer_async(
                        request_json=text, attempt=attempt, traceparent=trace
                    )
                await conn.execute(
                    f"UPDATE {MARKER_TABLE} SET job_id = %s WHERE decision_id = %s",
                    (job_id, decision_id),
                )
        except ProcrastinateSinkError:
            raise
        except AlreadyEnqueued as error:
            raise ProcrastinateSinkError(
                f"a procrastinate job with queueing lock `{decision_id}` is already waiting but "
                f"this sink never deferred it (something else defers jobs with decision ids "
                f"as queueing locks?): {error}"
            ) from error
        except Exception as error:
            raise ProcrastinateSinkError(
                f"procrastinate sink could not defer decision `{decision_id}`: {error}"
            ) from error
        return True

    async def _replayed(self, conn: Any, decision_id: str, hash_: str, attempt: int) -> None:
        cursor = await conn.execute(
            f"SELECT request_hash FROM {MARKER_TABLE} WHERE decision_id = %s", (decision_id,)
        )
        row = await cursor.fetchone()
        stored = str(row[0])
        if stored != hash_:
            raise ProcrastinateConflictError(decision_id, stored, hash_)
        await conn.execute(
            f"UPDATE {MARKER_TABLE} SET highest_attempt = %s "
            "WHERE decision_id = %s AND highest_attempt < %s",
            (attempt, decision_id, attempt),
        )

    async def deferral(self, decision_id: str) -> ProcrastinateDeferral | None:
        """What the marker table holds for ``decision_id``, or None if never deferred."""
        await self.open()
        from procrastinate import PsycopgConnector

        connector = self.app.connector
        assert isinstance(connector, PsycopgConnector)
        async with connector.pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT decision_id, request_hash, job_id, first_attempt, highest_attempt "
                f"FROM {MARKER_TABLE} WHERE decision_id = %s",
                (decision_id,),
            )
            row = await cursor.fetchone()
        if row is None:
            return None
        return ProcrastinateDeferral(
            decision_id=str(row[0]),
            request_hash=str(row[1]),
            job_id=int(row[2]),
            first_attempt=int(row[3]),
            highest_attempt=int(row[4]),
        )


@dataclass(frozen=True, slots=True)
class ProcrastinateUrl:
    """A parsed ``procrastinate+postgresql://…?task=…`` sink URL."""

    conninfo: str
    task_name: str
    queue: str | None
    lock_by_run: bool


def parse_procrastinate_url(url: str) -> ProcrastinateUrl:
    """Split ``procrastinate+postgresql://user@host/db?task=NAME[&queue=Q][&lock=run]``.

    ``task`` (required) is the procrastinate task name; ``queue`` overrides its
    queue; ``lock=run`` sets each job's ``lock`` to the decision's run id.
    Every other query parameter stays in the PostgreSQL connection string.
    """
    target, params = split_engine_url(url, "procrastinate", ("task", "queue", "lock"))
    if not target.startswith(("postgresql://", "postgres://")):
        raise SinkConfigError(
            f"procrastinate sink URL `{redact_url(url)}` must look like "
            "procrastinate+postgresql://user@host/db?task=module.task_name"
        )
    task = params.get("task")
    if not task:
        raise SinkConfigError(
            f"procrastinate sink URL `{redact_url(url)}` needs ?task=NAME "
            "(the procrastinate task name)"
        )
    lock = params.get("lock")
    if lock not in (None, "run"):
        raise SinkConfigError(
            f"procrastinate sink URL `{redact_url(url)}`: lock must be `run` (or absent), "
            f"got `{lock}`"
        )
    return ProcrastinateUrl(
        conninfo=target, task_name=task, queue=params.get("queue"), lock_by_run=lock == "run"
    )


#: Seconds to wait for the first connection (libpq's ``connect_timeout``).
PROBE_CONNECT_TIMEOUT_S = 10


async def _probe(conninfo: str) -> None:
    """Connect once, so an unreachable database fails now, naming the sink and host.

    Without it the connection pool retries in the background until its 30 s
    timeout and then raises a bare ``PoolTimeout``.
    """
    import psycopg

    try:
        conn = await psycopg.AsyncConnection.connect(
            conninfo, connect_timeout=PROBE_CONNECT_TIMEOUT_S
        )
    except Exception as error:
        detail = " ".join(redact_text(str(error)).split()) or type(error).__name__
        raise ProcrastinateSinkError(
            f"procrastinate sink cannot connect to PostgreSQL {describe_dsn(conninfo)}: {detail}"
        ) from error
    await conn.close()


async def open_procrastinate_url(url: str) -> ProcrastinateSink:
    """Build an App for the URL's database and open a :class:`ProcrastinateSink` on it."""
    parsed = parse_procrastinate_url(url)
    import procrastinate

    await _probe(parsed.conninfo)
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=parsed.conninfo, min_size=1, max_size=4)
    )
    sink = ProcrastinateSink(
        app, parsed.task_name, queue=parsed.queue, lock_by_run=parsed.lock_by_run
    )
    return await sink.open()

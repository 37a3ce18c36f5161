"""The SQLite connection thread, with group commit.

Every SQLite store owns one worker thread with its own :mod:`sqlite3`
connection; all database work runs there, so the event loop never blocks and
the connection never crosses threads. Work reaches the thread through a queue
and results come back with one ``call_soon_threadsafe`` per batch.

Two kinds of work:

* :meth:`SqliteThread.run` -- one function of the connection, alone, in queue
  order (reads, prunes, whole transactions of its own);
* :meth:`SqliteThread.apply` -- a *mutation* handed to the store's
  ``write_batch``. **Group commit**: the mutations that are queued when the
  thread becomes free -- up to ``max_batch``, optionally waiting up to
  ``max_wait_ms`` for more -- share one ``BEGIN IMMEDIATE`` ... ``COMMIT``.
  ``write_batch`` answers each job on its own (a rule failure fails only its
  caller); a database error fails the whole batch. Every caller is answered
  only after the ``COMMIT`` returned, i.e. after the commit is as durable as
  ``synchronous`` makes it. A lone mutation never waits. A mutation whose
  caller was cancelled while it was still queued is not applied.

**A lone mutation runs on its caller's thread** (``inline_max_ms > 0``, the
SQLite ledger's default, and ``max_wait_ms`` 0). Handing one operation to the connection thread
and back costs two thread wake-ups and a wait for the GIL, about twice what
the transaction itself costs when nothing else is going on (see
docs/BENCHMARKS.md, "The single-caller cycle"). So :meth:`SqliteThread.apply`
does not queue a mutation at once: it collects the mutations its event loop
asks for during the current loop iteration (the first caller's task yields
one turn, ``asyncio.sleep(0)``, so every task that is ready runs first, and
flushes them when it resumes; the others wait for their answers), and when
exactly one was asked for, the connection thread is idle and nothing is
queued, it runs that one transaction right there, in its caller's task, with
the same ``write_batch`` and the same ``BEGIN IMMEDIATE`` ... ``COMMIT``: its
future is done before it is awaited, so the caller goes on without another
turn of the loop. Two or more go to the connection thread as one batch, as
before, so concurrent callers keep group commit.

The price is that the event loop waits for that one commit (its fsync with
``synchronous=FULL``: ~0.2 ms on a local SSD, more on network storage; WAL
checkpoints run on a thread of their own, :mod:`.checkpoint`, except that an
inline commit copies the log itself once it passes SQLite's own 1,000 pages,
which only a caller writing without a pause reaches). Bounds: the
loop never waits for another writer's lock (its ``BEGIN IMMEDIATE`` runs
with a busy timeout of 0; when the lock is taken, the mutation goes to the
connection thread, which waits with the store's busy timeout), and after
three inline commits in a row that took longer than ``inline_max_ms`` lone
mutations use the connection thread again for a second. The connection is
shared by the two threads (``check_same_thread=False``); one lock serializes
every use of it.
Tracing on, an inline commit is a batch of one: it has its batch span too.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import FlowDecisionError
from ..observability.tracing import active as tracing_active
from ..observability.tracing import batch_span, recording_span
from .batching import copy_error, settle
from .checkpoint import Checkpointer
from .sqlite import SqliteOpener
from .transactions import sqlite_transaction

#: Inline commits in a row slower than ``inline_max_ms`` before lone mutations pause
#: inline running, and for how long (seconds).
_SLOW_LIMIT = 3
_SLOW_PAUSE_S = 1.0
#: A lone mutation's commit checkpoints past SQLite's own default, not the backstop: one
#: caller writing all the time leaves the checkpointer no moment to restart the log.
_INLINE_AUTOCHECKPOINT = 1000

__all__ = ["Job", "SqliteThread", "WriteBatch"]

T = TypeVar("T")


class Job:
    """One unit of work queued for the thread, answered on its loop.

    ``payload`` is the store's description of a mutation (``work`` is set
    instead for :meth:`SqliteThread.run`); ``write_batch`` sets ``result`` or
    ``error``.
    """

    __slots__ = ("batch", "error", "future", "loop", "payload", "result", "trace", "work")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        payload: Any = None,
        work: Callable[[sqlite3.Connection], Any] | None = None,
    ) -> None:
        self.loop = loop
        self.future = future
        self.payload = payload
        self.work = work
        self.result: Any = None
        self.error: BaseException | None = None
        #: Tracing on: the caller's span, and the batch span's context once
        #: committed (the caller's span links to it).
        self.trace: Any = None
        self.batch: Any = None


#: ``write_batch(conn, jobs)`` runs inside the batch's transaction, sets each job's
#: result or error, and may return a callback to run once the commit succeeded.
WriteBatch = Callable[[sqlite3.Connection, list[Job]], Callable[[], None] | None]

_STOP = object()
#: The batch's context when tracing is off (one shared null context).
_UNTRACED = contextlib.nullcontext()


class SqliteThread:
    """One connection, one thread, one queue (see the module docs)."""

    def __init__(
        self,
        opener: SqliteOpener,
        *,
        write_batch: WriteBatch | None = None,
        max_batch: int = 1,
        max_wait_ms: float = 0.0,
        inline_max_ms: float = 0.0,
        checkpoint_interval_ms: float = 0.0,
        checkpoint_backstop_pages: int = 0,
    ) -> None:
        self.opener = opener
        self.write_batch = write_batch
        self.max_batch = max_batch
        self.max_wait_ms = max_wait_ms
        #: Only a connection opened to be shared may run on a caller's thread, and a
        #: mutation told to wait for company (``max_wait_ms``) waits for it.
        self.inline_max_ms = inline_max_ms if opener.shared and max_wait_ms <= 0 else 0.0
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        #: Held by whichever thread is using the connection (its own, or a caller's inline).
        self._busy = threading.Lock()
        #: The mutations each event loop asked for in its current iteration (inline on).
        self._collected: dict[asyncio.AbstractEventLoop, list[Job]] = {}
        #: The connection's busy timeout is 0 (set by the inline path, under ``_busy``).
        self._no_wait = False
        self._slow = 0
        self._inline_after = 0.0
        #: Mutations committed inline (for tests and benchmarks).
        self.inline_commits = 0
        #: Group commit with ``checkpoint_interval_ms`` > 0: WAL checkpoints run on a
        #: thread of their own (:mod:`.checkpoint`), started with the connection.
        self.checkpoint_interval_ms = checkpoint_interval_ms if write_batch else 0.0
        self.checkpoint_backstop_pages = checkpoint_backstop_pages
        self.checkpointer: Checkpointer | None = None

    # -- the event loop's side -------------------------------------------------

    async def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work(connection)`` on the thread, in queue order."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._submit(Job(loop, future, work=work))
        return await future

    async def apply(self, payload: Any) -> Any:
        """Queue a mutation for ``write_batch``; its result once its batch committed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        job = Job(loop, future, payload)
        traced = tracing_active()
        if traced:
            job.trace = recording_span()
        if self.inline_max_ms > 0 and self._conn is not None:
            if self._closed:
                raise self._closed_error()
            collected = self._collected.get(loop)
            if collected is not None:
                collected.append(job)  # the first collector flushes it with its own
            else:
                # Collect: hold the job until every task that is ready in this loop
                # iteration has run (one turn: this task is rescheduled behind them and
                # the ones that join), then flush what was collected.
                self._collected[loop] = [job]
                try:
                    await asyncio.sleep(0)
                except BaseException:  # cancelled meanwhile: its own job is never applied
                    future.cancel()
                    self._flush(loop)
                    raise
                self._flush(loop)
        else:
            self._submit(job)
        if not traced:
            return await future  # done already when committed inline: no wait
        try:
            return await future
        finally:
            if job.batch is not None:  # this decision's span -> the batch that committed it
                job.trace.add_link(job.batch)

    async def close(self) -> None:
        """Close the connection and stop the thread (after queued work)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return

        def shut(conn: sqlite3.Connection | None) -> None:
            if self.checkpointer is not None:
                self.checkpointer.close()
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.put(Job(loop, future, work=shut))
        self._queue.put(_STOP)
        try:
            await future
        except FlowDecisionError:
            pass

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """The mutations ``loop`` collected: a lone one inline if it can, else queued."""
        jobs = self._collected.pop(loop)
        if len(jobs) == 1 and self._inline(jobs[0]):
            settle(jobs)
            return
        if self._closed:  # closed after they were asked for: nobody will take them
            for job in jobs:
                job.error = self._closed_error()
            settle(jobs)
            return
        for job in jobs:
            self._submit(job)

    def _inline(self, job: Job) -> bool:
        """Commit ``job`` alone on this thread, if the connection is free; whether it did."""
        if not self._queue.empty():
            return False
        started = time.perf_counter()
        if started < self._inline_after or not self._busy.acquire(blocking=False):
            return False
        try:
            conn = self._conn
            if conn is None or self._closed:
                return False
            if job.future.cancelled():
                return True  # its caller gave up before it started: not applied
            try:
                if not self._no_wait:
                    conn.execute("PRAGMA busy_timeout = 0")
                    if self.checkpointer is not None:
                        conn.execute(f"PRAGMA wal_autocheckpoint = {_INLINE_AUTOCHECKPOINT}")
                    self._no_wait = True
                # Another writer holds the lock (or the read snapshot is busy): the
                # connection thread waits for it instead of this event loop.
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error:
                return False
            self._commit([job], begun=True)
            self.inline_commits += 1
        finally:
            self._busy.release()
        if time.perf_counter() - started > self.inline_max_ms / 1000:
            self._slow += 1
            if self._slow >= _SLOW_LIMIT:
                self._slow = 0
                self._inline_after = time.perf_counter() + _SLOW_PAUSE_S
        else:
            self._slow = 0
        return True

    def _closed_error(self) -> FlowDecisionError:
        return self.opener.component.errors.base(f"{self.opener.where} is closed")

    def _submit(self, job: Job) -> None:
        if self._closed:
            raise self._closed_error()
        if self._thread is None:
            with self._thread_lock:
                if self._thread is None:
                    thread = threading.Thread(
                        target=self._serve,
                        name=f"flowdecision-sqlite-{self.opener.component.name}",
                        daemon=True,
                    )
                    thread.start()
                    self._thread = thread
        self._queue.put(job)

    # -- the thread's side ----------------------------------------------------------

    def _serve(self) -> None:
        """Take jobs in order, batching consecutive mutations."""
        take = self._queue.get
        carry: Any = None
        while True:
            job = carry if carry is not None else take()
            carry = None
            if job is _STOP:
                return
            if job.work is not None:
                with self._busy:
                    self._run_work(job)
                self._answer([job])
                continue
            batch, carry = self._gather(job)
            with self._busy:
                self._commit(batch)
            self._answer(batch)

    def _gather(self, first: Job) -> tuple[list[Job], Any]:
        """``first`` and the mutations queued behind it (up to ``max_batch``), and the
        next job that is not a mutation (carried to the next round), if any."""
        batch = [first]
        wait_s = self.max_wait_ms / 1000
        if wait_s <= 0 and self._queue.empty():
            return batch, None  # a lone mutation (this thread is the only taker)
        deadline = 0.0
        while len(batch) < self.max_batch:
            try:
                following = self._queue.get_nowait()
            except queue.Empty:
                if wait_s <= 0:
                    break
                now = time.monotonic()
                if not deadline:
                    deadline = now + wait_s
                if now >= deadline:
                    break
                try:
                    following = self._queue.get(timeout=deadline - now)
                except queue.Empty:
                    break
            if following is _STOP or following.work is not None:
                return batch, following
            batch.append(following)
        return batch, None

    def _answer(self, jobs: list[Job]) -> None:
        loop = jobs[0].loop
        if len(jobs) == 1 or all(job.loop is loop for job in jobs):
            groups = [(loop, jobs)]
        else:
            by_loop: dict[asyncio.AbstractEventLoop, list[Job]] = {}
            for job in jobs:
                by_loop.setdefault(job.loop, []).append(job)
            groups = list(by_loop.items())
        for target, group in groups:
            try:
                target.call_soon_threadsafe(settle, group)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting
                pass

    def _connection(self) -> sqlite3.Connection:
        """The connection, for this thread (holding ``_busy``): opened, and waiting for
        other writers' locks up to the store's busy timeout."""
        if self._conn is None:
            self._conn = self.opener.connect()
            self._no_wait = False
            if self.checkpoint_interval_ms > 0 and self.checkpointer is None:
                # Commits checkpoint only if the checkpointer falls this far behind.
                pages = int(self.checkpoint_backstop_pages)
                self._conn.execute(f"PRAGMA wal_autocheckpoint = {pages}")
                self.checkpointer = Checkpointer(
                    self.opener, interval_s=self.checkpoint_interval_ms / 1000
                )
        elif self._no_wait:
            self._conn.execute(f"PRAGMA busy_timeout = {int(self.opener.busy_timeout_ms)}")
            if self.checkpointer is not None:
                pages = int(self.checkpoint_backstop_pages)
                self._conn.execute(f"PRAGMA wal_autocheckpoint = {pages}")
            self._no_wait = False
        return self._conn

    def _run_work(self, job: Job) -> None:
        assert job.work is not None
        try:
            job.result = job.work(self._connection())
        except sqlite3.Error as error:
            failure = self.opener.translate(error)
            failure.__cause__ = error
            job.error = failure
        except BaseException as error:
            job.error = error

    def _commit(self, batch: list[Job], begun: bool = False) -> None:
        """Apply ``batch`` in arrival order inside one ``BEGIN IMMEDIATE`` transaction
        (``begun``: already begun, inline, on the connection as it is)."""
        assert self.write_batch is not None
        # A caller that gave up before the batch started is not applied (a claim nobody
        # awaits would only leave a lease nobody holds). Read across threads, so a
        # cancel that races with this check still applies.
        live = [job for job in batch if not job.future.cancelled()]
        traced = [job for job in live if job.trace is not None]
        try:
            conn = self._conn if begun and self._conn is not None else self._connection()
            with (
                (
                    batch_span(self.opener.component.name, "sqlite", len(live), traced)
                    if traced
                    else _UNTRACED
                ),
                sqlite_transaction(conn, begun),
            ):
                committed = self.write_batch(conn, live)
        except sqlite3.Error as error:
            failure: BaseException = self.opener.translate(error)
            failure.__cause__ = error
            self._fail(batch, failure)
            return
        except Exception as error:
            self._fail(batch, error)
            return
        if committed is not None:
            committed()
        if self.checkpointer is not None:
            self.checkpointer.wake()

    def _fail(self, batch: list[Job], error: BaseException) -> None:
        for index, job in enumerate(batch):
            job.error = error if index == 0 else copy_error(error)
            job.result = None

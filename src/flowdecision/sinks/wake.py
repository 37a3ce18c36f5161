"""Waking the readers of an outbox when rows were committed, without a busy poll.

One :class:`Wakeup` per store (:func:`wakeup_for`, keyed by the store's
:class:`~flowdecision.store.joint.StoreKey`), shared by every outbox object of
the process that points at that store. Writers call :meth:`Wakeup.notify`
after their commit, from any thread; readers (the relay, the long-poll and the
event stream of ``GET /v1/outbox``) remember :attr:`Wakeup.generation` before
they read and, finding nothing new, wait until it changes. A commit between
their read and their wait therefore still wakes them.

Who notifies: on SQLite the outbox's own inserts and the dispatcher after a
transactional commit (writes of *this* process; other processes' writes are
found by a poll that backs off, see :meth:`OutboxSink.wait_for_rows`); on
PostgreSQL the outbox's ``LISTEN`` connection, fed by a trigger's ``NOTIFY``
from every writer on every host.
"""

from __future__ import annotations

import asyncio
import threading

from ..store.joint import StoreKey

__all__ = ["Wakeup", "wakeup_for"]


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Wakeup:
    """A thread-safe "something was committed" signal that coroutines of any loop await."""

    __slots__ = ("_lock", "_waiters", "generation")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        #: Grows by one on every :meth:`notify`.
        self.generation = 0

    def notify(self) -> None:
        """Wake every waiter (callable from any thread; cheap when none waits)."""
        with self._lock:
            self.generation += 1
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            if loop.is_closed():
                continue
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # the loop closed meanwhile
                pass

    async def wait(self, seen: int, timeout_s: float) -> bool:
        """Wait until :attr:`generation` differs from ``seen``; False after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.generation != seen:
                return True
            future: asyncio.Future[None] = loop.create_future()
            entry = (loop, future)
            self._waiters.append(entry)
        try:
            await asyncio.wait_for(future, timeout_s)
            return True
        except TimeoutError:
            return self.generation != seen
        finally:
            with self._lock:
                if entry in self._waiters:
                    self._waiters.remove(entry)


_WAKEUPS: dict[StoreKey, Wakeup] = {}
_REGISTRY_LOCK = threading.Lock()


def wakeup_for(key: StoreKey) -> Wakeup:
    """The process's one :class:`Wakeup` for the store ``key``."""
    found = _WAKEUPS.get(key)
    if found is not None:
        return found
    with _REGISTRY_LOCK:
        return _WAKEUPS.setdefault(key, Wakeup())

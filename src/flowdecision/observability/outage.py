"""Quiet, useful logs while a store is down: one line when it starts, a summary
every ``summary_s`` while it lasts, one line when it ends.

A store that cannot be reached (or whose disk is full) fails every request
until it is back; a line per failure (or a driver traceback per reconnection
attempt) buries the one fact an operator needs: since when, and how often it
was tried. :class:`Outage` turns the stream of failures into three kinds of
line, all carrying the same ``store``, ``code``, ``attempts`` and
``duration_s`` fields:

* ``store unavailable`` (warning): the first failure, with its cause;
* ``store still unavailable`` (warning): at most one per ``summary_s``, counting
  the failed attempts since the start, written when a failure arrives;
* ``store available again`` (info): the first success after failures.

A change of kind while it lasts (unreachable, then full) is its own line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["DEFAULT_SUMMARY_S", "OUTAGE_CODES", "Outage"]

#: Seconds between two summaries while a store stays down.
DEFAULT_SUMMARY_S = 30.0
#: The error codes that mean a store is down (rather than a request being wrong).
OUTAGE_CODES = frozenset({"ledger_unavailable", "store_full"})


class Outage:
    """One store's availability, as seen by the operations that use it.

    Call :meth:`failed` for each operation the store failed for want of
    availability, :meth:`succeeded` for each it served. ``code`` is the
    failure's stable error code (``ledger_unavailable``, ``store_full``...): a
    ``store_full`` outage ends only on a successful *write* (reads work on a
    full disk).
    """

    __slots__ = (
        "_clock",
        "_log",
        "_summary_at",
        "active",
        "attempts",
        "code",
        "since",
        "store",
        "summary_s",
    )

    def __init__(
        self,
        log: logging.Logger,
        store: str,
        *,
        summary_s: float = DEFAULT_SUMMARY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self.store = store
        self.summary_s = summary_s
        self._clock = clock
        #: True from the first failure until the store serves again.
        self.active = False
        #: The code of the latest failure (None when not active).
        self.code: str | None = None
        #: Failed attempts since the outage began.
        self.attempts = 0
        #: When it began (``clock()`` seconds).
        self.since = 0.0
        self._summary_at = 0.0

    def duration_s(self) -> float:
        """How long the current outage has lasted (0 when there is none)."""
        return round(self._clock() - self.since, 3) if self.active else 0.0

    def _fields(self, **more: object) -> dict[str, object]:
        return {
            "store": self.store,
            "code": self.code,
            "attempts": self.attempts,
            "duration_s": self.duration_s(),
            **more,
        }

    def failed(self, code: str, cause: str) -> None:
        """An operation failed because the store is unavailable (``code`` says how)."""
        now = self._clock()
        if not self.active or code != self.code:
            if not self.active:
                self.active, self.since, self.attempts = True, now, 0
            self.code = code
            self.attempts += 1
            self._summary_at = now + self.summary_s
            self._log.warning("store unavailable", extra=self._fields(cause=cause))
            return
        self.attempts += 1
        if now >= self._summary_at:
            self._summary_at = now + self.summary_s
            self._log.warning("store still unavailable", extra=self._fields(cause=cause))

    def now(self) -> float:
        """The tracker's clock: what :meth:`succeeded` takes as ``began``."""
        return self._clock()

    def succeeded(self, *, wrote: bool = True, began: float | None = None) -> None:
        """The store served an operation (``wrote``: it stored something).

        ``began`` (from :meth:`now`): when the operation started. One that started
        before the outage did (in flight on a connection the crash had not reached
        yet) says nothing about the store now, so it does not end the outage.
        """
        if began is not None and began < self.since:
            return
        if self.active and (wrote or self.code != "store_full"):
            self._log.info("store available again", extra=self._fields())
            self.active, self.code, self.attempts = False, None, 0

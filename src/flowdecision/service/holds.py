"""Approval holds as the service shows and announces them.

* :func:`read_holds` reads what an operator needs to see (how many decisions
  are held, since when, and the oldest ones with their content) with two
  indexed queries and one read per shown decision: the status page's
  "Awaiting approval" section and ``/metrics``' held gauges read it.
* :class:`HoldNotifier` posts a notification to a webhook when a POST is
  answered ``held`` (``hold_notify_url``), off the request's path.

A notification is at-least-once, not exactly-once: the notifier remembers the
decisions it announced recently and skips a re-POST of one of them, but two
workers, two hosts or a restart may each announce the same hold. Each carries
``Idempotency-Key: held:<decision_id>`` for the receiver to deduplicate on.
A notification that still fails after the webhook sink's retries is logged
and counted, never retried later: the hold itself is in the ledger
(``GET /v1/decisions?state=held``, the status page), the notification is a
courtesy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson

from ..core.approvals import decision_kind
from ..core.defaults import WEBHOOK_MAX_ATTEMPTS
from ..core.jsonwire import Fragment, encode_json
from ..core.model import DecisionRequest
from ..errors import FlowDecisionError, LedgerError
from ..ledger.base import Ledger
from ..ledger.query import DecisionQuery, DecisionRow
from ..ledger.states import DecisionState
from ..sinks.webhook import WebhookSink

__all__ = [
    "HOLD_NOTIFY_QUEUE",
    "HeldDecision",
    "HoldNotifier",
    "HoldsView",
    "read_holds",
]

log = logging.getLogger("flowdecision.service.holds")

#: Held decisions the status page shows (the oldest first).
SHOWN_HOLDS = 20
#: Characters of a held decision's content the status page shows.
SHOWN_CONTENT_CHARS = 2000
#: Notifications waiting to be sent; beyond it the oldest is dropped (and counted).
HOLD_NOTIFY_QUEUE = 1000
#: Decisions the notifier remembers having announced (a re-POST is not announced again).
_REMEMBERED = 10_000


@dataclass(frozen=True, slots=True)
class HeldDecision:
    """One held decision as the status page shows it: its row and its content
    (the request's JSON, indented; None when it could not be read)."""

    row: DecisionRow
    content: str | None


@dataclass(frozen=True, slots=True)
class HoldsView:
    """The ledger's held decisions: how many, the oldest one's hold time, and the
    oldest :data:`SHOWN_HOLDS` of them. ``error`` is the ledger's error code when
    it could not be read (then ``count`` is 0)."""

    count: int
    oldest_held_at_ms: int | None
    shown: Sequence[HeldDecision] = ()
    error: str | None = None

    def oldest_age_s(self, now_ms: int) -> float:
        """Seconds the oldest held decision has waited (0 when none is held)."""
        if self.oldest_held_at_ms is None:
            return 0.0
        return max(0, now_ms - self.oldest_held_at_ms) / 1000


def _content(request_json: str | None) -> str | None:
    if request_json is None:
        return None
    try:
        text = orjson.dumps(orjson.loads(request_json), option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONDecodeError:
        text = request_json
    if len(text) > SHOWN_CONTENT_CHARS:
        text = text[:SHOWN_CONTENT_CHARS] + "\n…"
    return text


async def read_holds(ledger: Ledger, *, shown: int = SHOWN_HOLDS) -> HoldsView:
    """How many decisions ``ledger`` holds and the oldest ``shown`` of them, with
    their content (``shown=0``: the count and the oldest hold time only)."""
    query = DecisionQuery(state=DecisionState.HELD, limit=max(1, shown))
    try:
        count = await ledger.count_decisions(query)
        if count == 0:
            return HoldsView(0, None)
        page = await ledger.list_decisions(query)
        held: list[HeldDecision] = []
        for row in page.decisions[:shown]:
            record = await ledger.read_record(row.decision_id)
            held.append(HeldDecision(row, _content(None if record is None else record.request)))
    except LedgerError as error:
        return HoldsView(0, None, error=error.code)
    oldest = page.decisions[0].created_at_ms if page.decisions else None
    return HoldsView(count, oldest, held)


class HoldNotifier:
    """Posts ``{"event": "decision.held", ...}`` to ``url`` for each newly held decision.

    :meth:`held` only queues (it never waits for the webhook); one task sends,
    through a :class:`~flowdecision.sinks.webhook.WebhookSink`'s retry loop
    (backoff, ``Retry-After``, a 4xx refuses for good). The body::

        {"event": "decision.held", "decision_id": ..., "run_id": ...,
         "decision_type": ..., "hold_expires_at_ms": ... | null,
         "held_at_ms": ..., "request": {...the decision request...}}

    :attr:`on_result` is called once per notification with ``sent``, ``failed``
    (after the retries) or ``dropped`` (the queue was full): ``/metrics`` counts them.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        max_attempts: int = WEBHOOK_MAX_ATTEMPTS,
        queue_size: int = HOLD_NOTIFY_QUEUE,
    ) -> None:
        self.url = url
        self._sink = WebhookSink(url, token=token, max_attempts=max_attempts)
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(maxsize=queue_size)
        self._announced: OrderedDict[str, None] = OrderedDict()
        self._task: asyncio.Task[None] | None = None
        #: Called with each notification's result (the app counts them in ``/metrics``).
        self.on_result: Callable[[str], None] = lambda result: None

    def start(self) -> None:
        """Start the sending task (in the running event loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="flowdecision-hold-notifier")

    async def close(self) -> None:
        """Stop sending (what is still queued is dropped: the holds stay in the ledger)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._sink.close()

    def held(self, request: DecisionRequest, hold_expires_at_ms: int | None) -> None:
        """Queue the notification for ``request``, just answered held (once per decision
        this process remembers; the oldest queued one gives way when the queue is full)."""
        decision_id = request.decision_id
        if decision_id in self._announced:
            return
        self._announced[decision_id] = None
        while len(self._announced) > _REMEMBERED:
            self._announced.popitem(last=False)
        body = encode_json(
            {
                "event": "decision.held",
                "decision_id": decision_id,
                "run_id": request.run_id,
                "decision_type": decision_kind(request),
                "hold_expires_at_ms": hold_expires_at_ms,
                "held_at_ms": time.time_ns() // 1_000_000,
                "request": Fragment(request.to_json()),
            }
        )
        if self._queue.full():
            self._queue.get_nowait()
            self.on_result("dropped")
        self._queue.put_nowait((decision_id, body))

    async def _run(self) -> None:
        while True:
            decision_id, body = await self._queue.get()
            headers = {
                "Content-Type": "application/json",
                "Idempotency-Key": f"held:{decision_id}",
                "X-Flow-Event": "decision.held",
            }
            try:
                await self._sink.post(self.url, body, headers, decision_id)
            except Exception as error:  # one notification fails; the next ones still go
                self.on_result("failed")
                code = error.code if isinstance(error, FlowDecisionError) else type(error).__name__
                log.warning(
                    "hold notification failed", extra={"decision_id": decision_id, "error": code}
                )
            else:
                self.on_result("sent")

"""The service's endpoints, one function each; :func:`routes` lists them.

Each handler finds the running :class:`~.runtime.Service`, the settings and the
metrics in :class:`AppContext` (``request.app.state.context``). Errors are
answered through the one table in :mod:`.errors`; their causes are logged
here, with the request id, the decision id, the error class and its code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..core.identity import DecisionTooLargeError
from ..core.jsonwire import count_items
from ..core.limits import I64_MAX, RESULT_RECEIPT_MAX_BYTES
from ..core.model import DecisionRequest, InvalidRequestError
from ..errors import DispatchError, LedgerError
from ..ledger.query import DecisionQuery
from ..ledger.states import DecisionState, Held
from ..observability.health import HealthStatus
from ..observability.outage import OUTAGE_CODES
from .config import Settings
from .errors import (
    HTTP_ERRORS,
    error_code_for,
    error_response,
    response_for_error,
    static_error,
)
from .head import RequestHead
from .holds import read_holds
from .inputs import (
    BadParamError,
    bad_param,
    bounded_int,
    declared_over,
    one_header,
    one_param,
    read_body_within,
)
from .logs import describe_cause
from .metrics import CONTENT_TYPE_LATEST, ServiceMetrics
from .operations import list_decisions, operation_routes, recent_actions, status_finder
from .routing import Route
from .runtime import Service
from .status import ATTENTION_FATES, Attention, RecentDecision, render_status_page

__all__ = ["MAX_WAIT_S", "OUTBOX_MAX_LIMIT", "AppContext", "preferred_wait_s", "routes"]

log = logging.getLogger("flowdecision.service")

OUTBOX_MAX_LIMIT = 1000
#: The longest ``Prefer: wait=N`` honoured; larger values are capped to it.
MAX_WAIT_S = 30


@dataclass(slots=True)
class StreamGate:
    """The outbox's event streams and waiting long-polls open at once: at most ``limit``.

    Each holds a connection for as long as it lasts and is never evicted, so their
    own bound (below the connection cap) keeps connections free for requests:
    ``/healthz`` and POSTs are still answered however many streams are open.
    """

    limit: int
    open: int = 0

    def enter(self) -> bool:
        """Count one more stream, or False (and nothing counted) at the limit."""
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def leave(self) -> None:
        self.open -= 1

    def refusal(self) -> Response:
        """The answer to a stream over the limit: 503 ``too_many_streams``."""
        return error_response(
            503,
            "too_many_streams",
            f"this replica already serves {self.limit} outbox streams and long-polls, its "
            "limit (max_streams); retry later, or read pages without `wait`",
            headers={"Retry-After": "1"},
        )


@dataclass(slots=True)
class AppContext:
    """What every handler needs: settings, metrics, and the service once started."""

    settings: Settings
    service: Service | None
    ledger_shown: str
    sink_shown: str
    metrics: ServiceMetrics = field(init=False)
    streams: StreamGate = field(init=False)
    lane: BodyLane = field(init=False)

    def __post_init__(self) -> None:
        self.streams = StreamGate(self.settings.stream_limit())
        self.lane = BodyLane()


def _context(request: Request) -> tuple[AppContext, Service]:
    context: AppContext = request.app.state.context
    if context.service is None:  # pragma: no cover - only before startup
        raise HTTPException(503, "service is starting")
    return context, context.service


def _log_failure(error: BaseException, code: str, decision_id: str | None) -> None:
    """One record per failed request: request id (added by the log filter), decision
    id, error class, code and cause. Failures of the service's parts are warnings."""
    status = HTTP_ERRORS[code].status
    # A store that is down fails every request: the dispatcher's outage log says
    # so once, then summarizes (flowdecision.observability.outage); per request, only at debug.
    level = logging.INFO if status < 500 else logging.WARNING
    if code in OUTAGE_CODES:
        level = logging.DEBUG
    log.log(
        level,
        "request failed",
        extra={
            "decision_id": decision_id,
            "error": type(error).__name__,
            "code": code,
            "status": status,
            "cause": describe_cause(error),
        },
    )


# -- POST /v1/decisions -----------------------------------------------------------


class _Encoded(Response):
    """``JSONResponse(content, status_code)`` for content already encoded as JSON:
    the same status, headers (``content-length``, ``content-type``) and body."""

    media_type = "application/json"

    def __init__(self, body: bytes, status_code: int) -> None:  # no super(): nothing to render
        self.status_code = status_code
        self.background = None
        self.body = body
        self.raw_headers = [
            (b"content-length", b"%d" % len(body)),
            (b"content-type", b"application/json"),
        ]


def preferred_wait_s(headers: Headers) -> int | None:
    """The ``wait`` preference of RFC 7240's ``Prefer`` header, capped at :data:`MAX_WAIT_S`.

    None without one, for ``wait=0`` and for a malformed value (RFC 7240: a
    preference the server does not understand is ignored).
    """
    return _wait_preference(headers.getlist("prefer"))


def _wait_preference(values: list[str]) -> int | None:
    for value in values:
        for preference in value.split(","):
            name, _, rest = preference.partition("=")
            if name.strip().lower() != "wait":
                continue
            raw = rest.split(";", 1)[0].strip().strip('"')
            if not (raw.isascii() and raw.isdigit()) or len(raw) > 9:
                return None
            return min(int(raw), MAX_WAIT_S) or None
    return None


async def post_decision(request: Request) -> Response:
    """Submit a decision: 201 submitted, 200 duplicate, or an error from the table."""
    context, service = _context(request)
    head = RequestHead.of(request.scope)
    started = time.perf_counter()
    decision = await read_decision(context, service, request.receive, head.declared)
    if isinstance(decision, Response):
        return decision
    return await answer_post(context, service, decision, head.prefer, started)


#: A POST body longer than this (or of unknown length) is costly: it waits for the
#: :class:`BodyLane` before it is read.
LANE_BODY_BYTES = 16 * 1024
#: A shorter body with more items than this (a rough count) is costly too.
LANE_BODY_ITEMS = 1000
#: After a turn the lane stays closed this many times as long as the turn took.
LANE_PAUSE = 3


class BodyLane:
    """Costly request bodies (large, or holding many JSON values): one at a time, and
    at most half of the time.

    Reading, counting and parsing such a body runs on the event loop. Taken one at
    a time, and each followed by a pause as long as its own turn, they can take
    at most half of the loop whatever the number of clients sending them, so
    ordinary requests keep the other half (issue 38: four clients posting
    deeply nested bodies made an honest client's POSTs fall from 1,758 to 8 in
    10 s and ``/healthz`` take seconds). A costly body only waits for its turn.
    """

    def __init__(self) -> None:
        self._lock: asyncio.Lock | None = None  # made in the serving loop

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold the lane; on leaving it stays closed as long as the turn took."""
        lock = self._lock
        if lock is None:
            lock = self._lock = asyncio.Lock()
        await lock.acquire()
        started = time.perf_counter()
        try:
            yield
        finally:
            pause = LANE_PAUSE * (time.perf_counter() - started)
            asyncio.get_running_loop().call_later(pause, lock.release)


def _costly_length(declared: bytes | None) -> bool:
    return declared is None or not declared.isdigit() or declared_over(declared, LANE_BODY_BYTES)


async def read_decision(
    context: AppContext, service: Service, receive: Receive, declared: bytes | None
) -> DecisionRequest | Response:
    """The decision a ``POST`` carries, or the answer refusing it (a 413 when the body,
    or its ``Content-Length``, ``declared``, exceeds ``max_body_bytes``: the one
    answer sent before the body was read whole).

    A costly body (over :data:`LANE_BODY_BYTES` or of unknown length; or, once
    read, holding over :data:`LANE_BODY_ITEMS` items) is read, counted and
    parsed in the :class:`BodyLane`.
    """
    limit = context.settings.max_body_bytes
    if _costly_length(declared):
        async with context.lane.turn():
            body = await read_body_within(receive, declared, limit)
            if isinstance(body, Response):
                return body
            return _parse_post(context, service, body)
    body = await read_body_within(receive, declared, limit)
    if isinstance(body, Response):
        return body
    if len(body) > LANE_BODY_ITEMS and _rough_items(body) > LANE_BODY_ITEMS:
        async with context.lane.turn():
            return _parse_post(context, service, body)
    return _parse_post(context, service, body)


def _rough_items(body: bytes) -> int:
    return body.count(b"[") + body.count(b"{") + body.count(b",")


def _parse_post(context: AppContext, service: Service, body: bytes) -> DecisionRequest | Response:
    """The decision in ``body``, or the 413 or 422 refusing it.

    A body holding over ``max_body_values`` values and containers (a byte scan,
    about 1 ms per MB) is refused before it is parsed: parsing builds every
    value (500,000 nested arrays took half a second of the event loop).
    """
    settings = context.settings
    if len(body) > settings.max_body_values:  # a shorter one cannot hold more items
        items = count_items(body)
        if items > settings.max_body_values:
            return _too_many_values(items, settings.max_body_values)
    try:
        decision = DecisionRequest.parse(body, exact_numbers=not settings.lossy_numbers)
    except InvalidRequestError as error:
        return response_for_error(error, service.error_context(), default="invalid_request")
    decision.decision_json()  # its encoding (kept) is the rest of a costly body's cost
    return decision


async def answer_post(
    context: AppContext,
    service: Service,
    decision: DecisionRequest,
    prefer: list[str] | None,
    started: float,
) -> Response:
    """``POST /v1/decisions`` once its decision is read (:func:`read_decision`):
    ``prefer`` holds every ``Prefer`` value (None without one), ``started`` is when
    the request began (``perf_counter``)."""
    wait_s = None if prefer is None else _wait_preference(prefer)
    size = len(decision.decision_json())
    if size > RESULT_RECEIPT_MAX_BYTES:
        # A client error: answered here so it never counts as a failure.
        too_large = DecisionTooLargeError(decision.decision_id, size, RESULT_RECEIPT_MAX_BYTES)
        response: Response = response_for_error(
            too_large, service.error_context(), default="decision_too_large"
        )
        fate, attempt = "decision_too_large", None
    else:
        response, fate, attempt = await _dispatch(service, decision, wait_s)
    if wait_s is not None:
        response.headers["Preference-Applied"] = f"wait={wait_s}"
    elapsed = time.perf_counter() - started
    context.metrics.observe_dispatch(fate, elapsed)
    service.recent.appendleft(
        RecentDecision(
            at_ms=time.time_ns() // 1_000_000,
            decision_id=decision.decision_id,
            run_id=decision.run_id,
            fate=fate,
            status=response.status_code,
            attempt=attempt,
            duration_ms=elapsed * 1000,
        )
    )
    return response


def _too_many_values(items: int, limit: int) -> Response:
    """413 ``too_many_values``: a body whose parse would cost the event loop too much
    (parsing builds every value: 500,000 nested arrays took 0.5 s of the loop)."""
    return error_response(
        413,
        "too_many_values",
        f"the body holds about {items} JSON values and containers, over the limit of "
        f"{limit} (max_body_values)",
        limit_values=limit,
    )


async def _dispatch(
    service: Service, decision: DecisionRequest, wait_s: int | None
) -> tuple[Response, str, int | None]:
    if service.closed:
        # Shutting down: the ledger and sink are about to close under us.
        return static_error("shutting_down"), "shutting_down", None
    dispatcher = service.dispatcher
    # Dispatched in this request's own task (no second task to make, track and
    # wait on), tracked by the service while it runs: the shutdown grace period
    # waits for it, and at its end cancels it, which is answered 503 here.
    task = asyncio.current_task()
    assert task is not None
    tracked = service.tasks
    tracked.add(task)
    try:
        outcome = await (
            dispatcher.dispatch_until_done(decision, deadline_s=wait_s, retry_failures=False)
            if wait_s is not None
            else dispatcher.dispatch(decision)
        )
    except asyncio.CancelledError:
        if not service.closed or task.uncancel() > 0:
            raise  # not (only) the end of the grace period: the boundary answers 503
        return static_error("shutting_down"), "shutting_down", None
    except DispatchError as error:
        code = error_code_for(error)
        _log_failure(error, code, decision.decision_id)
        return response_for_error(error, service.error_context()), code, None
    finally:
        tracked.discard(task)
    if outcome.held:
        service.announce_hold(decision, outcome.hold_expires_at_ms)
        return _Encoded(outcome.to_json(), 202), outcome.outcome, outcome.attempt
    status = 201 if outcome.submitted else 200
    return _Encoded(outcome.to_json(), status), outcome.outcome, outcome.attempt


# -- reads ------------------------------------------------------------------------


#: How often a waiting ``GET /v1/decisions/{id}?wait=N`` reads the decision again
#: (an approval may come from another process: a CLI, another replica).
DECISION_WAIT_POLL_S = 0.1


async def get_decision(request: Request) -> Response:
    """The claim record of one decision, by id alone (never the owner).

    ``wait=N`` (seconds, at most :data:`MAX_WAIT_S`): while the decision is
    ``held``, answer only once it leaves that state or ``N`` seconds pass (a
    long-poll: the client's ``wait``), then its state as it is.
    """
    context, service = _context(request)
    decision_id = request.path_params["decision_id"]
    try:
        wait_s = _int_param(request, "wait", 0, 0, MAX_WAIT_S)
    except BadParamError as bad:
        return bad_param(bad)
    if wait_s and not context.streams.enter():
        return context.streams.refusal()
    try:
        return await _decision_answer(service, decision_id, wait_s)
    finally:
        if wait_s:
            context.streams.leave()


async def _decision_answer(service: Service, decision_id: str, wait_s: int) -> Response:
    loop = asyncio.get_running_loop()
    until = loop.time() + wait_s
    try:
        entry = await service.ledger.lookup(decision_id)
        while (
            entry is not None
            and isinstance(entry.state, Held)
            and loop.time() < until
            and not service.closing.is_set()
        ):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(service.closing.wait(), DECISION_WAIT_POLL_S)
            entry = await service.ledger.lookup(decision_id)
    except LedgerError as error:
        code = error_code_for(error)
        if code in OUTAGE_CODES:
            service.dispatcher.ledger_outage.failed(code, describe_cause(error))
        _log_failure(error, code, decision_id)
        return response_for_error(error, service.error_context())
    if entry is None:
        return error_response(
            404, "not_found", f"no claim for decision `{decision_id}`", decision_id=decision_id
        )
    return JSONResponse(entry.to_dict())


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = one_param(request.query_params, name, empty_ok=True)
    return default if raw is None else bounded_int(name, raw, low, high)


async def get_outbox(request: Request) -> Response:
    """Accepted decisions in commit order, for a workflow engine to pull (outbox sinks)."""
    context, service = _context(request)
    fetch = getattr(service.sink, "fetch", None)
    if fetch is None:
        return error_response(
            404,
            "no_outbox",
            # No sink URL here: it may name an internal host.
            "the configured sink is not an outbox; "
            "use a sqlite:/// or postgresql:// sink to pull decisions",
        )
    stream = _wants_event_stream(request.headers)
    try:
        after = _int_param(request, "after", 0, 0, I64_MAX)
        limit = _int_param(request, "limit", 100, 1, OUTBOX_MAX_LIMIT)
        wait_s = _int_param(request, "wait", 0, 0, MAX_WAIT_S)
        resume = _last_event_id(request.scope, after)  # checked even where unused
        if stream:
            after = resume
    except BadParamError as bad:
        return bad_param(bad)
    gate = context.streams
    if (stream or wait_s) and not gate.enter():
        return gate.refusal()
    if stream:
        return _GatedStream(
            gate,
            _event_stream(service, fetch, after, limit),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
    try:
        rows, has_more = await _rows_within(
            service, fetch, after, limit, wait_s, OUTBOX_PAGE_MAX_BYTES
        )
    except Exception as error:
        log.warning("outbox read failed", extra={"cause": describe_cause(error)})
        return error_response(
            503, "outbox_unavailable", "the outbox is unavailable", headers={"Retry-After": "1"}
        )
    finally:
        if wait_s:
            gate.leave()
    next_after = rows[-1][0] if rows else after
    body = b'{"entries":[%s],"next_after":%d,"has_more":%s}' % (
        b",".join(text for _seq, text in rows),
        next_after,
        b"true" if has_more else b"false",
    )
    return Response(body, media_type="application/json")


#: Bytes of rows one outbox page (or one read of an event stream) holds, at most; a
#: row larger than that still comes alone. It bounds what a reader that stops reading
#: pins in memory: 1,000 rows of 400 KB were 400 MB per page.
OUTBOX_PAGE_MAX_BYTES = 1024 * 1024
#: Rows asked of the outbox by a page's first read, before their size is known: one, so
#: that no more than a row is read beyond the budget (the next read is sized from it).
_FIRST_READ_ROWS = 1


async def _rows_within(
    service: Service,
    fetch: Callable[..., Awaitable[list[Any]]],
    after: int,
    limit: int,
    wait_s: int,
    budget: int,
) -> tuple[list[tuple[int, bytes]], bool]:
    """The rows after ``after`` as (seq, JSON), at most ``limit`` and ``budget`` bytes
    (at least one row), and whether more follow.

    Read a few rows at a time, each read sized from the rows seen so far, so a
    page of large rows is never read whole before it is cut. Only the first read
    waits (``wait_s``, a long-poll); shutdown ends it with what it has.
    """
    rows: list[tuple[int, bytes]] = []
    size = 0
    ask = min(limit + 1, _FIRST_READ_ROWS)
    wait = wait_s
    while True:
        entries = await _until_closing(service, fetch(after=after, limit=ask, wait_s=wait))
        wait = 0
        for entry in entries:
            # The entry's own JSON (OutboxEntry.to_json: the stored request bytes verbatim).
            text: bytes = entry.to_json()
            if len(rows) == limit or (rows and size + len(text) > budget):
                return rows, True
            rows.append((entry.seq, text))
            size += len(text)
        if len(entries) < ask:
            return rows, False
        after = entries[-1].seq
        room = (budget - size) // max(size // len(rows), 1) + 1
        ask = max(1, min(limit + 1 - len(rows), room))


class _GatedStream(StreamingResponse):
    """An event stream counted in the :class:`StreamGate` until it ends, however it ends."""

    def __init__(self, gate: StreamGate, content: AsyncIterator[bytes], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gate.leave()


def _wants_event_stream(headers: Headers) -> bool:
    return any(
        part.split(";", 1)[0].strip().lower() == "text/event-stream"
        for value in headers.getlist("accept")
        for part in value.split(",")
    )


def _last_event_id(scope: Scope, after: int) -> int:
    """Where a reconnecting event stream resumes: ``Last-Event-ID`` (a seq) over ``after``."""
    raw = one_header(scope, "Last-Event-ID")
    if raw is None or raw.strip() == "":
        return after
    return bounded_int("Last-Event-ID", raw.strip(), 0, I64_MAX, where="header")


async def _until_closing(service: Service, work: Awaitable[list[Any]]) -> list[Any]:
    """``await work``, or [] as soon as shutdown begins (a long-poll must not hold it up)."""
    task = asyncio.ensure_future(work)
    if service.closing.is_set():
        task.cancel()
        return []
    closing = asyncio.ensure_future(service.closing.wait())
    try:
        await asyncio.wait({task, closing}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        closing.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return []
    return task.result()


#: An idle event stream sends a comment this often (proxies close silent connections).
EVENT_STREAM_KEEPALIVE_S = 15


async def _event_stream(
    service: Service, fetch: Callable[..., Awaitable[list[Any]]], after: int, limit: int
) -> AsyncIterator[bytes]:
    """``GET /v1/outbox`` as server-sent events: one ``decision`` event per row, its
    ``id`` the row's seq (a reconnecting client sends it back as ``Last-Event-ID``)."""
    yield b"retry: 1000\n\n"
    while not service.closing.is_set():
        try:
            # A byte budget, as a page's: what a client that stops reading pins. Each
            # event is written when the client has taken the one before (the server
            # waits for the socket to drain; the edge's write timeout ends a stuck one).
            rows, _more = await _rows_within(
                service, fetch, after, limit, EVENT_STREAM_KEEPALIVE_S, OUTBOX_PAGE_MAX_BYTES
            )
        except Exception as error:
            log.warning("outbox read failed", extra={"cause": describe_cause(error)})
            yield b'event: error\ndata: {"code":"outbox_unavailable"}\n\n'
            return  # the client reconnects after `retry`, from its Last-Event-ID
        if not rows:
            yield b": keep-alive\n\n"
            continue
        for seq, text in rows:
            yield b"id: %d\nevent: decision\ndata: %s\n\n" % (seq, text)
        after = rows[-1][0]
        del rows  # not held while the next read waits


# -- operations -------------------------------------------------------------------


async def healthz(request: Request) -> Response:
    """The service's health: 200 healthy, 503 degraded (see docs/SERVICE.md)."""
    _ctx, service = _context(request)
    health = await service.check_health()
    return JSONResponse(health.to_dict(), 200 if health.healthy else 503)


async def metrics_endpoint(request: Request) -> Response:
    """Prometheus exposition."""
    context: AppContext = request.app.state.context
    if context.service is not None:
        await context.service.refresh_cursors()  # the relays' lag, read once a second at most
        await context.service.refresh_holds()  # the held decisions, likewise
    return Response(context.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def status_page(request: Request) -> Response:
    """The HTML status page."""
    context, service = _context(request)
    health = await service.check_health()
    relays = await service.refresh_cursors()
    snapshot = replace(
        health.snapshot,
        status=HealthStatus.HEALTHY if health.healthy else HealthStatus.DEGRADED,
    )
    html = render_status_page(
        attention=await _attention(service),
        actions=await recent_actions(service),
        holds=await read_holds(service.ledger) if service.ledger.holds_supported else None,
        now_ms=service.ledger.now_ms(),
        finder=await status_finder(service, request),
        health=snapshot,
        recent=list(service.recent),
        ledger=context.ledger_shown,
        sink=context.sink_shown,
        production_branch=context.settings.production_branch,
        started_at_ms=service.started_at_ms,
        refresh_s=context.settings.status_refresh_s,
        relays=relays,
        own_relay=service.relay_status(),
        parked=await service.parked_rows(),
    )
    return HTMLResponse(html, headers={"Cache-Control": "no-store"})


async def _attention(service: Service) -> Attention:
    """What the status page's "needs attention" shows (one indexed query, a count)."""
    failures = [item for item in service.recent if item.fate in ATTENTION_FATES][:20]
    query = DecisionQuery(state=DecisionState.PENDING_EXPIRED, limit=20)
    try:
        page = await service.ledger.list_decisions(query)
        count = await service.ledger.count_decisions(query)
    except LedgerError as error:
        return Attention((), None, failures, error=error_code_for(error))
    return Attention(page.decisions, count, failures)


def routes() -> list[Route]:
    """Every endpoint of the service."""
    return [
        Route("/", status_page, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *operation_routes(),
        Route("/v1/decisions", post_decision, methods=["POST"]),
        Route("/v1/decisions", list_decisions, methods=["GET"]),
        Route("/v1/decisions/{decision_id:path}", get_decision, methods=["GET"]),
        Route("/v1/outbox", get_outbox, methods=["GET"]),
    ]

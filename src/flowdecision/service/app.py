"""The decision service: a Starlette app around one :class:`Dispatcher`.

``create_app(settings)`` returns the ASGI app. Its lifespan opens the ledger
and the sink the settings name (unless a started :class:`Service` is handed
in), and on shutdown waits up to ``shutdown_grace_s`` for in-flight dispatches
before closing them. Dispatches run in their own tasks, shielded from the
request: a client that hangs up does not cancel a submission half-way.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import contextvars
import hmac
import json
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..dispatcher import Dispatcher
from ..errors import (
    DecisionBusyError,
    DecisionConflictError,
    DispatchError,
    InvalidIdentifierError,
    InvalidIdentityError,
    LeaseLostError,
    LedgerError,
    SinkError,
    UnauthorizedBranchError,
)
from ..health import HealthSnapshot
from ..identity import DecisionTooLargeError, decision_receipt
from ..ledger.base import Ledger, LedgerEntry
from ..ledger.states import Completed, Pending
from ..ledger.url import open_ledger
from ..limits import I64_MAX, RESULT_RECEIPT_MAX_BYTES
from ..model import DecisionRequest, InvalidRequestError
from ..sinks.base import Sink
from ..sinks.loader import WebhookOptions, close_sink, open_sink
from .config import Settings, redact_url
from .errors import error_response, http_exception_handler, unhandled_exception_handler
from .logs import AccessLogMiddleware
from .metrics import CONTENT_TYPE_LATEST, ServiceMetrics
from .status import RecentDecision, render_status_page

__all__ = ["Service", "create_app"]

log = logging.getLogger("flowdecision.service")

#: Where the attempt-recording sink wrapper reports the attempt of the current dispatch.
_attempt_slot: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "flowdecision_attempt_slot", default=None
)

OUTBOX_MAX_LIMIT = 1000


class _AttemptRecorder:
    """Wraps the configured sink to learn the attempt number of each dispatch."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        slot = _attempt_slot.get()
        if slot is not None:
            slot.append(attempt)
        await self.inner.submit(request, attempt)


class Service:
    """The running parts: ledger, sink, dispatcher, recent decisions and in-flight tasks."""

    def __init__(self, settings: Settings, ledger: Ledger, sink: Sink) -> None:
        self.settings = settings
        self.ledger = ledger
        self.sink = sink
        self.dispatcher = Dispatcher(
            settings.production_branch,
            _AttemptRecorder(sink),
            ledger,
            lease_ms=settings.lease_ms,
        )
        self.recent: deque[RecentDecision] = deque(maxlen=settings.recent_limit)
        self.tasks: set[asyncio.Task[bool]] = set()
        self.started_at_ms = time.time_ns() // 1_000_000
        self.closed = False

    @classmethod
    async def start(cls, settings: Settings) -> Service:
        """Open the ledger and the sink the settings name."""
        ledger = await open_ledger(settings.ledger)
        try:
            sink = await open_sink(
                settings.sink,
                webhook=WebhookOptions(
                    timeout_s=settings.webhook_timeout_s,
                    max_attempts=settings.webhook_max_attempts,
                    token=settings.webhook_token,
                ),
            )
        except BaseException:
            await ledger.close()
            raise
        return cls(settings, ledger, sink)

    def health(self) -> HealthSnapshot:
        return self.dispatcher.health()

    def track(self, task: asyncio.Task[bool]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[bool]) -> None:
        self.tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an orphaned failure is in the metrics already

    async def stop(self, grace_s: float) -> None:
        """Let in-flight dispatches finish (up to ``grace_s``), then close everything."""
        if self.closed:
            return
        self.closed = True
        pending = set(self.tasks)
        if pending:
            log.info("waiting for in-flight dispatches", extra={"in_flight": len(pending)})
            _done, late = await asyncio.wait(pending, timeout=grace_s)
            if late:
                log.warning(
                    "grace period over, cancelling dispatches (their leases will expire)",
                    extra={"cancelled": len(late)},
                )
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
        try:
            await close_sink(self.sink)
        finally:
            await self.ledger.close()


# -- auth ------------------------------------------------------------------------


def _token_matches(presented: bytes, tokens: Sequence[bytes]) -> bool:
    matched = False
    for token in tokens:  # every token is compared: no early exit
        matched |= hmac.compare_digest(presented, token)
    return matched


def _presented_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, credentials = value.partition(b" ")
            scheme = scheme.lower()
            if scheme == b"bearer":
                return bytes(credentials.strip())
            if scheme == b"basic":  # browsers: any user name, the token as password
                try:
                    decoded = base64.b64decode(credentials.strip(), validate=True)
                except (binascii.Error, ValueError):
                    return None
                return bytes(decoded.partition(b":")[2])
            return None
    return None


class AuthMiddleware:
    """Bearer-token auth (constant-time) for every path except the public ones."""

    def __init__(self, app: ASGIApp, *, tokens: Sequence[bytes], public: frozenset[str]) -> None:
        self.app = app
        self.tokens = tuple(tokens)
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.tokens or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        presented = _presented_token(scope)
        if presented is not None and _token_matches(presented, self.tokens):
            await self.app(scope, receive, send)
            return
        response = error_response(
            401,
            "unauthorized",
            "missing or invalid bearer token" if presented is None else "invalid token",
        )
        response.raw_headers.append((b"www-authenticate", b'Bearer realm="flowdecision"'))
        response.raw_headers.append((b"www-authenticate", b'Basic realm="flowdecision"'))
        await response(scope, receive, send)


# -- helpers ------------------------------------------------------------------------


class _TooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(data, status_code=status, headers=headers)


def _entry_body(entry: LedgerEntry) -> dict[str, Any]:
    state = entry.state
    body: dict[str, Any] = {
        "decision_id": entry.decision_id,
        "state": state.kind,
        "attempts": entry.attempts,
        "request_hash": entry.request_hash,
    }
    if isinstance(state, Pending):
        body["lease_expires_at_ms"] = state.lease_expires_at_ms
    if isinstance(state, Completed):
        body["completed_at_ms"] = state.completed_at_ms
    body["execution_identity"] = (
        entry.execution_identity.to_dict() if entry.execution_identity else None
    )
    body["receipt"] = entry.result_receipt.to_dict() if entry.result_receipt else None
    return body


def _invalid_field(field: str, problem: str, message: str | None = None) -> Response:
    """422 ``invalid_request`` naming ``field`` (a dotted path) and its ``problem``."""
    return error_response(
        422,
        "invalid_request",
        message or f"invalid decision request: field `{field}`: {problem}",
        field=field,
        problem=problem,
        fields=[{"field": field, "problem": problem}],
    )


def _too_large(error: DecisionTooLargeError) -> Response:
    return error_response(
        413,
        "decision_too_large",
        str(error),
        size_bytes=error.size,
        limit_bytes=error.limit,
    )


def _service(request: Request) -> Service:
    service: Service | None = request.app.state.service
    if service is None:  # pragma: no cover - only before startup
        raise HTTPException(503, "service is starting")
    return service


# -- the app ------------------------------------------------------------------------


def create_app(settings: Settings, *, service: Service | None = None) -> Starlette:
    """The ASGI app. With ``service`` the app uses (and on shutdown closes) it."""
    holder: dict[str, Service | None] = {"service": service}

    def snapshot() -> HealthSnapshot | None:
        current = holder["service"]
        return current.health() if current is not None else None

    metrics = ServiceMetrics(snapshot)
    ledger_shown = redact_url(settings.ledger)
    sink_shown = redact_url(settings.sink)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        current = holder["service"]
        if current is None:
            current = holder["service"] = await Service.start(settings)
        app.state.service = current
        log.info(
            "service started",
            extra={
                "ledger": ledger_shown,
                "sink": sink_shown,
                "branch": settings.production_branch,
            },
        )
        try:
            yield
        finally:
            await current.stop(settings.shutdown_grace_s)
            log.info("service stopped")

    async def post_decision(request: Request) -> Response:
        service = _service(request)
        started = time.perf_counter()
        try:
            body = await _read_body(request, settings.max_body_bytes)
        except _TooLarge:
            return error_response(
                413,
                "payload_too_large",
                f"request body exceeds {settings.max_body_bytes} bytes",
                limit_bytes=settings.max_body_bytes,
            )
        try:
            decision = DecisionRequest.parse(body, exact_numbers=not settings.lossy_numbers)
        except InvalidRequestError as error:
            return _invalid_field(error.field, error.problem, str(error))
        if len(decision.decision_json()) > RESULT_RECEIPT_MAX_BYTES:
            # A client error: answered here so it does not count as a ledger failure.
            too_large = DecisionTooLargeError(decision.decision_id, len(decision.decision_json()))
            response: Response = _too_large(too_large)
            fate, attempt = "decision_too_large", None
        else:
            response, fate, attempt = await _dispatch(service, decision)
        elapsed = time.perf_counter() - started
        metrics.observe_dispatch(fate, elapsed)
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

    async def _dispatch(
        service: Service, decision: DecisionRequest
    ) -> tuple[Response, str, int | None]:
        if service.closed:
            # Shutting down: the ledger and sink are about to close under us.
            response = error_response(
                503, "shutting_down", "the service is shutting down; retry on another replica"
            )
            response.headers["Retry-After"] = "1"
            return response, "shutting_down", None
        slot: list[int] = []
        reset = _attempt_slot.set(slot)
        try:
            task = asyncio.ensure_future(service.dispatcher.dispatch(decision))
        finally:
            _attempt_slot.reset(reset)
        service.track(task)
        try:
            submitted = await asyncio.shield(task)
        except DispatchError as error:
            return (
                _dispatch_error(service, decision, error),
                _fate(error),
                slot[-1] if slot else None,
            )
        decision_id = decision.decision_id
        if submitted:
            _identity, receipt = decision_receipt(decision)
            attempt = slot[-1] if slot else None
            body = {
                "outcome": "submitted",
                "decision_id": decision_id,
                "attempt": attempt,
                "receipt": receipt.to_dict(),
            }
            return _json(body, 201), "submitted", attempt
        try:
            entry = await service.ledger.lookup(decision_id)
        except LedgerError as error:
            return (
                error_response(503, "ledger_unavailable", f"Flow decision ledger failed: {error}"),
                "ledger_unavailable",
                None,
            )
        attempts = entry.attempts if entry else None
        body = {
            "outcome": "duplicate",
            "decision_id": decision_id,
            "attempt": attempts,
            "receipt": entry.result_receipt.to_dict() if entry and entry.result_receipt else None,
        }
        return _json(body, 200), "duplicate", attempts

    def _fate(error: DispatchError) -> str:
        if isinstance(error, DecisionBusyError):
            return "busy"
        if isinstance(error, DecisionConflictError):
            return "conflict"
        if isinstance(error, UnauthorizedBranchError):
            return "forbidden_branch"
        if isinstance(error, InvalidIdentityError | InvalidIdentifierError):
            return "invalid_request"
        if isinstance(error, DecisionTooLargeError):
            return "decision_too_large"
        if isinstance(error, SinkError):
            return "sink_failed"
        if isinstance(error, LeaseLostError):
            return "lease_lost"
        return "ledger_unavailable"

    def _dispatch_error(
        service: Service, decision: DecisionRequest, error: DispatchError
    ) -> Response:
        message = str(error)
        if isinstance(error, DecisionBusyError):
            remaining_ms = error.lease_expires_at_ms - service.ledger.now_ms()
            retry_after = max(1, math.ceil(remaining_ms / 1000))
            return error_response(
                409,
                "busy",
                message,
                headers={"Retry-After": str(retry_after)},
                lease_expires_at_ms=error.lease_expires_at_ms,
                retry_after_s=retry_after,
            )
        if isinstance(error, DecisionConflictError):
            return error_response(409, "conflict", message, decision_id=error.decision_id)
        if isinstance(error, UnauthorizedBranchError):
            return error_response(
                403,
                "forbidden_branch",
                message,
                expected_branch=error.expected,
                branch=error.actual,
            )
        if isinstance(error, InvalidIdentityError):
            name = "decision_id" if not decision.decision_id.strip() else "causation_event_id"
            return _invalid_field(name, "must be non-empty (after trimming whitespace)")
        if isinstance(error, InvalidIdentifierError):
            return _invalid_field(error.field, error.problem)
        if isinstance(error, DecisionTooLargeError):
            return _too_large(error)
        if isinstance(error, SinkError):
            return error_response(502, "sink_failed", message)
        if isinstance(error, LeaseLostError):
            return error_response(503, "lease_lost", message, headers={"Retry-After": "1"})
        return error_response(503, "ledger_unavailable", message, headers={"Retry-After": "1"})

    async def get_decision(request: Request) -> Response:
        service = _service(request)
        decision_id = request.path_params["decision_id"]
        try:
            entry = await service.ledger.lookup(decision_id)
        except InvalidIdentifierError as error:  # before LedgerError: the caller's mistake
            return _invalid_field(error.field, error.problem)
        except LedgerError as error:
            return error_response(
                503, "ledger_unavailable", f"Flow decision ledger failed: {error}"
            )
        if entry is None:
            return error_response(
                404, "not_found", f"no claim for decision `{decision_id}`", decision_id=decision_id
            )
        return _json(_entry_body(entry))

    async def healthz(request: Request) -> Response:
        health = _service(request).health()
        return _json(health.to_dict(), 200 if health.status.value == "healthy" else 503)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def status_page(request: Request) -> Response:
        service = _service(request)
        html = render_status_page(
            health=service.health(),
            recent=list(service.recent),
            ledger=ledger_shown,
            sink=sink_shown,
            production_branch=settings.production_branch,
            started_at_ms=service.started_at_ms,
            refresh_s=settings.status_refresh_s,
        )
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
        raw = request.query_params.get(name)
        if raw is None or raw == "":
            return default
        if not raw.isdigit() or not low <= int(raw) <= high:
            raise _BadParam(name, f"must be an integer in {low}..{high}, got `{raw[:40]}`")
        return int(raw)

    async def get_outbox(request: Request) -> Response:
        service = _service(request)
        fetch = getattr(service.sink, "fetch", None)
        if fetch is None:
            return error_response(
                404,
                "no_outbox",
                f"the configured sink ({sink_shown}) is not an outbox; "
                "use a sqlite:/// or postgresql:// sink to pull decisions",
            )
        try:
            after = _int_param(request, "after", 0, 0, I64_MAX)
            limit = _int_param(request, "limit", 100, 1, OUTBOX_MAX_LIMIT)
        except _BadParam as bad:
            return error_response(
                422, "invalid_parameter", f"query parameter `{bad.name}` {bad.problem}",
                field=bad.name, problem=bad.problem,
            )  # fmt: skip
        try:
            entries = await fetch(after=after, limit=limit + 1)
        except Exception as error:
            log.warning("outbox read failed", extra={"error": str(error)})
            return error_response(503, "outbox_unavailable", f"outbox read failed: {error}")
        has_more = len(entries) > limit
        entries = entries[:limit]
        # The stored request bytes are embedded verbatim (they are the exact wire JSON).
        items = [
            b'{"seq":%d,"decision_id":%s,"request_hash":%s,"first_attempt":%d,'
            b'"highest_attempt":%d,"accepted_at_ms":%d,"request":%s}'
            % (
                entry.seq,
                json.dumps(entry.decision_id).encode(),
                json.dumps(entry.request_hash).encode(),
                entry.first_attempt,
                entry.highest_attempt,
                entry.accepted_at_ms,
                entry.request_json,
            )
            for entry in entries
        ]
        next_after = entries[-1].seq if entries else after
        body = b'{"entries":[%s],"next_after":%d,"has_more":%s}' % (
            b",".join(items),
            next_after,
            b"true" if has_more else b"false",
        )
        return Response(body, media_type="application/json")

    routes = [
        Route("/", status_page, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/decisions", post_decision, methods=["POST"]),
        Route("/v1/decisions/{decision_id:path}", get_decision, methods=["GET"]),
        Route("/v1/outbox", get_outbox, methods=["GET"]),
    ]
    public = frozenset() if settings.auth_healthz else frozenset({"/healthz"})
    middleware = [
        Middleware(
            AccessLogMiddleware,
            enabled=settings.access_log,
            on_response=metrics.count_request,
        ),
        Middleware(AuthMiddleware, tokens=settings.tokens(), public=public),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            HTTPException: http_exception_handler,
            Exception: unhandled_exception_handler,
        },
    )
    app.state.service = service
    app.state.settings = settings
    app.state.metrics = metrics
    return app


class _BadParam(Exception):
    def __init__(self, name: str, problem: str) -> None:
        super().__init__(name, problem)
        self.name = name
        self.problem = problem

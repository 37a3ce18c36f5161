"""Errors to clients: one JSON shape, and one table from error code to HTTP answer.

Every error response is ``{"error": {"code", "message", "request_id", ...}}``
with an ``X-Request-Id`` header carrying the same id. :data:`HTTP_ERRORS` maps
each :attr:`~flowdecision.errors.FlowDecisionError.code` to its status, the
message a client sees and its ``Retry-After`` policy; it is the only place the
service classifies an exception (looked up with :func:`flowdecision.errors.classify`).

What reaches a client is chosen, never passed through: errors about the
client's own request (403, 409, 413, 422) say what is wrong with it; failures
of the service's parts (5xx) get a fixed, generic message. Their detail (sink
exception text, file paths, database hosts, driver exception names) goes to
the log, under the same request id.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from starlette.responses import JSONResponse

from ..core.bodies import (
    BranchDetails,
    BusyDetails,
    ConflictDetails,
    FieldDetails,
    LimitDetails,
    NotFoundDetails,
    ParameterDetails,
    RejectedDetails,
    RunClosedDetails,
    TooLargeDetails,
    ValuesLimitDetails,
)
from ..errors import classified_code
from .logs import current_request_id

__all__ = [
    "HTTP_ERRORS",
    "INTERNAL",
    "SERVICE_ERRORS",
    "ErrorContext",
    "HttpAnswer",
    "RetryAfter",
    "ServiceCode",
    "busy_retry_after_s",
    "error_code_for",
    "error_response",
    "http_error",
    "response_for_error",
    "static_error",
]

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}


class RetryAfter(Enum):
    """Whether an error response carries ``Retry-After``, and how it is computed."""

    NEVER = "never"  # retrying the same request cannot help (or needs an operator)
    SOON = "soon"  # a transient failure: ``Retry-After: 1``
    HEARTBEAT = "heartbeat"  # busy: until the lease expires, at most one heartbeat period


@dataclass(frozen=True, slots=True)
class ErrorContext:
    """What the table needs besides the error: the ledger's clock and the heartbeat."""

    now_ms: int
    heartbeat_ms: int


#: Builds the extra members of ``error``; its return annotation (a TypedDict in
#: :mod:`flowdecision.core.bodies`) is what the OpenAPI contract declares for the code.
Details = Callable[[Any, ErrorContext], Any]


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    """How one library error code is answered over HTTP (a row of :data:`HTTP_ERRORS`).

    A table row, not an exception (it was named ``HttpError``; that name stays
    importable from here).

    ``message`` None means the error's own text, which describes the caller's
    request; a string is the fixed, generic text for a failure of the service.
    ``details`` adds members to the ``error`` object.
    """

    status: int
    message: str | None
    retry_after: RetryAfter = RetryAfter.NEVER
    details: Details | None = None


def _fields(error: Any, _ctx: ErrorContext) -> FieldDetails:
    field, problem = error.field, error.problem
    return {"field": field, "problem": problem, "fields": [{"field": field, "problem": problem}]}


def busy_retry_after_s(lease_expires_at_ms: int, ctx: ErrorContext) -> int:
    """Seconds until a busy decision is worth asking about again.

    The owner's lease expiry is an upper bound; the owner may well finish
    sooner, so the wait is capped at one heartbeat period (a third of the lease).
    """
    remaining = math.ceil(max(lease_expires_at_ms - ctx.now_ms, 0) / 1000)
    return max(1, min(remaining, math.ceil(ctx.heartbeat_ms / 1000)))


def _busy(error: Any, ctx: ErrorContext) -> BusyDetails:
    return {
        "lease_expires_at_ms": error.lease_expires_at_ms,
        "retry_after_s": busy_retry_after_s(error.lease_expires_at_ms, ctx),
    }


def _too_large(error: Any, _ctx: ErrorContext) -> TooLargeDetails:
    return {"size_bytes": error.size, "limit_bytes": error.limit}


def _branch(error: Any, _ctx: ErrorContext) -> BranchDetails:
    return {"expected_branch": error.expected, "branch": error.actual}


def _conflict(error: Any, _ctx: ErrorContext) -> ConflictDetails:
    return {"decision_id": error.decision_id}


def _run_closed(error: Any, _ctx: ErrorContext) -> RunClosedDetails:
    return {
        "decision_id": error.decision_id,
        "run_id": error.run_id,
        "run_state": error.run_state,
        "closed_by": error.closed_by,
        "closed_at_ms": error.closed_at_ms,
    }


def _rejected(error: Any, _ctx: ErrorContext) -> RejectedDetails:
    return {"decision_id": error.decision_id, "rejected_at_ms": error.rejected_at_ms}


#: Error code -> HTTP answer. The codes are the error classes' ``code`` (see
#: ``flowdecision/errors.py``); docs/SERVICE.md lists the same table.
HTTP_ERRORS: dict[str, HttpAnswer] = {
    # The caller's request: the message says what is wrong with it.
    "forbidden_branch": HttpAnswer(403, None, details=_branch),
    "conflict": HttpAnswer(409, None, details=_conflict),
    "busy": HttpAnswer(409, None, RetryAfter.HEARTBEAT, _busy),
    # The run is over (or, for a terminal decision, has its terminal one): permanent.
    "run_closed": HttpAnswer(409, None, details=_run_closed),
    # Held for approval and rejected (or its hold expired): permanent.
    "decision_rejected": HttpAnswer(409, None, details=_rejected),
    "decision_too_large": HttpAnswer(413, None, details=_too_large),
    "invalid_request": HttpAnswer(422, None, details=_fields),
    "invalid_identifier": HttpAnswer(422, None, details=_fields),
    # The service's parts: a generic message; the cause goes to the log.
    # Permanent: the sink holds other content under this id (the ledger did not).
    "sink_conflict": HttpAnswer(409, None, details=_conflict),
    "sink_failed": HttpAnswer(
        502,
        "the sink did not accept the decision; the claim was released, so retrying is safe",
    ),
    "lease_lost": HttpAnswer(
        503,
        "the lease on the decision was lost while the sink ran; retrying is safe",
        RetryAfter.SOON,
    ),
    "ledger_unavailable": HttpAnswer(
        503, "the decision ledger is unavailable; retrying is safe", RetryAfter.SOON
    ),
    "store_full": HttpAnswer(
        503,
        "the decision store is out of disk space; nothing was stored, so retrying is safe "
        "once space is freed",
        RetryAfter.SOON,
    ),
    "ledger_error": HttpAnswer(
        503, "the decision ledger is unavailable; retrying is safe", RetryAfter.SOON
    ),
    "ledger_corrupt": HttpAnswer(
        503, "the decision ledger holds corrupt data; an operator must repair it"
    ),
    "ledger_schema": HttpAnswer(
        503,
        "the decision ledger's schema does not match this version of the service; "
        "an operator must migrate it",
    ),
    "store_missing": HttpAnswer(
        503, "the decision ledger does not exist; an operator must create or restore it"
    ),
    "shutting_down": HttpAnswer(
        503,
        "the service is shutting down; retry (on another replica)",
        RetryAfter.SOON,
    ),
    "internal": HttpAnswer(500, "internal server error"),
}

#: The answer to anything the table does not know.
INTERNAL = HTTP_ERRORS["internal"]


@dataclass(frozen=True, slots=True)
class ServiceCode:
    """A code the service answers itself (not a library error class): its status,
    the TypedDict of its extra members and its ``Retry-After`` policy. A row of
    :data:`SERVICE_ERRORS`.

    ``where`` names the module that sends it. tests/test_openapi.py checks that
    every ``error_response``/``edge_answer`` in the service uses a code listed
    here or in :data:`HTTP_ERRORS`, with the same status.
    """

    status: int
    where: str
    details: type | None = None
    retry_after: RetryAfter = RetryAfter.NEVER


#: Codes answered outside :data:`HTTP_ERRORS`, for the OpenAPI contract
#: (service/openapi.py) and docs/SERVICE.md.
SERVICE_ERRORS: dict[str, ServiceCode] = {
    "bad_request": ServiceCode(400, "guards"),  # and edge/base.py, for malformed HTTP
    "unauthorized": ServiceCode(401, "auth"),
    "origin_not_allowed": ServiceCode(403, "guards"),
    "not_found": ServiceCode(404, "handlers", NotFoundDetails),
    "no_outbox": ServiceCode(404, "handlers"),
    "method_not_allowed": ServiceCode(405, "errors"),
    "request_timeout": ServiceCode(408, "edge/timeouts"),
    "expectation_failed": ServiceCode(417, "guards"),
    "payload_too_large": ServiceCode(413, "handlers", LimitDetails),
    "too_many_values": ServiceCode(413, "handlers", ValuesLimitDetails),
    "unsupported_media_type": ServiceCode(415, "guards"),
    "host_not_allowed": ServiceCode(421, "guards"),
    "request_head_too_large": ServiceCode(431, "edge/timeouts"),
    "invalid_parameter": ServiceCode(422, "handlers", ParameterDetails),
    "outbox_unavailable": ServiceCode(503, "handlers", retry_after=RetryAfter.SOON),
    "too_many_streams": ServiceCode(503, "handlers", retry_after=RetryAfter.SOON),
    # Operator actions (service/operations.py): an admin token, then the action's rules.
    "admin_disabled": ServiceCode(403, "operations"),
    "forbidden": ServiceCode(403, "operations"),
    "action_refused": ServiceCode(409, "operations", NotFoundDetails),
    "invalid_action": ServiceCode(422, "operations"),
    "overloaded": ServiceCode(503, "edge/connections", retry_after=RetryAfter.SOON),
}


def error_response(
    status: int,
    code: str,
    message: str,
    *,
    headers: Mapping[str, str] | None = None,
    **details: Any,
) -> JSONResponse:
    """A JSON error response; ``details`` become extra members of ``error``.

    The current request's id (see :mod:`.logs`) is added as ``request_id``.
    """
    body: dict[str, Any] = {"code": code, "message": message}
    body.update(details)
    request_id = current_request_id()
    if request_id is not None:
        body["request_id"] = request_id
    return JSONResponse({"error": body}, status_code=status, headers=dict(headers or {}))


def error_code_for(error: BaseException, default: str = "internal") -> str:
    """The code ``error`` is answered with: its class's row in :data:`HTTP_ERRORS`.

    ``default`` is for errors whose class carries no code the table knows.
    """
    return classified_code(error, HTTP_ERRORS) or default


def response_for_error(
    error: BaseException, ctx: ErrorContext, *, default: str = "internal"
) -> JSONResponse:
    """The HTTP answer to ``error``, from its row in :data:`HTTP_ERRORS`."""
    code = error_code_for(error, default)
    row = HTTP_ERRORS[code]
    details = row.details(error, ctx) if row.details is not None else {}
    headers: dict[str, str] = {}
    if row.retry_after is RetryAfter.SOON:
        headers["Retry-After"] = "1"
    elif row.retry_after is RetryAfter.HEARTBEAT:
        headers["Retry-After"] = str(details.get("retry_after_s", 1))
    message = row.message if row.message is not None else str(error)
    return error_response(row.status, code, message, headers=headers, **details)


def static_error(code: str) -> JSONResponse:
    """The answer for a service-level code in :data:`HTTP_ERRORS` (e.g. ``shutting_down``)."""
    row = HTTP_ERRORS[code]
    headers = {"Retry-After": "1"} if row.retry_after is RetryAfter.SOON else {}
    return error_response(row.status, code, row.message or code, headers=headers)


def http_error(
    status: int, detail: str = "", *, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """The answer to an HTTP-level refusal (no route, a method a route does not take,
    an ``HTTPException``): its code from the status, ``detail`` as its message."""
    code = _HTTP_CODES.get(status, f"http_{status}")
    return error_response(status, code, detail or code.replace("_", " "), headers=headers)

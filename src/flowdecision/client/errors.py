"""The client's errors: one per error answer of the service, plus transport failures.

Each error answer becomes a subclass of the exception the library would raise
for the same thing *and* of :class:`ServiceError` (see the table in
:mod:`flowdecision.client`). :func:`error_from_response` picks the class from
``error.code``; :class:`ErrorAnswer` is the answer as received.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..connections.backoff import parse_retry_after
from ..connections.transport import ResponseLike
from ..errors import (
    DecisionBusyError,
    DecisionConflictError,
    DecisionRejectedError,
    DispatchLedgerError,
    FlowDecisionError,
    LeaseLostError,
    RunClosedError,
    SinkError,
    UnauthorizedBranchError,
)

__all__ = [
    "PERMANENT_CODES",
    "ErrorAnswer",
    "ServiceAuthError",
    "ServiceBranchError",
    "ServiceBusyError",
    "ServiceConflictError",
    "ServiceConnectionError",
    "ServiceDecisionRejectedError",
    "ServiceError",
    "ServiceInvalidRequestError",
    "ServiceLeaseLostError",
    "ServiceLedgerError",
    "ServiceRunClosedError",
    "ServiceSinkError",
    "ServiceTooLargeError",
    "ServiceUnavailableError",
    "UnexpectedResponseError",
    "connection_error",
    "error_from_response",
    "unexpected_answer",
]

#: Error codes that mean "the store needs an operator": never retried, even on 503.
PERMANENT_CODES = frozenset({"ledger_corrupt", "ledger_schema"})


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    """An error answer as received: status, ``error.code``, message and the other members."""

    status: int
    code: str
    message: str
    request_id: str | None
    details: Mapping[str, Any] = field(default_factory=dict)
    retry_after_s: float | None = None

    @property
    def retryable(self) -> bool:
        """Safe and useful to send again unchanged (see the module docstring)."""
        if self.code in PERMANENT_CODES:
            return False
        return self.code == "busy" or self.status in (429, 503)


class ServiceError(FlowDecisionError, code="service_error"):
    """The service answered with an error. Base of every error answer, known code or not."""

    def __init__(self, answer: ErrorAnswer) -> None:
        # The library bases' __init__ build their own messages from local
        # arguments; here the service's message and ids are what matter.
        Exception.__init__(self, _describe(answer))
        self.answer = answer
        #: HTTP requests made before giving up (set by the client).
        self.tries = 1

    @property
    def status(self) -> int:
        return self.answer.status

    @property
    def error_code(self) -> str:
        """``error.code`` as sent (a code this client does not know is kept as is)."""
        return self.answer.code

    @property
    def message(self) -> str:
        return self.answer.message

    @property
    def request_id(self) -> str | None:
        return self.answer.request_id

    @property
    def details(self) -> Mapping[str, Any]:
        return self.answer.details

    @property
    def retry_after_s(self) -> float | None:
        return self.answer.retry_after_s

    @property
    def retryable(self) -> bool:
        return self.answer.retryable


def _describe(answer: ErrorAnswer) -> str:
    where = f"HTTP {answer.status} {answer.code}"
    if answer.request_id:
        where += f", request {answer.request_id}"
    return f"{answer.message} ({where})"


class ServiceAuthError(ServiceError, code="unauthorized"):
    """401: the token is missing or not accepted. Never retried."""


class ServiceBranchError(UnauthorizedBranchError, ServiceError, code="forbidden_branch"):
    """403 ``forbidden_branch``: the request came from a branch other than production."""

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        self.expected = str(answer.details.get("expected_branch", ""))
        self.actual = str(answer.details.get("branch", ""))


class ServiceConflictError(DecisionConflictError, ServiceError, code="conflict"):
    """409 ``conflict`` (or ``sink_conflict``: the sink, not the ledger, holds the id
    with different content): the id is bound to other content. Never retried."""

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        self.decision_id = str(answer.details.get("decision_id", ""))


class ServiceBusyError(DecisionBusyError, ServiceError, code="busy"):
    """409 ``busy``: another replica holds a live lease (raised once retries are exhausted)."""

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        expires = answer.details.get("lease_expires_at_ms")
        self.lease_expires_at_ms = expires if isinstance(expires, int) else 0


class ServiceDecisionRejectedError(DecisionRejectedError, ServiceError, code="decision_rejected"):
    """409 ``decision_rejected``: the decision was held for approval and rejected (or its
    hold expired). Never retried: it is never sent."""

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        details = answer.details
        self.decision_id = str(details.get("decision_id", ""))
        rejected_at = details.get("rejected_at_ms")
        self.rejected_at_ms = rejected_at if isinstance(rejected_at, int) else None


class ServiceRunClosedError(RunClosedError, ServiceError, code="run_closed"):
    """409 ``run_closed``: the decision's run is closed (or, for a ``complete``/``fail``,
    already has its terminal decision). Never retried: the run takes no new decision."""

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        details = answer.details
        self.decision_id = str(details.get("decision_id", ""))
        self.run_id = str(details.get("run_id", ""))
        self.run_state = str(details.get("run_state", ""))
        self.closed_by = str(details.get("closed_by", ""))
        closed_at = details.get("closed_at_ms")
        self.closed_at_ms = closed_at if isinstance(closed_at, int) else None

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.answer,))


class ServiceInvalidRequestError(ServiceError, code="invalid_request"):
    """422: the body, an identifier or a parameter is not valid; ``field`` names it."""

    def __init__(self, answer: ErrorAnswer) -> None:
        super().__init__(answer)
        self.field = str(answer.details.get("field", ""))
        self.problem = str(answer.details.get("problem", ""))


class ServiceTooLargeError(ServiceError, code="payload_too_large"):
    """413: the body or the decision is over the service's limit (``limit_bytes``)."""

    def __init__(self, answer: ErrorAnswer) -> None:
        super().__init__(answer)
        limit = answer.details.get("limit_bytes")
        self.limit_bytes = limit if isinstance(limit, int) else None


class ServiceSinkError(SinkError, ServiceError, code="sink_failed"):
    """502 ``sink_failed``: the sink raised; the claim was released, a later retry is safe."""

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        self.detail = answer.message


class ServiceLeaseLostError(LeaseLostError, ServiceError, code="lease_lost"):
    """503 ``lease_lost``: the lease was lost while the sink ran (raised once retries are out)."""

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        self.decision_id = str(answer.details.get("decision_id", ""))


class ServiceLedgerError(DispatchLedgerError, ServiceError, code="ledger_unavailable"):
    """503 ``ledger_unavailable`` (transient), ``ledger_corrupt``/``ledger_schema`` (permanent)."""

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        self.detail = answer.message

    @property
    def permanent(self) -> bool:
        """An operator must act (corrupt data, a schema from another version)."""
        return self.error_code in PERMANENT_CODES


class ServiceUnavailableError(ServiceError, code="unavailable"):
    """503 other than a ledger failure (e.g. ``shutting_down``), or a 429 from a proxy."""


class UnexpectedResponseError(ServiceError, code="unexpected_response"):
    """The answer is not the documented shape (not JSON, a member missing or mistyped)."""


class ServiceConnectionError(FlowDecisionError, code="connection_failed"):
    """No HTTP answer: the connection failed or timed out. The transport error is ``__cause__``.

    ``request_sent`` is False when the service cannot have seen the request
    (connect failures), True when it may have (a read timeout): a decision may
    then be in, and resubmitting it tells.
    """

    def __init__(self, message: str, *, request_sent: bool, tries: int) -> None:
        super().__init__(message)
        self.request_sent = request_sent
        self.tries = tries


_ERRORS_BY_CODE: dict[str, type[ServiceError]] = {
    "unauthorized": ServiceAuthError,
    "forbidden_branch": ServiceBranchError,
    "conflict": ServiceConflictError,
    "sink_conflict": ServiceConflictError,
    "busy": ServiceBusyError,
    "run_closed": ServiceRunClosedError,
    "decision_rejected": ServiceDecisionRejectedError,
    "invalid_request": ServiceInvalidRequestError,
    "invalid_identifier": ServiceInvalidRequestError,
    "invalid_parameter": ServiceInvalidRequestError,
    "payload_too_large": ServiceTooLargeError,
    "decision_too_large": ServiceTooLargeError,
    "sink_failed": ServiceSinkError,
    "lease_lost": ServiceLeaseLostError,
    "ledger_unavailable": ServiceLedgerError,
    "ledger_corrupt": ServiceLedgerError,
    "ledger_schema": ServiceLedgerError,
    "shutting_down": ServiceUnavailableError,
}


def error_from_response(response: ResponseLike) -> ServiceError:
    """The typed error for an error answer (any status, any body)."""
    status = response.status_code
    error: Mapping[str, Any] = {}
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
    raw_code = error.get("code")
    code = raw_code if isinstance(raw_code, str) and raw_code else f"http_{status}"
    raw_message = error.get("message")
    message = raw_message if isinstance(raw_message, str) and raw_message else _reason(response)
    raw_request_id = error.get("request_id")
    request_id = raw_request_id if isinstance(raw_request_id, str) else None
    answer = ErrorAnswer(
        status=status,
        code=code,
        message=message,
        request_id=request_id or response.headers.get("x-request-id"),
        details={k: v for k, v in error.items() if k not in ("code", "message", "request_id")},
        retry_after_s=parse_retry_after(response.headers.get("retry-after")),
    )
    cls = _ERRORS_BY_CODE.get(code)
    if cls is None:
        cls = ServiceUnavailableError if status in (429, 503) else ServiceError
    return cls(answer)


def _reason(response: ResponseLike) -> str:
    text = response.text.strip().replace("\n", " ")[:200]
    return text or response.reason_phrase or f"HTTP {response.status_code}"


def unexpected_answer(response: ResponseLike, problem: str) -> UnexpectedResponseError:
    return UnexpectedResponseError(
        ErrorAnswer(
            status=response.status_code,
            code="unexpected_response",
            message=f"unexpected answer from {response.url.path}: {problem}",
            request_id=response.headers.get("x-request-id"),
        )
    )


def connection_error(
    error: Exception, method: str, path: str, *, sent: bool, tries: int
) -> ServiceConnectionError:
    detail = f"{type(error).__name__}: {error}".rstrip(": ")
    failure = ServiceConnectionError(
        f"{method} {path} got no answer after {tries} tr{'y' if tries == 1 else 'ies'}: {detail}",
        request_sent=sent,
        tries=tries,
    )
    failure.__cause__ = error
    return failure

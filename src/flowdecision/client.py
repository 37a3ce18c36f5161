"""A typed HTTP client for the decision service (``pip install flowdecision[client]``).

:class:`DecisionClient` (async) and :class:`SyncDecisionClient` speak the
contract of ``docs/SERVICE.md``: they read only the status and ``error.code`` of
an answer and ignore members they do not know, so a newer service keeps working.

Results are frozen dataclasses: :class:`SubmitResult` (``submitted`` or
``duplicate``, the attempt, the parsed :class:`~flowdecision.ResultReceipt`),
:class:`DecisionState`, :class:`ServiceHealth`, :class:`OutboxPage`.

Errors mirror the library's :class:`~flowdecision.DispatchError` family: each
error answer becomes a subclass of the exception the library would raise for
the same thing *and* of :class:`ServiceError`, so ``except
DecisionConflictError`` works for a local :class:`~flowdecision.Dispatcher` and
for the service alike:

===========================  =====================================  ===============================
``error.code`` (status)      raised                                 also an instance of
===========================  =====================================  ===============================
``forbidden_branch`` (403)   :class:`ServiceBranchError`            ``UnauthorizedBranchError``
``conflict`` (409)           :class:`ServiceConflictError`          ``DecisionConflictError``
``busy`` (409)               :class:`ServiceBusyError`              ``DecisionBusyError``
``sink_failed`` (502)        :class:`ServiceSinkError`              ``SinkError``
``lease_lost`` (503)         :class:`ServiceLeaseLostError`         ``LeaseLostError``
``ledger_*`` (503)           :class:`ServiceLedgerError`            ``DispatchLedgerError``
``invalid_*`` (422)          :class:`ServiceInvalidRequestError`    --
``*_too_large`` (413)        :class:`ServiceTooLargeError`          --
``unauthorized`` (401)       :class:`ServiceAuthError`              --
``shutting_down``, other 503 :class:`ServiceUnavailableError`       --
anything else                :class:`ServiceError`                  --
===========================  =====================================  ===============================

All of them derive from :class:`ServiceError`, which carries ``status``,
``error_code`` (the wire code, verbatim, also for codes this client does not
know), ``request_id``, ``details`` (the other members of ``error``) and
``retry_after_s``. A request that never got an HTTP answer raises
:class:`ServiceConnectionError`; an answer that is not the documented shape
raises :class:`UnexpectedResponseError`. Everything derives from
:class:`~flowdecision.FlowDecisionError`.

Retries (:class:`RetryOptions`) use exponential backoff with full jitter and
honour ``Retry-After`` (never sooner; a ``Retry-After`` above
``max_retry_after_s`` or past the deadline ends the retries at once). Retried:

* ``409 busy``, any ``503`` except the permanent ``ledger_corrupt`` and
  ``ledger_schema``, and ``429`` (from a proxy) -- the service did nothing;
* transport failures *before* the request was sent (connection refused or
  timed out, no pooled connection free): the service never saw it;
* transport failures *after* it may have been sent (read timeout, connection
  dropped mid-answer): for reads always; for ``submit`` only with
  ``resend_after_ambiguous=True``. By default ``submit`` raises
  :class:`ServiceConnectionError` with ``request_sent=True`` instead, so the
  caller decides. Opting in is safe: a resent decision has the same id and
  content, so the ledger turns it into ``duplicate`` (the first send got
  through), ``busy`` (it is still running on another replica, and is retried)
  or a fresh claim (it never arrived); the sink can never run twice for it. The
  one visible difference: after such a resend, ``duplicate`` may mean *this*
  call's first send submitted it. Treat ``submitted`` and ``duplicate`` alike:
  the decision is in.

Not retried: ``sink_failed`` (502; the sink applies its own retry policy, and
its claim was released, so a later resubmission is safe and becomes attempt
n+1), 4xx answers (a resend would get the same answer) and ``ledger_corrupt``
/ ``ledger_schema`` (an operator must act).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import urllib.parse
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Final, Generic, TypeVar

import httpx

from .backoff import full_jitter, parse_retry_after
from .closing import Closable
from .errors import (
    DecisionBusyError,
    DecisionConflictError,
    DispatchLedgerError,
    FlowDecisionError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    LeaseLostError,
    SinkError,
    UnauthorizedBranchError,
)
from .identity import ExecutionIdentity, ResultReceipt
from .model import DecisionRequest

__all__ = [
    "DEFAULT_URL",
    "DecisionClient",
    "DecisionState",
    "ErrorAnswer",
    "OutboxItem",
    "OutboxPage",
    "Outcome",
    "RetryEvent",
    "RetryOptions",
    "ServiceAuthError",
    "ServiceBranchError",
    "ServiceBusyError",
    "ServiceConflictError",
    "ServiceConnectionError",
    "ServiceError",
    "ServiceHealth",
    "ServiceInvalidRequestError",
    "ServiceLeaseLostError",
    "ServiceLedgerError",
    "ServiceSinkError",
    "ServiceTooLargeError",
    "ServiceUnavailableError",
    "SubmitResult",
    "SyncDecisionClient",
    "UnexpectedResponseError",
    "error_from_response",
    "read_token_file",
]

log = logging.getLogger("flowdecision.client")

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8080"

#: Error codes that mean "the store needs an operator": never retried, even on 503.
PERMANENT_CODES = frozenset({"ledger_corrupt", "ledger_schema"})

_USER_AGENT = "flowdecision-client"


# -- results ------------------------------------------------------------------------


class Outcome(StrEnum):
    """What became of a submitted decision. Both mean the decision is in."""

    SUBMITTED = "submitted"  # this request's dispatch handed it to the sink (201)
    DUPLICATE = "duplicate"  # it was already completed; nothing was submitted again (200)


@dataclass(frozen=True, slots=True)
class SubmitResult:
    """The answer to ``submit``: 201 ``submitted`` or 200 ``duplicate``."""

    outcome: Outcome
    decision_id: str
    #: The claim's fencing token: 1 for the first claim, higher after a release or takeover.
    attempt: int | None
    #: The digest-only result receipt (the stored one for a duplicate).
    receipt: ResultReceipt | None
    #: The service's ``X-Request-Id`` for the answering request (for its logs).
    request_id: str | None
    #: HTTP requests this call made (1 without retries).
    tries: int = 1

    @property
    def submitted(self) -> bool:
        """True when this call's dispatch submitted the decision to the sink."""
        return self.outcome is Outcome.SUBMITTED


@dataclass(frozen=True, slots=True)
class DecisionState:
    """``GET /v1/decisions/{id}``: the claim record (never its owner)."""

    decision_id: str
    state: str  # "pending" or "completed" (a newer service may add states)
    attempts: int
    request_hash: str
    lease_expires_at_ms: int | None
    completed_at_ms: int | None
    execution_identity: ExecutionIdentity | None
    receipt: ResultReceipt | None
    request_id: str | None

    @property
    def completed(self) -> bool:
        return self.state == "completed"


@dataclass(frozen=True, slots=True)
class ServiceHealth:
    """``GET /healthz``: ``healthy`` (HTTP 200) or ``degraded`` (HTTP 503), with every counter."""

    status: str
    #: The whole snapshot as the service sent it (counters, timings, and any newer members).
    snapshot: Mapping[str, Any]
    request_id: str | None

    @property
    def healthy(self) -> bool:
        return self.status == "healthy"


@dataclass(frozen=True, slots=True)
class OutboxItem:
    """One accepted decision in the outbox, in commit order."""

    seq: int
    decision_id: str
    request_hash: str
    first_attempt: int
    highest_attempt: int
    accepted_at_ms: int
    request: DecisionRequest


@dataclass(frozen=True, slots=True)
class OutboxPage:
    """``GET /v1/outbox``: ask again with ``after=next_after`` while ``has_more``."""

    entries: tuple[OutboxItem, ...]
    next_after: int
    has_more: bool
    request_id: str | None


# -- errors -------------------------------------------------------------------------


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


class ServiceError(FlowDecisionError):
    """The service answered with an error. Base of every error answer, known code or not."""

    code: ClassVar[str] = "service_error"

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


class ServiceAuthError(ServiceError):
    """401: the token is missing or not accepted. Never retried."""

    code: ClassVar[str] = "unauthorized"


class ServiceBranchError(UnauthorizedBranchError, ServiceError):
    """403 ``forbidden_branch``: the request came from a branch other than production."""

    code: ClassVar[str] = "forbidden_branch"

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        self.expected = str(answer.details.get("expected_branch", ""))
        self.actual = str(answer.details.get("branch", ""))


class ServiceConflictError(DecisionConflictError, ServiceError):
    """409 ``conflict``: the id is already bound to different content. Never retried."""

    code: ClassVar[str] = "conflict"

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        self.decision_id = str(answer.details.get("decision_id", ""))


class ServiceBusyError(DecisionBusyError, ServiceError):
    """409 ``busy``: another replica holds a live lease (raised once retries are exhausted)."""

    code: ClassVar[str] = "busy"

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        expires = answer.details.get("lease_expires_at_ms")
        self.lease_expires_at_ms = expires if isinstance(expires, int) else 0


class ServiceInvalidRequestError(ServiceError):
    """422: the body, an identifier or a parameter is not valid; ``field`` names it."""

    code: ClassVar[str] = "invalid_request"

    def __init__(self, answer: ErrorAnswer) -> None:
        super().__init__(answer)
        self.field = str(answer.details.get("field", ""))
        self.problem = str(answer.details.get("problem", ""))


class ServiceTooLargeError(ServiceError):
    """413: the body or the decision is over the service's limit (``limit_bytes``)."""

    code: ClassVar[str] = "payload_too_large"

    def __init__(self, answer: ErrorAnswer) -> None:
        super().__init__(answer)
        limit = answer.details.get("limit_bytes")
        self.limit_bytes = limit if isinstance(limit, int) else None


class ServiceSinkError(SinkError, ServiceError):
    """502 ``sink_failed``: the sink raised; the claim was released, a later retry is safe."""

    code: ClassVar[str] = "sink_failed"

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        self.detail = answer.message


class ServiceLeaseLostError(LeaseLostError, ServiceError):
    """503 ``lease_lost``: the lease was lost while the sink ran (raised once retries are out)."""

    code: ClassVar[str] = "lease_lost"

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        self.decision_id = str(answer.details.get("decision_id", ""))


class ServiceLedgerError(DispatchLedgerError, ServiceError):
    """503 ``ledger_unavailable`` (transient), ``ledger_corrupt``/``ledger_schema`` (permanent)."""

    code: ClassVar[str] = "ledger_unavailable"

    def __init__(self, answer: ErrorAnswer) -> None:
        ServiceError.__init__(self, answer)
        self.detail = answer.message

    @property
    def permanent(self) -> bool:
        """An operator must act (corrupt data, a schema from another version)."""
        return self.error_code in PERMANENT_CODES


class ServiceUnavailableError(ServiceError):
    """503 other than a ledger failure (e.g. ``shutting_down``), or a 429 from a proxy."""

    code: ClassVar[str] = "unavailable"


class UnexpectedResponseError(ServiceError):
    """The answer is not the documented shape (not JSON, a member missing or mistyped)."""

    code: ClassVar[str] = "unexpected_response"


class ServiceConnectionError(FlowDecisionError):
    """No HTTP answer: the connection failed or timed out. The transport error is ``__cause__``.

    ``request_sent`` is False when the service cannot have seen the request
    (connect failures), True when it may have (a read timeout): a decision may
    then be in, and resubmitting it tells.
    """

    code: ClassVar[str] = "connection_failed"

    def __init__(self, message: str, *, request_sent: bool, tries: int) -> None:
        super().__init__(message)
        self.request_sent = request_sent
        self.tries = tries


_ERRORS_BY_CODE: dict[str, type[ServiceError]] = {
    "unauthorized": ServiceAuthError,
    "forbidden_branch": ServiceBranchError,
    "conflict": ServiceConflictError,
    "busy": ServiceBusyError,
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


def error_from_response(response: httpx.Response) -> ServiceError:
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


def _reason(response: httpx.Response) -> str:
    text = response.text.strip().replace("\n", " ")[:200]
    return text or response.reason_phrase or f"HTTP {response.status_code}"


def _unexpected(response: httpx.Response, problem: str) -> UnexpectedResponseError:
    return UnexpectedResponseError(
        ErrorAnswer(
            status=response.status_code,
            code="unexpected_response",
            message=f"unexpected answer from {response.request.url.path}: {problem}",
            request_id=response.headers.get("x-request-id"),
        )
    )


# -- retries ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RetryOptions:
    """When and how long to retry; see the module docstring for *what* is retried."""

    #: HTTP requests per call, the first included (1 = never retry).
    max_tries: int = 5
    #: Full-jitter backoff: retry n waits uniform(0, min(backoff_max_s, backoff_base_s·2^(n-1))).
    backoff_base_s: float = 0.1
    backoff_max_s: float = 10.0
    #: A ``Retry-After`` longer than this ends the retries at once (the error is raised).
    max_retry_after_s: float = 60.0
    #: Total time budget of one call, sleeps included (None: bounded by ``max_tries`` only).
    deadline_s: float | None = None
    #: Resend a decision after a failure that may have reached the service (see above).
    resend_after_ambiguous: bool = False

    def __post_init__(self) -> None:
        if self.max_tries < 1:
            raise InvalidArgumentError(f"max_tries must be at least 1, got {self.max_tries}")
        if self.backoff_base_s < 0 or self.backoff_max_s < 0 or self.max_retry_after_s < 0:
            raise InvalidArgumentError("backoff and Retry-After bounds must not be negative")


@dataclass(frozen=True, slots=True)
class RetryEvent:
    """Passed to ``on_retry`` before each retry's sleep."""

    method: str
    path: str
    #: The try that failed (1-based); the retry will be ``try_number + 1``.
    try_number: int
    #: How long the client sleeps before the retry (never less than ``retry_after_s``).
    delay_s: float
    #: The server's ``Retry-After``, when it sent one.
    retry_after_s: float | None
    #: What failed: a :class:`ServiceError` (an answer) or a :class:`ServiceConnectionError`.
    error: FlowDecisionError


OnRetry = Callable[[RetryEvent], None]

#: The request cannot have reached the service.
_NOT_SENT: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
)
#: The request may have reached the service (or part of it did).
_MAYBE_SENT: tuple[type[Exception], ...] = (
    httpx.ReadTimeout,
    httpx.WriteTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


# -- the protocol, written once for both clients ------------------------------------
#
# Each operation is a generator that yields what to do -- send a request, or
# sleep -- and receives the response (or has the transport error thrown in).
# The async and the sync client only differ in how they carry those steps out.


@dataclass(frozen=True, slots=True)
class _Send:
    method: str
    url: str
    headers: Mapping[str, str]
    content: bytes | None
    params: Mapping[str, str | int] | None
    timeout: httpx.Timeout


@dataclass(frozen=True, slots=True)
class _Sleep:
    seconds: float


_Step = _Send | _Sleep
_Exchange = Generator[_Step, httpx.Response | None, T]


def _prefer_wait(wait_s: float) -> str:
    seconds = max(0, int(-(-wait_s // 1)))  # ceil: never ask for less than asked
    return f"wait={seconds}"


class _Protocol:
    """Requests, answers and the retry loop; no I/O."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        timeout: float | httpx.Timeout,
        retry: RetryOptions,
        wait_s: float | None,
        on_retry: OnRetry | None,
        rng: random.Random | None,
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise InvalidArgumentError(f"service URL must be http(s)://host[:port], got `{url}`")
        if token is not None and (not token.strip() or "\n" in token or "\r" in token):
            raise InvalidArgumentError("token must be a non-empty single line")
        if wait_s is not None and wait_s < 0:
            raise InvalidArgumentError(f"wait_s must not be negative, got {wait_s}")
        self.base_url = url.rstrip("/")
        self.token = token.strip() if token else None
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.retry = retry
        self.wait_s = wait_s
        self.on_retry = on_retry
        self.rng = rng or random.Random()

    def headers(self, request_id: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if request_id:
            headers["X-Request-Id"] = request_id
        return headers

    # operations

    def submit(
        self,
        request: DecisionRequest | bytes | Mapping[str, Any],
        *,
        wait_s: float | None,
        request_id: str | None,
    ) -> _Exchange[SubmitResult]:
        body = _encode_request(request)
        headers = self.headers(request_id)
        headers["Content-Type"] = "application/json"
        timeout = self.timeout
        wait = self.wait_s if wait_s is None else wait_s
        if wait:
            headers["Prefer"] = _prefer_wait(wait)
            # The service holds the answer up to `wait` seconds: read that much longer.
            read = timeout.read
            timeout = httpx.Timeout(
                connect=timeout.connect,
                read=None if read is None else read + wait,
                write=timeout.write,
                pool=timeout.pool,
            )
        response, tries = yield from self._exchange(
            "POST",
            "/v1/decisions",
            headers=headers,
            content=body,
            timeout=timeout,
            resend_ok=self.retry.resend_after_ambiguous,
            accept=lambda r: r.status_code in (200, 201),
        )
        return _submit_result(response, tries)

    def get(self, decision_id: str, *, request_id: str | None) -> _Exchange[DecisionState | None]:
        if not decision_id:
            raise InvalidArgumentError("decision_id must not be empty")

        def missing(response: httpx.Response) -> bool:
            # A 404 only means "no such decision" when the service says so for this
            # id; a 404 from anything else (a wrong base URL, a proxy) is an error.
            if response.status_code != 404:
                return False
            try:
                error = response.json().get("error", {})
            except (ValueError, AttributeError):
                return False
            return (
                isinstance(error, dict)
                and error.get("code") == "not_found"
                and error.get("decision_id") == decision_id
            )

        response, _tries = yield from self._exchange(
            "GET",
            "/v1/decisions/" + urllib.parse.quote(decision_id, safe=""),
            headers=self.headers(request_id),
            accept=lambda r: r.status_code == 200 or missing(r),
        )
        if response.status_code == 404:
            return None
        return _decision_state(response)

    def health(self, *, request_id: str | None) -> _Exchange[ServiceHealth]:
        def snapshot(response: httpx.Response) -> bool:
            # 503 with a health body is an answer ("degraded"), not a failure to retry.
            if response.status_code not in (200, 503):
                return False
            try:
                body = response.json()
            except ValueError:
                return False
            return isinstance(body, dict) and isinstance(body.get("status"), str)

        response, _tries = yield from self._exchange(
            "GET", "/healthz", headers=self.headers(request_id), accept=snapshot
        )
        body = response.json()
        return ServiceHealth(
            status=body["status"],
            snapshot=body,
            request_id=response.headers.get("x-request-id"),
        )

    def outbox(self, after: int, limit: int, *, request_id: str | None) -> _Exchange[OutboxPage]:
        if after < 0 or limit < 1:
            raise InvalidArgumentError(
                f"need after >= 0 and limit >= 1, got after={after} limit={limit}"
            )
        response, _tries = yield from self._exchange(
            "GET",
            "/v1/outbox",
            headers=self.headers(request_id),
            params={"after": after, "limit": limit},
            accept=lambda r: r.status_code == 200,
        )
        return _outbox_page(response)

    # the retry loop

    def _exchange(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str],
        accept: Callable[[httpx.Response], bool],
        content: bytes | None = None,
        params: Mapping[str, str | int] | None = None,
        timeout: httpx.Timeout | None = None,
        resend_ok: bool = True,
    ) -> Generator[_Step, httpx.Response | None, tuple[httpx.Response, int]]:
        send = _Send(
            method, self.base_url + path, headers, content, params, timeout or self.timeout
        )
        retry = self.retry
        started = time.monotonic()
        tries = 0
        while True:
            tries += 1
            failure: ServiceError | ServiceConnectionError
            may_retry: bool
            try:
                response = yield send
            except _NOT_SENT as error:
                failure = _connection_error(error, method, path, sent=False, tries=tries)
                may_retry, retry_after = True, None
            except _MAYBE_SENT as error:
                failure = _connection_error(error, method, path, sent=True, tries=tries)
                may_retry, retry_after = resend_ok, None
            except httpx.TransportError as error:  # e.g. an unsupported protocol: final
                raise _connection_error(error, method, path, sent=False, tries=tries) from error
            else:
                assert response is not None
                if accept(response):
                    return response, tries
                failure = error_from_response(response)
                failure.tries = tries
                may_retry, retry_after = failure.retryable, failure.retry_after_s
            if not may_retry or tries >= retry.max_tries:
                raise failure
            if retry_after is not None and retry_after > retry.max_retry_after_s:
                raise failure
            backoff = full_jitter(
                tries, base_s=retry.backoff_base_s, cap_s=retry.backoff_max_s, rng=self.rng
            )
            delay = backoff if retry_after is None else max(retry_after, backoff)
            if (
                retry.deadline_s is not None
                and time.monotonic() - started + delay > retry.deadline_s
            ):
                raise failure
            event = RetryEvent(method, path, tries, delay, retry_after, failure)
            log.info(
                "retrying",
                extra={
                    "method": method,
                    "path": path,
                    "try": tries,
                    "retry_in_s": round(delay, 3),
                    "problem": str(failure),
                },
            )
            if self.on_retry is not None:
                self.on_retry(event)
            yield _Sleep(delay)


def _connection_error(
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


# -- encoding and decoding ----------------------------------------------------------


def _encode_request(request: DecisionRequest | bytes | Mapping[str, Any]) -> bytes:
    if isinstance(request, DecisionRequest):
        return request.to_json()
    if isinstance(request, bytes | bytearray | memoryview):
        return bytes(request)  # sent verbatim: the service parses and validates it
    if isinstance(request, Mapping):
        return json.dumps(request, ensure_ascii=False, allow_nan=False).encode()
    raise InvalidArgumentTypeError(
        f"submit() takes a DecisionRequest, JSON bytes or a dict, not {type(request).__name__}"
    )


def _json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError as error:
        raise _unexpected(response, f"not JSON ({error})") from error
    if not isinstance(body, dict):
        raise _unexpected(response, "not a JSON object")
    return body


def _member(response: httpx.Response, body: Mapping[str, Any], name: str, kind: type[T]) -> T:
    value = body.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _unexpected(response, f"member `{name}` is missing or not {kind.__name__}")
    return value


def _optional_int(response: httpx.Response, body: Mapping[str, Any], name: str) -> int | None:
    if body.get(name) is None:
        return None
    return _member(response, body, name, int)


def _receipt(response: httpx.Response, value: object) -> ResultReceipt | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _unexpected(response, "member `receipt` is not an object")
    try:
        return ResultReceipt.from_dict(value)
    except (ValueError, TypeError) as error:
        raise _unexpected(response, f"invalid receipt: {error}") from error


def _submit_result(response: httpx.Response, tries: int) -> SubmitResult:
    body = _json_object(response)
    raw = _member(response, body, "outcome", str)
    try:
        outcome = Outcome(raw)
    except ValueError:
        raise _unexpected(response, f"unknown outcome `{raw}`") from None
    return SubmitResult(
        outcome=outcome,
        decision_id=_member(response, body, "decision_id", str),
        attempt=_optional_int(response, body, "attempt"),
        receipt=_receipt(response, body.get("receipt")),
        request_id=response.headers.get("x-request-id"),
        tries=tries,
    )


def _decision_state(response: httpx.Response) -> DecisionState:
    body = _json_object(response)
    identity = body.get("execution_identity")
    try:
        parsed_identity = None if identity is None else ExecutionIdentity.from_dict(identity)
    except (ValueError, TypeError) as error:
        raise _unexpected(response, f"invalid execution_identity: {error}") from error
    return DecisionState(
        decision_id=_member(response, body, "decision_id", str),
        state=_member(response, body, "state", str),
        attempts=_member(response, body, "attempts", int),
        request_hash=_member(response, body, "request_hash", str),
        lease_expires_at_ms=_optional_int(response, body, "lease_expires_at_ms"),
        completed_at_ms=_optional_int(response, body, "completed_at_ms"),
        execution_identity=parsed_identity,
        receipt=_receipt(response, body.get("receipt")),
        request_id=response.headers.get("x-request-id"),
    )


def _outbox_page(response: httpx.Response) -> OutboxPage:
    body = _json_object(response)
    raw_entries = _member(response, body, "entries", list)
    entries = []
    for raw in raw_entries:
        if not isinstance(raw, dict):
            raise _unexpected(response, "an outbox entry is not an object")
        try:
            request = DecisionRequest.from_dict(_member(response, raw, "request", dict))
        except ValueError as error:
            raise _unexpected(response, f"invalid outbox request: {error}") from error
        entries.append(
            OutboxItem(
                seq=_member(response, raw, "seq", int),
                decision_id=_member(response, raw, "decision_id", str),
                request_hash=_member(response, raw, "request_hash", str),
                first_attempt=_member(response, raw, "first_attempt", int),
                highest_attempt=_member(response, raw, "highest_attempt", int),
                accepted_at_ms=_member(response, raw, "accepted_at_ms", int),
                request=request,
            )
        )
    return OutboxPage(
        entries=tuple(entries),
        next_after=_member(response, body, "next_after", int),
        has_more=_member(response, body, "has_more", bool),
        request_id=response.headers.get("x-request-id"),
    )


def read_token_file(path: str | Path) -> str:
    """The first non-blank line of a token file (the service's token files list one per line)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidArgumentError(f"cannot read token file `{path}`: {error}") from error
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    raise InvalidArgumentError(f"token file `{path}` has no token")


# -- the two clients ----------------------------------------------------------------


def _send_kwargs(step: _Send) -> dict[str, Any]:
    return {
        "headers": step.headers,
        "content": step.content,
        "params": step.params,
        "timeout": step.timeout,
    }


H = TypeVar("H", httpx.Client, httpx.AsyncClient)

#: The settings of the httpx client a client builds (and owns) when none is given.
_HTTP_DEFAULTS: Final[dict[str, Any]] = {
    "headers": {"User-Agent": _USER_AGENT},
    "follow_redirects": False,
}


class _Client(Generic[H]):
    """What :class:`DecisionClient` and :class:`SyncDecisionClient` share: the
    arguments, the sans-I/O core and the httpx client (built here unless given)."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        timeout: float | httpx.Timeout = 10.0,
        retry: RetryOptions | None = None,
        wait_s: float | None = None,
        on_retry: OnRetry | None = None,
        http: H | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._protocol = _Protocol(
            url,
            token=token,
            timeout=timeout,
            retry=retry or RetryOptions(),
            wait_s=wait_s,
            on_retry=on_retry,
            rng=rng,
        )
        self._owns_http = http is None
        self._http: H = self._new_http() if http is None else http

    @property
    def url(self) -> str:
        return self._protocol.base_url

    def _new_http(self) -> H:
        raise NotImplementedError


class DecisionClient(_Client[httpx.AsyncClient], Closable):
    """Async client for the decision service. Use ``async with`` or call :meth:`aclose`.

    ``url`` is the service's base URL; ``token`` its bearer token (None when it
    runs without auth); ``timeout`` bounds each HTTP request (seconds, or an
    ``httpx.Timeout``); ``retry`` says when to retry; ``wait_s`` sends
    ``Prefer: wait=N`` with every submission, so a service that supports it
    answers with another owner's result instead of ``busy``; ``on_retry`` is
    called before each retry's sleep. Pass ``http`` to reuse an
    ``httpx.AsyncClient`` (its TLS, proxies, limits); it is not closed here.
    """

    def _new_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(**_HTTP_DEFAULTS)

    async def submit(
        self,
        request: DecisionRequest | bytes | Mapping[str, Any],
        *,
        wait_s: float | None = None,
        request_id: str | None = None,
    ) -> SubmitResult:
        """Submit one decision; ``submitted`` or ``duplicate``, otherwise a :class:`ServiceError`.

        ``request`` is a :class:`DecisionRequest`, its JSON bytes (sent
        verbatim) or a dict (JSON-encoded). ``wait_s`` overrides the client's
        ``Prefer: wait`` for this call.
        """
        return await self._drive(
            self._protocol.submit(request, wait_s=wait_s, request_id=request_id)
        )

    async def get(self, decision_id: str, *, request_id: str | None = None) -> DecisionState | None:
        """The claim record of ``decision_id``, or None if the service has none."""
        return await self._drive(self._protocol.get(decision_id, request_id=request_id))

    async def health(self, *, request_id: str | None = None) -> ServiceHealth:
        """The health snapshot; a degraded service (HTTP 503) is an answer, not an error."""
        return await self._drive(self._protocol.health(request_id=request_id))

    async def outbox(
        self, after: int = 0, limit: int = 100, *, request_id: str | None = None
    ) -> OutboxPage:
        """Accepted decisions with ``seq > after``, in commit order (outbox sinks only)."""
        return await self._drive(self._protocol.outbox(after, limit, request_id=request_id))

    async def _drive(self, exchange: _Exchange[T]) -> T:
        try:
            step = next(exchange)
            while True:
                if isinstance(step, _Sleep):
                    await asyncio.sleep(step.seconds)
                    step = exchange.send(None)
                    continue
                try:
                    response = await self._http.request(step.method, step.url, **_send_kwargs(step))
                except httpx.TransportError as error:
                    step = exchange.throw(error)
                else:
                    step = exchange.send(response)
        except StopIteration as stop:
            result: T = stop.value
            return result

    async def close(self) -> None:
        """Close the HTTP connection pool if this client created it (``async with`` does)."""
        if self._owns_http:
            await self._http.aclose()

    #: httpx's spelling of :meth:`close`.
    aclose = close


class SyncDecisionClient(_Client[httpx.Client]):
    """The blocking twin of :class:`DecisionClient`: same arguments, same results and errors."""

    def _new_http(self) -> httpx.Client:
        return httpx.Client(**_HTTP_DEFAULTS)

    def submit(
        self,
        request: DecisionRequest | bytes | Mapping[str, Any],
        *,
        wait_s: float | None = None,
        request_id: str | None = None,
    ) -> SubmitResult:
        """See :meth:`DecisionClient.submit`."""
        return self._drive(self._protocol.submit(request, wait_s=wait_s, request_id=request_id))

    def get(self, decision_id: str, *, request_id: str | None = None) -> DecisionState | None:
        """See :meth:`DecisionClient.get`."""
        return self._drive(self._protocol.get(decision_id, request_id=request_id))

    def health(self, *, request_id: str | None = None) -> ServiceHealth:
        """See :meth:`DecisionClient.health`."""
        return self._drive(self._protocol.health(request_id=request_id))

    def outbox(
        self, after: int = 0, limit: int = 100, *, request_id: str | None = None
    ) -> OutboxPage:
        """See :meth:`DecisionClient.outbox`."""
        return self._drive(self._protocol.outbox(after, limit, request_id=request_id))

    def _drive(self, exchange: _Exchange[T]) -> T:
        try:
            step = next(exchange)
            while True:
                if isinstance(step, _Sleep):
                    time.sleep(step.seconds)
                    step = exchange.send(None)
                    continue
                try:
                    response = self._http.request(step.method, step.url, **_send_kwargs(step))
                except httpx.TransportError as error:
                    step = exchange.throw(error)
                else:
                    step = exchange.send(response)
        except StopIteration as stop:
            result: T = stop.value
            return result

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> SyncDecisionClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

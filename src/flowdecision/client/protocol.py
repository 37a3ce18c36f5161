"""The sans-I/O core: requests, answers and the retry loop, written once for both clients.

Each operation is a generator that yields what to do -- :class:`Send` a
request, or :class:`Sleep` -- and receives the response (or has the transport
error thrown in). :class:`~.async_client.DecisionClient` and
:class:`~.sync_client.SyncDecisionClient` only differ in how they carry those
steps out.
"""

from __future__ import annotations

import json
import logging
import random
import time
import urllib.parse
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict, TypeVar

import httpx

from ..connections.backoff import full_jitter
from ..connections.transport import ResponseLike
from ..core.model import DecisionRequest
from ..errors import InvalidArgumentError, InvalidArgumentTypeError
from ..ledger.query import AuditPage, DecisionPage
from ..ledger.states import AuditEntry
from ..sinks.parking import OutboxAuditEntry, ParkedRow
from .decode import (
    approval_result,
    bulk_result,
    decision_state,
    outbox_page,
    service_health,
    submit_result,
)
from .errors import ServiceConnectionError, ServiceError, connection_error, error_from_response
from .results import (
    ApprovalResult,
    BulkActionResult,
    DecisionState,
    OutboxPage,
    ServiceHealth,
    SubmitResult,
)
from .retry import MAYBE_SENT, NOT_SENT, TRANSPORT_ERRORS, OnRetry, RetryEvent, RetryOptions

__all__ = [
    "ActionArguments",
    "Exchange",
    "Send",
    "ServiceProtocol",
    "Sleep",
    "Step",
    "audit_params",
    "encode_request",
    "query_params",
    "run_path",
]

log = logging.getLogger("flowdecision.client")

T = TypeVar("T")


class ActionArguments(TypedDict):
    """The keyword arguments of an operator action (``release``, ``forget``).

    ``actor`` and ``reason`` go into the audit trail; ``admin_token`` overrides
    the client's own token for this call; ``request_id`` is sent as
    ``X-Request-Id``. One definition, so each action's method is written once.
    """

    actor: str
    reason: str
    admin_token: NotRequired[str | None]
    request_id: NotRequired[str | None]


@dataclass(frozen=True, slots=True)
class Send:
    """Step: send this request; the response (or the transport error) comes back."""

    method: str
    url: str
    headers: Mapping[str, str]
    content: bytes | None
    params: Mapping[str, str | int] | None
    timeout: httpx.Timeout


@dataclass(frozen=True, slots=True)
class Sleep:
    """Step: sleep before the next try."""

    seconds: float


Step = Send | Sleep
Exchange = Generator[Step, ResponseLike | None, T]


def _params(**values: str | int | None) -> dict[str, str | int]:
    return {name: value for name, value in values.items() if value is not None}


def query_params(
    run_id: str | None,
    state: str | None,
    before_ms: int | None,
    after_ms: int | None,
    cursor: str | None,
    limit: int | None,
    by: str | None = None,
) -> dict[str, str | int]:
    """``GET /v1/decisions``'s query parameters (None: not sent)."""
    return _params(
        run_id=run_id, state=state, before=before_ms, after=after_ms, by=by, cursor=cursor,
        limit=limit,
    )  # fmt: skip


def audit_params(
    decision_id: str | None, cursor: str | None, limit: int | None
) -> dict[str, str | int]:
    """``GET /v1/audit``'s query parameters (None: not sent)."""
    return _params(decision_id=decision_id, cursor=cursor, limit=limit)


def run_path(run_id: str) -> str:
    """``/v1/runs/{run_id}``, the id percent-encoded (``/`` kept: the route takes it)."""
    if not run_id:
        raise InvalidArgumentError("run_id must not be empty")
    return "/v1/runs/" + urllib.parse.quote(run_id, safe="/")


def prefer_wait(wait_s: float) -> str:
    seconds = max(0, int(-(-wait_s // 1)))  # ceil: never ask for less than asked
    return f"wait={seconds}"


class ServiceProtocol:
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
    ) -> Exchange[SubmitResult]:
        body = encode_request(request)
        headers = self.headers(request_id)
        headers["Content-Type"] = "application/json"
        timeout = self.timeout
        wait = self.wait_s if wait_s is None else wait_s
        if wait:
            headers["Prefer"] = prefer_wait(wait)
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
            accept=lambda r: r.status_code in (200, 201, 202),
        )
        return submit_result(response, tries)

    def get(
        self, decision_id: str, *, request_id: str | None, wait_s: int = 0
    ) -> Exchange[DecisionState | None]:
        """``GET /v1/decisions/{id}``; ``wait_s``: a long-poll while it is held."""
        if not decision_id:
            raise InvalidArgumentError("decision_id must not be empty")
        timeout = self.timeout
        if wait_s:
            # The service holds the answer up to `wait_s` seconds: read that much longer.
            read = timeout.read
            timeout = httpx.Timeout(
                connect=timeout.connect,
                read=None if read is None else read + wait_s,
                write=timeout.write,
                pool=timeout.pool,
            )

        def missing(response: ResponseLike) -> bool:
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
            decision_path(decision_id),
            headers=self.headers(request_id),
            params={"wait": wait_s} if wait_s else None,
            timeout=timeout,
            accept=lambda r: r.status_code == 200 or missing(r),
        )
        if response.status_code == 404:
            return None
        return decision_state(response)

    def health(self, *, request_id: str | None) -> Exchange[ServiceHealth]:
        def snapshot(response: ResponseLike) -> bool:
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
        return service_health(response)

    def outbox(self, after: int, limit: int, *, request_id: str | None) -> Exchange[OutboxPage]:
        if after < 0 or limit < 1:
            raise InvalidArgumentError(
                f"need after >= 0 and limit >= 1, got after={after} limit={limit}"
            )
        params = {"after": after, "limit": limit}
        return outbox_page((yield from self._get_ok("/v1/outbox", params, request_id)))

    def decisions(
        self, path: str, params: Mapping[str, str | int], *, request_id: str | None
    ) -> Exchange[DecisionPage]:
        """``GET /v1/decisions`` or ``GET /v1/runs/{run_id}``: one page."""
        response = yield from self._get_ok(path, params, request_id)
        return DecisionPage.from_dict(response.json())

    def audit(
        self, params: Mapping[str, str | int], *, request_id: str | None
    ) -> Exchange[AuditPage]:
        response = yield from self._get_ok("/v1/audit", params, request_id)
        return AuditPage.from_dict(response.json())

    def _get_ok(
        self, path: str, params: Mapping[str, str | int], request_id: str | None
    ) -> Exchange[ResponseLike]:
        """``GET path?params`` whose one good answer is a 200 (retried like every read)."""
        response, _tries = yield from self._exchange(
            "GET", path, headers=self.headers(request_id), params=params, accept=_is_200
        )
        return response

    def action(
        self,
        name: str,
        decision_id: str,
        *,
        actor: str,
        reason: str,
        admin_token: str | None = None,
        request_id: str | None = None,
    ) -> Exchange[AuditEntry]:
        """``POST /v1/actions/{name}`` with the admin token (or the client's own)."""
        body = {"decision_id": decision_id, "actor": actor, "reason": reason}
        answer = yield from self._act(name, body, admin_token, request_id)
        return AuditEntry.from_dict(answer)

    def approve(
        self,
        decision_id: str,
        *,
        actor: str,
        reason: str,
        admin_token: str | None = None,
        request_id: str | None = None,
    ) -> Exchange[ApprovalResult]:
        """``POST /v1/actions/approve``: the held decision is dispatched exactly once."""
        body = {"decision_id": decision_id, "actor": actor, "reason": reason}
        response, tries = yield from self._act_response("approve", body, admin_token, request_id)
        return approval_result(response, tries)

    def bulk(
        self,
        name: str,
        run_id: str,
        *,
        actor: str,
        reason: str,
        admin_token: str | None = None,
        request_id: str | None = None,
    ) -> Exchange[BulkActionResult]:
        """``POST /v1/actions/{approve,reject}`` with ``run_id``: every held decision of it."""
        if not run_id:
            raise InvalidArgumentError("run_id must not be empty")
        body = {"run_id": run_id, "actor": actor, "reason": reason}
        response, tries = yield from self._act_response(name, body, admin_token, request_id)
        return bulk_result(response, tries)

    def parked_action(
        self,
        name: str,
        decision_id: str,
        relay: str,
        *,
        actor: str,
        reason: str,
        admin_token: str | None = None,
        request_id: str | None = None,
    ) -> Exchange[OutboxAuditEntry]:
        """``POST /v1/actions/outbox-{name}``: retry or skip a row relay ``relay`` parked."""
        body = {"decision_id": decision_id, "actor": actor, "reason": reason, "relay": relay}
        answer = yield from self._act(f"outbox-{name}", body, admin_token, request_id)
        return OutboxAuditEntry.from_dict(answer)

    def _act(
        self, name: str, body: dict[str, str], admin_token: str | None, request_id: str | None
    ) -> Exchange[Any]:
        response, _tries = yield from self._act_response(name, body, admin_token, request_id)
        return response.json()

    def _act_response(
        self, name: str, body: dict[str, str], admin_token: str | None, request_id: str | None
    ) -> Generator[Step, ResponseLike | None, tuple[ResponseLike, int]]:
        headers = self.headers(request_id)
        headers["Content-Type"] = "application/json"
        if admin_token is not None:
            headers["Authorization"] = f"Bearer {admin_token.strip()}"
        return (
            yield from self._exchange(
                "POST",
                f"/v1/actions/{name}",
                headers=headers,
                content=json.dumps(body).encode("utf-8"),
                # Not idempotent (a release bumps the fencing token): never resent blindly.
                resend_ok=False,
                accept=_is_200,
            )
        )

    def parked(self, relay: str | None, *, request_id: str | None) -> Exchange[list[ParkedRow]]:
        """``GET /v1/outbox/parked``: the rows relays parked, and those held behind them."""
        params = _params(relay=relay)
        response = yield from self._get_ok("/v1/outbox/parked", params, request_id)
        return [ParkedRow.from_dict(row) for row in response.json()["parked"]]

    # the retry loop

    def _exchange(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str],
        accept: Callable[[ResponseLike], bool],
        content: bytes | None = None,
        params: Mapping[str, str | int] | None = None,
        timeout: httpx.Timeout | None = None,
        resend_ok: bool = True,
    ) -> Generator[Step, ResponseLike | None, tuple[ResponseLike, int]]:
        send = Send(method, self.base_url + path, headers, content, params, timeout or self.timeout)
        retry = self.retry
        started = time.monotonic()
        tries = 0
        while True:
            tries += 1
            failure: ServiceError | ServiceConnectionError
            may_retry: bool
            try:
                response = yield send
            except NOT_SENT as error:
                failure = connection_error(error, method, path, sent=False, tries=tries)
                may_retry, retry_after = True, None
            except MAYBE_SENT as error:
                failure = connection_error(error, method, path, sent=True, tries=tries)
                may_retry, retry_after = resend_ok, None
            except TRANSPORT_ERRORS as error:  # e.g. an unsupported protocol: final
                raise connection_error(error, method, path, sent=False, tries=tries) from error
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
            yield Sleep(delay)


def encode_request(request: DecisionRequest | bytes | Mapping[str, Any]) -> bytes:
    if isinstance(request, DecisionRequest):
        return request.to_json()
    if isinstance(request, bytes | bytearray | memoryview):
        return bytes(request)  # sent verbatim: the service parses and validates it
    if isinstance(request, Mapping):
        return json.dumps(request, ensure_ascii=False, allow_nan=False).encode()
    raise InvalidArgumentTypeError(
        f"submit() takes a DecisionRequest, JSON bytes or a dict, not {type(request).__name__}"
    )


def _is_200(response: ResponseLike) -> bool:
    return response.status_code == 200


def decision_path(decision_id: str) -> str:
    """The path of one decision: its id as one percent-encoded segment.

    ``quote`` leaves dots alone, and a segment that is ``.`` or ``..`` is a dot
    segment that the URL layer removes (``GET /v1/decisions/..`` would become
    ``GET /v1``); encoded as ``%2E`` it stays an id, which the service decodes.
    """
    segment = urllib.parse.quote(decision_id, safe="")
    if segment in (".", ".."):
        segment = segment.replace(".", "%2E")
    return "/v1/decisions/" + segment

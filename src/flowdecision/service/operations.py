"""Operator endpoints: decisions by run, state and age, the audit trail, and actions.

* ``GET /v1/decisions?run_id=&state=&before=&after=&by=&cursor=&limit=``: one
  keyset page (:class:`~flowdecision.ledger.query.DecisionQuery`); ``by=completed``
  filters on and orders by completion time instead of first-claim time;
  ``count=true`` adds how many match.
* ``GET /v1/runs/{run_id}``: the run's state (open, closing or closed: by which
  decision, when) and its decisions in the order they were first claimed.
* ``GET /v1/audit?decision_id=&before=&after=&cursor=&limit=``: the audit trail.
* ``POST /v1/actions/release`` and ``POST /v1/actions/forget`` with
  ``{"decision_id", "actor", "reason"}``: need an **admin token** (never the
  submit token); a service configured without one refuses them (403).
* ``POST /v1/actions/approve`` and ``POST /v1/actions/reject`` (approval holds)
  with ``{"decision_id" | "run_id", "actor", "reason"}``: one held decision, or
  every held decision of a run (bulk); admin token, as the other actions.

Reads take the service's ordinary token or an admin token (:func:`admin_may`: the
admin token opens nothing else).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..core.limits import U64_MAX
from ..errors import (
    ActionRefusedError,
    DispatchError,
    FlowDecisionError,
    InvalidArgumentError,
    LedgerError,
    UnknownDecisionError,
)
from ..ledger.query import (
    DEFAULT_PAGE_LIMIT,
    MAX_PAGE_LIMIT,
    AuditQuery,
    DecisionQuery,
    TimeField,
)
from ..ledger.states import AuditEntry, DecisionState
from ..sinks.cursor import check_cursor_name
from ..sinks.outbox import OutboxSink
from ..sinks.relay import DEFAULT_RELAY_NAME
from .auth import presented_token, token_matches
from .errors import error_response, response_for_error
from .inputs import BadParamError, bad_param, bounded_int, one_param, read_body_within
from .routing import Route
from .runtime import Service
from .status import FIND_PARAMS, Finder, RecentActions

__all__ = ["ADMIN_ROUTES", "admin_may", "operation_routes", "recent_actions", "status_finder"]

#: The routes that need an admin token.
ADMIN_ROUTES = (
    "/v1/actions/release",
    "/v1/actions/forget",
    "/v1/actions/outbox-retry",
    "/v1/actions/outbox-skip",
    "/v1/actions/approve",
    "/v1/actions/reject",
)
#: Paths (and prefixes) of the reads an admin token may make: the operator's queries,
#: and one decision by id (what an operator looks at before acting on it).
_ADMIN_READS = ("/v1/decisions", "/v1/audit", "/v1/outbox/parked")
_ADMIN_READ_PREFIXES = ("/v1/decisions/", "/v1/runs/")


def admin_may(method: str, path: str) -> bool:
    """Whether an admin token opens ``method path``: the actions, and the operator's
    reads; never a submission, the outbox, metrics or the status page."""
    if method == "POST":
        return path in ADMIN_ROUTES
    return method in ("GET", "HEAD") and (
        path in _ADMIN_READS or path.startswith(_ADMIN_READ_PREFIXES)
    )


def _one(request: Request, name: str) -> str | None:
    return one_param(request.query_params, name)


def _number(request: Request, name: str, low: int, high: int) -> int | None:
    raw = _one(request, name)
    return None if raw is None else bounded_int(name, raw, low, high)


def _service(request: Request) -> Service:
    service: Service | None = request.app.state.context.service
    assert service is not None  # the lifespan starts it before the first request
    return service


async def _ledger_call(service: Service, call: Any) -> Any:
    try:
        return await call
    except LedgerError as error:
        return response_for_error(error, service.error_context())


async def _page(
    request: Request, run_id: str | None, run_where: str, *, with_run: bool = False
) -> Response:
    service = _service(request)
    try:
        query = DecisionQuery(
            run_id=run_id,
            state=_one(request, "state"),  # type: ignore[arg-type]  # checked by the query
            before_ms=_number(request, "before", 0, U64_MAX),
            after_ms=_number(request, "after", 0, U64_MAX),
            cursor=_one(request, "cursor"),
            limit=_number(request, "limit", 1, MAX_PAGE_LIMIT) or DEFAULT_PAGE_LIMIT,
            by=_one(request, "by") or TimeField.CLAIMED,  # type: ignore[arg-type]  # checked
        )
        count_text = _one(request, "count") or "false"
        if count_text not in ("true", "false"):
            raise BadParamError("count", f"must be `true` or `false`, got `{count_text[:40]}`")
        with_count = count_text == "true"
    except BadParamError as bad:
        return bad_param(bad)
    except InvalidArgumentError as error:
        name = next(
            (n for n in ("by", "state", "cursor", "run_id") if f"`{n}`" in str(error)), "query"
        )
        where = run_where if name == "run_id" else "query parameter"
        return bad_param(BadParamError(name, str(error), where=where))
    page = await _ledger_call(service, service.ledger.list_decisions(query))
    if isinstance(page, Response):
        return page
    if with_run:
        assert run_id is not None
        run = await _ledger_call(service, service.ledger.run_state(run_id))
        if isinstance(run, Response):
            return run
        page = dataclasses.replace(page, run=run)
    body: dict[str, Any] = page.to_dict()
    if with_count:
        count = await _ledger_call(service, service.ledger.count_decisions(query))
        if isinstance(count, Response):
            return count
        body["count"] = count
    return JSONResponse(body)


async def list_decisions(request: Request) -> Response:
    """A keyset page of decisions by run, state and first-claim or completion time."""
    try:
        run_id = _one(request, "run_id")
    except BadParamError as bad:
        return bad_param(bad)
    return await _page(request, run_id, "query parameter")


async def get_run(request: Request) -> Response:
    """One run's state and its decisions, in the order they were first claimed."""
    run_id = request.path_params["run_id"]
    if run_id == "":  # `/v1/runs/` (where `/v1/runs` redirects): no run named
        return bad_param(
            BadParamError("run_id", "must not be empty: name the run", where="path parameter")
        )
    return await _page(request, run_id, "path parameter", with_run=True)


async def get_audit(request: Request) -> Response:
    """The audit trail of operator actions, oldest first."""
    service = _service(request)
    try:
        query = AuditQuery(
            decision_id=_one(request, "decision_id"),
            before_ms=_number(request, "before", 0, U64_MAX),
            after_ms=_number(request, "after", 0, U64_MAX),
            cursor=_one(request, "cursor"),
            limit=_number(request, "limit", 1, MAX_PAGE_LIMIT) or DEFAULT_PAGE_LIMIT,
        )
    except BadParamError as bad:
        return bad_param(bad)
    except InvalidArgumentError as error:
        return bad_param(BadParamError("cursor", str(error)))
    page = await _ledger_call(service, service.ledger.audit(query))
    if isinstance(page, Response):
        return page
    return JSONResponse(page.to_dict())


def _admin_refusal(request: Request) -> Response | None:
    """None when the request carries an admin token; else the 401 or 403 to answer."""
    admin: tuple[bytes, ...] = request.app.state.settings.admin_tokens()
    if not admin:
        return error_response(
            403, "admin_disabled",
            "operator actions are disabled: this service has no admin token "
            "(set FLOWDECISION_ADMIN_TOKEN or admin_token_file)",
        )  # fmt: skip
    presented = presented_token(_first_header(request, b"authorization"))
    if presented is None:
        response = error_response(401, "unauthorized", "an admin token is required")
        response.headers["WWW-Authenticate"] = 'Bearer realm="flowdecision-admin"'
        return response
    if not token_matches(presented, admin):
        return error_response(403, "forbidden", "this action needs an admin token")
    return None


def _first_header(request: Request, name: bytes) -> bytes | None:
    for key, value in request.scope["headers"]:
        if key == name:
            return bytes(value)
    return None


#: An action's body holds an id (1 KiB), an actor and a reason (2,000 characters each):
#: a body past this is refused before it is read whole, whatever ``max_body_bytes`` is.
ACTION_MAX_BODY_BYTES = 64 * 1024


class _RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _refuse_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (json.loads would keep the last)."""
    body: dict[str, Any] = {}
    for key, value in pairs:
        if key in body:
            raise _RepeatedKey(key)
        body[key] = value
    return body


def _declared(request: Request) -> bytes | None:
    for name, value in request.scope["headers"]:
        if name == b"content-length":
            return bytes(value)
    return None


async def _action(request: Request, name: str) -> Response:
    body = await _action_body(request, ())
    if isinstance(body, Response):
        return body
    service = _service(request)
    ledger = service.ledger
    act = ledger.operator_release if name == "release" else ledger.forget
    try:
        entry = await act(body["decision_id"], actor=body["actor"], reason=body["reason"])
    except UnknownDecisionError as error:
        return error_response(404, "not_found", str(error), decision_id=body["decision_id"])
    except ActionRefusedError as error:
        return error_response(409, "action_refused", str(error), decision_id=body["decision_id"])
    except LedgerError as error:
        if type(error) is LedgerError:  # a bad actor or reason (empty, too long)
            return error_response(422, "invalid_action", str(error))
        return response_for_error(error, service.error_context())
    return JSONResponse(entry.to_dict())


async def _outbox_action(request: Request, action: str) -> Response:
    """Retry or skip a row a relay parked (``relay`` names it; default ``default``)."""
    body = await _action_body(request, ("relay",))
    if isinstance(body, Response):
        return body
    service = _service(request)
    outbox = service.sink
    if not isinstance(outbox, OutboxSink):
        return error_response(
            404, "no_outbox", "this service's sink is not an outbox: no row is ever parked"
        )
    relay = body.get("relay", DEFAULT_RELAY_NAME)
    decision_id = body["decision_id"]
    try:
        entry = await outbox.act_on_parked(
            relay, action, decision_id, actor=body["actor"], reason=body["reason"]
        )
    except InvalidArgumentError as error:
        return error_response(422, "invalid_action", str(error))
    except UnknownDecisionError as error:
        return error_response(404, "not_found", str(error), decision_id=decision_id)
    except ActionRefusedError as error:
        return error_response(409, "action_refused", str(error), decision_id=decision_id)
    except FlowDecisionError as error:
        return response_for_error(error, service.error_context())
    return JSONResponse(entry.to_dict())


async def _action_body(
    request: Request,
    optional: tuple[str, ...],
    fields: tuple[str, ...] = ("decision_id", "actor", "reason"),
    times: tuple[str, ...] = (),
) -> dict[str, Any] | Response:
    """An action's body: admin token checked, size bounded, JSON with
    ``fields`` (``decision_id``, ``actor`` and ``reason``), the ``optional`` text
    fields and the optional ``times`` (Unix ms), or the answer refusing it."""
    refusal = _admin_refusal(request)
    if refusal is not None:
        return refusal
    limit = min(ACTION_MAX_BODY_BYTES, request.app.state.settings.max_body_bytes)
    raw = await read_body_within(request.receive, _declared(request), limit)
    if isinstance(raw, Response):
        return raw
    try:
        body = json.loads(raw, object_pairs_hook=_refuse_repeats)
    except _RepeatedKey as repeated:
        return error_response(422, "invalid_action", f"field `{repeated.key}` is given twice")
    except (ValueError, UnicodeDecodeError) as error:
        return error_response(422, "invalid_action", f"the body is not JSON: {error}")
    if (
        not isinstance(body, dict)
        or any(not isinstance(body.get(f), str) for f in fields)
        or any(not isinstance(body[f], str) for f in optional if f in body)
        or any(not _unix_ms(body[f]) for f in times if f in body)
    ):
        shape = ", ".join(f'"{f}": str' for f in fields)
        shape += "".join(f', "{f}"?: str' for f in optional)
        shape += "".join(f', "{f}"?: Unix ms' for f in times)
        return error_response(422, "invalid_action", f"the body must be {{{shape}}}")
    unknown = sorted(set(body) - set(fields) - set(optional) - set(times))
    if unknown:
        return error_response(422, "invalid_action", f"unknown field `{unknown[0]}`")
    return body


def _unix_ms(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U64_MAX


async def _hold_action(request: Request, name: str) -> Response:
    """Approve or reject one held decision (``decision_id``), or every held decision a
    query selects (``run_id``, ``after``, ``before``: the answer lists what was done
    and what was refused)."""
    body = await _action_body(
        request, ("decision_id", "run_id"), ("actor", "reason"), ("after", "before")
    )
    if isinstance(body, Response):
        return body
    by_query = any(key in body for key in ("run_id", "after", "before"))
    if ("decision_id" in body) == by_query:
        return error_response(
            422,
            "invalid_action",
            "name one held decision (`decision_id`) or a query (`run_id`, `after`, `before`)",
        )
    service = _service(request)
    actor, reason = body["actor"], body["reason"]
    decision_id = body.get("decision_id")
    if decision_id is not None:
        try:
            done = await _act_on_hold(service, name, decision_id, actor, reason)
        except UnknownDecisionError as error:
            return error_response(404, "not_found", str(error), decision_id=decision_id)
        except ActionRefusedError as error:
            return error_response(409, "action_refused", str(error), decision_id=decision_id)
        except (DispatchError, LedgerError) as error:
            if type(error) is LedgerError:  # a bad actor or reason (empty, too long)
                return error_response(422, "invalid_action", str(error))
            return response_for_error(error, service.error_context())
        return JSONResponse(done)
    try:
        query = DecisionQuery(
            run_id=body.get("run_id"),
            state=DecisionState.HELD,
            after_ms=body.get("after"),
            before_ms=body.get("before"),
            limit=MAX_PAGE_LIMIT,
        )
    except InvalidArgumentError as error:
        return error_response(422, "invalid_action", str(error))
    audit: list[Any] = []
    outcomes: list[Any] = []
    refused: list[dict[str, str]] = []
    try:
        due = [row.decision_id async for row in _rows(service, query)]
    except LedgerError as error:
        return response_for_error(error, service.error_context())
    for held in due:
        try:
            done = await _act_on_hold(service, name, held, actor, reason)
        except (DispatchError, LedgerError) as error:
            refused.append({"decision_id": held, "error": str(error)})
            continue
        if name == "approve":
            outcomes.append(done)
            if done["audit"] is not None:
                audit.append(done["audit"])
        else:
            audit.append(done)
    answer: dict[str, Any] = {"action": name, "audit": audit, "refused": refused}
    if name == "approve":
        answer["outcomes"] = outcomes
    return JSONResponse(answer)


async def _rows(service: Service, query: DecisionQuery) -> Any:
    """Every row ``query`` selects, page after page."""
    cursor = None
    while True:
        page = await service.ledger.list_decisions(query.next_page(cursor))
        for row in page.decisions:
            yield row
        cursor = page.next_cursor
        if cursor is None:
            return


async def _act_on_hold(
    service: Service, name: str, decision_id: str, actor: str, reason: str
) -> dict[str, Any]:
    """Approve (dispatching it, tracked like a POST's dispatch) or reject one decision."""
    if name == "reject":
        entry: AuditEntry = await service.ledger.reject(decision_id, actor=actor, reason=reason)
        return entry.to_dict()
    outcome = await service.approve(decision_id, actor=actor, reason=reason)
    return dict(outcome.to_dict())


async def post_approve(request: Request) -> Response:
    """Approve a held decision (or a run's): it is dispatched exactly once; audited."""
    return await _hold_action(request, "approve")


async def post_reject(request: Request) -> Response:
    """Reject a held decision (or a run's): it is never sent; audited."""
    return await _hold_action(request, "reject")


async def post_release(request: Request) -> Response:
    """Release a pending claim (fenced: the old owner can never complete); audited."""
    return await _action(request, "release")


async def post_forget(request: Request) -> Response:
    """Forget a completed decision or tombstone so its id can be used again; audited."""
    return await _action(request, "forget")


async def post_outbox_retry(request: Request) -> Response:
    """Deliver a parked row again (next in its run); audited in the outbox."""
    return await _outbox_action(request, "retry")


async def post_outbox_skip(request: Request) -> Response:
    """Drop a parked row (its run goes on with its next row); audited in the outbox."""
    return await _outbox_action(request, "skip")


async def get_parked(request: Request) -> Response:
    """The rows relays parked and the rows held behind them (``relay`` narrows to one)."""
    service = _service(request)
    try:
        relay = _one(request, "relay")
    except BadParamError as error:
        return bad_param(error)
    outbox = service.sink
    if not isinstance(outbox, OutboxSink):
        return JSONResponse({"parked": []})
    try:
        if relay is not None:
            check_cursor_name(relay)
        rows = await outbox.parked(relay)
    except InvalidArgumentError as error:
        return bad_param(BadParamError("relay", str(error)))
    except FlowDecisionError as error:
        return response_for_error(error, service.error_context())
    return JSONResponse({"parked": [row.to_dict() for row in rows]})


# ------------------------------------------------------------------ the status page


def _form_time(name: str, text: str) -> int | None:
    """A form's time: Unix ms, or ISO-8601 (UTC unless it says otherwise)."""
    if not text:
        return None
    if text.isascii() and text.isdigit():
        return int(text)
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise InvalidArgumentError(
            f"`{name}` must be Unix milliseconds or an ISO-8601 time, got {text[:40]!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return max(int(moment.timestamp() * 1000), 0)


#: Decisions the status page's "Find decisions" shows per page.
FINDER_PAGE = 25


async def status_finder(service: Service, request: Request) -> Finder:
    """The status page's "Find decisions": the form's query, answered when one is asked."""
    params = {name: request.query_params.get(name, "")[:200] for name in FIND_PARAMS}
    if not any(params.values()):
        return Finder(params)
    try:
        query = DecisionQuery(
            run_id=params["run_id"] or None,
            state=params["state"] or None,  # type: ignore[arg-type]  # checked by the query
            by=params["by"] or TimeField.CLAIMED,  # type: ignore[arg-type]
            after_ms=_form_time("after", params["after"]),
            before_ms=_form_time("before", params["before"]),
            cursor=params["cursor"] or None,
            limit=FINDER_PAGE,
        )
    except InvalidArgumentError as error:
        return Finder(params, error=str(error))
    try:
        page = await service.ledger.list_decisions(query)
        count = await service.ledger.count_decisions(query)
    except LedgerError as error:
        return Finder(params, error=f"the ledger could not be queried: {error}")
    return Finder(params, page, count)


async def recent_actions(service: Service) -> RecentActions:
    """The status page's operator actions of the last 24 hours (oldest first, 20 at most)."""
    query = AuditQuery(after_ms=max(service.ledger.now_ms() - 86_400_000, 0), limit=20)
    try:
        page = await service.ledger.audit(query)
    except LedgerError as error:
        return RecentActions((), error=str(error))
    return RecentActions(page.entries, page.next_cursor is not None)


def operation_routes() -> list[Route]:
    """The operator routes (``GET /v1/decisions`` shares its route with the POST: handlers.py)."""
    return [
        Route("/v1/runs/{run_id:path}", get_run, methods=["GET"]),
        Route("/v1/audit", get_audit, methods=["GET"]),
        Route(ADMIN_ROUTES[0], post_release, methods=["POST"]),
        Route(ADMIN_ROUTES[1], post_forget, methods=["POST"]),
        Route(ADMIN_ROUTES[2], post_outbox_retry, methods=["POST"]),
        Route(ADMIN_ROUTES[3], post_outbox_skip, methods=["POST"]),
        Route(ADMIN_ROUTES[4], post_approve, methods=["POST"]),
        Route(ADMIN_ROUTES[5], post_reject, methods=["POST"]),
        Route("/v1/outbox/parked", get_parked, methods=["GET"]),
    ]

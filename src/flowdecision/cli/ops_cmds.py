"""``list``, ``release``, ``forget``, ``approve``, ``reject`` and ``audit``: finding
decisions and acting on them.

The same queries as ``GET /v1/decisions`` (:class:`~flowdecision.ledger.query.DecisionQuery`);
every action takes an actor and a reason and is written to the ledger's audit
trail in the action's own transaction. An action by query (no ids given) first
prints how many decisions it would touch and does nothing without ``--yes``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import getpass
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import click

from ..core.defaults import default_ledger_url, default_outbox_url, default_sink_url
from ..core.dispatcher import DEFAULT_LEASE_MS, Dispatcher
from ..errors import FlowDecisionError, InvalidArgumentError
from ..ledger import Ledger, open_ledger
from ..ledger.query import (
    DEFAULT_PAGE_LIMIT,
    MAX_PAGE_LIMIT,
    AuditQuery,
    DecisionPage,
    DecisionQuery,
    DecisionRow,
    TimeField,
)
from ..ledger.states import AuditEntry, DecisionState, RunState, RunStatus
from ..observability.redact import printable
from ..sinks.loader import close_sink, open_sink
from ..store.chain import ChainReport
from .common import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    emit_json,
    fail,
    json_option,
    ledger_option,
    parse_duration_ms,
    report_chain,
    run,
    table,
)

STATES = [state.value for state in DecisionState]
TIME_FIELDS = [field.value for field in TimeField]


def parse_time_ms(text: str | None, now_ms: int, name: str) -> int | None:
    """A time option: epoch milliseconds, an ISO-8601 time, or an age (``1h``: an hour ago)."""
    if text is None:
        return None
    value = text.strip()
    if value.isdigit():
        return int(value)
    if value and value[-1] in "smhdw" and value[:-1].rstrip("m").strip().isdigit():
        return max(now_ms - parse_duration_ms(value), 0)
    try:
        moment = _dt.datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            f"`{text}` is not a time: give epoch milliseconds, an ISO-8601 time "
            "(2026-01-31T12:00:00+00:00) or an age (30m, 1h, 7d: that long ago)",
            param_hint=f"--{name}",
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=_dt.UTC)
    return max(int(moment.timestamp() * 1000), 0)


def default_actor() -> str:
    """``user@host``: who runs the command, when ``--actor`` is not given."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def query_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """The query options ``list``, ``release`` and ``forget`` share."""
    for option in reversed(
        [
            click.option("--run", "run_id", help="Only this run's decisions."),
            click.option(
                "--state", type=click.Choice(STATES), help="Only decisions in this state."
            ),
            click.option(
                "--after",
                help="At or after this time (epoch ms, ISO-8601, or 1h): first claimed, or "
                "completed with --by completed.",
            ),
            click.option(
                "--before",
                help="Before this time (epoch ms, ISO-8601, or 1h): first claimed, or "
                "completed with --by completed.",
            ),
            click.option(
                "--by",
                type=click.Choice(TIME_FIELDS),
                help="The time --after/--before filter on and pages are ordered by: claimed "
                "(first claimed; the default) or completed (completed and tombstoned only).",
            ),
        ]
    ):
        function = option(function)
    return function


def _query(
    ledger: Ledger,
    run_id: str | None,
    state: str | None,
    after: str | None,
    before: str | None,
    by: str | None,
    cursor: str | None = None,
    limit: int = DEFAULT_PAGE_LIMIT,
) -> DecisionQuery:
    now = ledger.now_ms()
    try:
        return DecisionQuery(
            run_id=run_id,
            state=None if state is None else DecisionState(state),
            after_ms=parse_time_ms(after, now, "after"),
            before_ms=parse_time_ms(before, now, "before"),
            cursor=cursor,
            limit=limit,
            by=TimeField(by or TimeField.CLAIMED),
        )
    except InvalidArgumentError as error:
        raise click.UsageError(str(error)) from None


def describe_run(run_state: RunState) -> str:
    """One line for a run's state: ``run R: closed by D (complete) at MS``."""
    name = printable(run_state.run_id)
    terminal = printable(run_state.terminal_decision_id or "")
    kind = run_state.terminal_kind
    if run_state.status is RunStatus.CLOSED:
        return f"run {name}: closed by {terminal} ({kind}) at {run_state.closed_at_ms}"
    if run_state.status is RunStatus.CLOSING:
        return f"run {name}: closing: {terminal} ({kind}) claimed, not yet completed"
    return f"run {name}: open"


def _rows_table(rows: tuple[DecisionRow, ...]) -> str:
    def when(row: DecisionRow) -> object:
        if row.lease_expires_at_ms is not None:
            return f"lease {row.lease_expires_at_ms}"
        if row.state is DecisionState.HELD:
            return f"hold until {row.hold_expires_at_ms or 'acted on'}"
        return "" if row.completed_at_ms is None else f"done {row.completed_at_ms}"

    return table(
        ["decision_id", "state", "attempts", "created_at_ms", "lease/completion", "run_id"],
        [
            (
                printable(row.decision_id),
                row.state.value,
                row.attempts,
                row.created_at_ms,
                when(row),
                printable(row.run_id or "-"),
            )
            for row in rows
        ],
    )


@click.command("list")
@ledger_option
@query_options
@click.option("--cursor", help="Continue after the page that printed this cursor.")
@click.option(
    "--limit",
    type=click.IntRange(1, MAX_PAGE_LIMIT),
    default=DEFAULT_PAGE_LIMIT,
    show_default=True,
    help="Decisions per page.",
)
@click.option("--count", "with_count", is_flag=True, help="Also count every match.")
@json_option
def list_cmd(
    ledger_url: str,
    run_id: str | None,
    state: str | None,
    after: str | None,
    before: str | None,
    by: str | None,
    cursor: str | None,
    limit: int,
    with_count: bool,
    as_json: bool,
) -> None:
    """List decisions by run, state and age, a page at a time (first claimed first).

    A run's decisions come in the order they were first claimed; with ``--by
    completed``, completed and tombstoned decisions in the order they completed.
    With ``--run`` the first line is the run's state (open, closing or closed,
    by which decision, when; ``--json``: its ``run`` member, as ``GET
    /v1/runs/{id}``). The last line names the cursor of the next page. Reads
    only: a missing ledger exits 4.
    """

    async def go() -> tuple[DecisionPage, int | None, RunState | None]:
        ledger = await open_ledger(ledger_url, create=False)
        try:
            query = _query(ledger, run_id, state, after, before, by, cursor, limit)
            page = await ledger.list_decisions(query)
            count = await ledger.count_decisions(query) if with_count else None
            run_state = None if run_id is None else await ledger.run_state(run_id)
            return page, count, run_state
        finally:
            await ledger.close()

    page, count, run_state = run(go)
    if as_json:
        body: dict[str, Any] = dataclasses.replace(page, run=run_state).to_dict()
        if count is not None:
            body["count"] = count
        emit_json(body)
        return
    if run_state is not None:
        click.echo(describe_run(run_state))
    if page.decisions:
        click.echo(_rows_table(page.decisions))
    else:
        click.echo("no decisions match")
    if count is not None:
        click.echo(f"{count} decision(s) match")
    if page.next_cursor is not None:
        click.echo(f"next page: --cursor {page.next_cursor}")


#: One action on one decision, given the open ledger: ``(audit entry, approval)``.
Action = Callable[[Ledger, str, str, str], Awaitable[tuple[AuditEntry | None, Any]]]


async def _ledger_action(name: str, ledger: Ledger, decision_id: str, who: str, why: str) -> Any:
    if name == "release":
        return await ledger.operator_release(decision_id, actor=who, reason=why), None
    if name == "reject":
        return await ledger.reject(decision_id, actor=who, reason=why), None
    return await ledger.forget(decision_id, actor=who, reason=why), None


def _act(
    name: str,
    ledger_url: str,
    decision_ids: tuple[str, ...],
    filters: tuple[str | None, str | None, str | None, str | None, str | None],
    actor: str | None,
    reason: str,
    yes: bool,
    as_json: bool,
    allowed: set[DecisionState],
    action: Action | None = None,
    cleanup: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run one action on the given ids, or on every decision a query selects
    (``action``: how, given the open ledger; the ledger's own action by default;
    ``cleanup``: run before the ledger closes)."""
    by_query = any(value is not None for value in filters)
    if decision_ids and by_query:
        fail(
            "give decision ids or query options (--run/--state/--after/--before/--by), not both",
            EXIT_USAGE,
        )
    if not decision_ids and not by_query:
        fail(f"name the decisions to {name}: ids, or query options with --yes", EXIT_USAGE)
    who = actor or default_actor()
    done: list[AuditEntry] = []
    outcomes: list[Any] = []
    refused: list[dict[str, str]] = []

    async def act(ledger: Ledger, decision_id: str) -> None:
        try:
            if action is None:
                entry, outcome = await _ledger_action(name, ledger, decision_id, who, reason)
            else:
                entry, outcome = await action(ledger, decision_id, who, reason)
        except FlowDecisionError as error:
            if not by_query and len(decision_ids) == 1:
                raise
            refused.append({"decision_id": decision_id, "error": str(error)})
            return
        if entry is not None:
            done.append(entry)
        if outcome is not None:
            outcomes.append(outcome)

    async def go() -> int | None:
        ledger = await open_ledger(ledger_url, create=False)
        try:
            if not by_query:
                for decision_id in decision_ids:
                    await act(ledger, decision_id)
                return None
            query = _query(ledger, *filters, limit=MAX_PAGE_LIMIT)
            matching = await ledger.count_decisions(query)
            if not yes:
                return matching
            # Keyset order is by first-claim or completion time, which actions never
            # change (forget deletes the row): paging on while acting neither repeats
            # nor skips a decision.
            cursor = None
            while True:
                page = await ledger.list_decisions(query.next_page(cursor))
                for row in page.decisions:
                    if row.state in allowed:
                        await act(ledger, row.decision_id)
                    else:  # listed, so a bulk action never skips a match silently
                        refused.append(
                            {
                                "decision_id": row.decision_id,
                                "error": f"it is {row.state.value}; {name} takes "
                                + " or ".join(sorted(state.value for state in allowed)),
                            }
                        )
                cursor = page.next_cursor
                if cursor is None:
                    return None
        finally:
            try:
                if cleanup is not None:
                    await cleanup()
            finally:
                await ledger.close()

    preview = run(go)
    if preview is not None:
        message = (
            f"{preview} decision(s) match; nothing was done. Run again with --yes to {name} them."
        )
        if as_json:
            emit_json({"action": name, "matching": preview, "done": False})
        else:
            click.echo(message)
        raise SystemExit(EXIT_USAGE)
    if as_json:
        body: dict[str, Any] = {
            "action": name,
            "audit": [entry.to_dict() for entry in done],
            "refused": refused,
        }
        if name == "approve":
            body["outcomes"] = [outcome.to_dict() for outcome in outcomes]
        emit_json(body)
        if refused:
            raise SystemExit(EXIT_NOT_FOUND)
        return
    past = {
        "release": "released",
        "forget": "forgot",
        "approve": "approved",
        "reject": "rejected",
    }[name]
    for entry in done:
        click.echo(
            f"{past} `{printable(entry.decision_id)}` (was {entry.state_before}, attempts "
            f"{entry.attempts}); audit #{entry.seq}"
        )
    for outcome in outcomes:
        dispatch = outcome.dispatch
        if outcome.audit is None:  # an earlier approval delivered it
            click.echo(
                f"`{printable(dispatch.decision_id)}` was already approved and delivered "
                f"(attempt {dispatch.attempt})"
            )
    for item in refused:
        click.echo(f"not {past} `{printable(item['decision_id'])}`: {item['error']}", err=True)
    if refused:
        raise SystemExit(EXIT_NOT_FOUND)  # refused, as a single id's refusal exits


def _action_options(function: Callable[..., Any], reason_help: str) -> Callable[..., Any]:
    """The options every action command takes (ids or a query, actor, reason, --yes)."""
    options: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
        ledger_option,
        click.argument("decision_ids", nargs=-1),
        query_options,
        click.option("--actor", help="Who acts, for the audit trail (default: user@host)."),
        click.option("--reason", required=True, help=reason_help),
        click.option(
            "--yes",
            is_flag=True,
            help="Act on every decision the query selects (else: count only).",
        ),
        json_option,
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _action_command(
    name: str, reason_help: str, allowed: set[DecisionState], doc: str
) -> click.Command:
    """The ``release``, ``forget`` or ``reject`` command: the same options, one action."""

    def command(**options: Any) -> None:
        _act_with(name, options, allowed)

    return click.command(name, help=doc)(_action_options(command, reason_help))


def _act_with(
    name: str,
    options: dict[str, Any],
    allowed: set[DecisionState],
    action: Action | None = None,
    cleanup: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """:func:`_act` with the options :func:`_action_options` parsed. A query of an
    action that takes one state only (approve and reject: ``held``) selects that
    state unless told otherwise: a run's completed steps are no matches to refuse."""
    if (
        len(allowed) == 1
        and options["state"] is None
        and (options["run_id"] or options["after"] or options["before"] or options["by"])
    ):
        options = {**options, "state": next(iter(allowed)).value}
    filters = tuple(options[key] for key in ("run_id", "state", "after", "before", "by"))
    _act(
        name, options["ledger_url"], options["decision_ids"], filters,
        options["actor"], options["reason"], options["yes"], options["as_json"], allowed,
        action, cleanup,
    )  # fmt: skip


release_cmd = _action_command(
    "release",
    "Why, for the audit trail.",
    {DecisionState.PENDING_LIVE, DecisionState.PENDING_EXPIRED},
    """Release pending claims (live or expired) so the next caller takes them now.

    Fenced: the attempt count (the fencing token) is bumped, so the old owner
    can never complete. Each release is audited (``flowdecision audit``).
    """,
)

reject_cmd = _action_command(
    "reject",
    "Why, for the audit trail.",
    {DecisionState.HELD},
    """Reject held decisions (approval holds): they are never sent, and answered
    ``rejected`` from then on; if the policy that held one said so, its run closes.

    A query (``--run``, ``--after``...) selects held decisions (unless
    ``--state`` names another state: those are listed as refused). Each one is
    audited.
    """,
)


def _approve(sink_url: str | None, lease_ms: int, **options: Any) -> None:
    """Approve held decisions (approval holds): each is dispatched to the sink exactly once.

    On the default layout (the outbox in the ledger's store) the approval, the
    claim and the outbox row are one transaction; with another sink the
    approval claims the decision (audited), the sink runs, and completion
    follows, and approving again after a crash takes over once the lease
    expires. A query (``--run``, ``--after``...) selects held decisions. Each
    approval is audited.
    """
    ledger_url = options["ledger_url"]
    # Where `serve` would deliver with this ledger: the default layout's outbox by default.
    target = sink_url or (
        default_outbox_url() if ledger_url == default_ledger_url() else default_sink_url(ledger_url)
    )
    approvers: list[Dispatcher] = []

    async def approve(ledger: Ledger, decision_id: str, who: str, why: str) -> Any:
        if not approvers:  # one sink and dispatcher for every approval of this command
            sink = await open_sink(target)
            approvers.append(Dispatcher("production", sink, ledger, lease_ms=lease_ms))
        outcome = await approvers[0].approve(decision_id, actor=who, reason=why)
        return outcome.audit, outcome

    async def cleanup() -> None:
        for dispatcher in approvers:
            await close_sink(dispatcher.sink)

    _act_with("approve", options, {DecisionState.HELD}, approve, cleanup)


approve_cmd = click.command("approve", help=_approve.__doc__)(
    click.option(
        "--sink",
        "sink_url",
        envvar="FLOWDECISION_SINK",
        help="Where approved decisions go: a sink URL (default: where `serve` delivers with "
        "this ledger: the default layout's outbox, or the ledger's own store).",
    )(
        click.option(
            "--lease-ms",
            type=click.IntRange(min=1),
            default=DEFAULT_LEASE_MS,
            show_default=True,
            help="The lease a non-joint sink runs under.",
        )(_action_options(_approve, "Why, for the audit trail."))
    )
)

forget_cmd = _action_command(
    "forget",
    "Why the id may be used again (audited).",
    {DecisionState.COMPLETED, DecisionState.TOMBSTONED},
    """Delete completed decisions or tombstones so their ids can be submitted again.

    Pending claims are refused (release them first). Each one is audited.
    """,
)


@click.command("audit")
@ledger_option
@click.option("--decision", "decision_id", help="Only this decision's entries.")
@click.option("--after", help="At or after this time (epoch ms, ISO-8601, or 1h).")
@click.option("--before", help="Before this time (epoch ms, ISO-8601, or 1h).")
@click.option("--cursor", help="Continue after the page that printed this cursor.")
@click.option(
    "--limit", type=click.IntRange(1, MAX_PAGE_LIMIT), default=DEFAULT_PAGE_LIMIT, show_default=True
)
@click.option(
    "--verify",
    is_flag=True,
    help="Recompute the trail's hash chain instead of listing it; exit 7 naming the first "
    "row that does not match (docs/OPERATIONS.md).",
)
@json_option
def audit_cmd(
    ledger_url: str,
    decision_id: str | None,
    after: str | None,
    before: str | None,
    cursor: str | None,
    limit: int,
    verify: bool,
    as_json: bool,
) -> None:
    """Show the audit trail of operator actions (who released or forgot what, when, why).

    With --verify, recompute its hash chain (every row carries the hash of the row
    before it) and name the first row that does not match (exit 7).
    """
    if verify:

        async def check() -> ChainReport:
            ledger = await open_ledger(ledger_url, create=False)
            try:
                return await ledger.verify_audit()
            finally:
                await ledger.close()

        report_chain(run(check), "ledger audit trail", as_json)
        return

    async def go() -> Any:
        ledger = await open_ledger(ledger_url, create=False)
        try:
            now = ledger.now_ms()
            query = AuditQuery(
                decision_id=decision_id,
                after_ms=parse_time_ms(after, now, "after"),
                before_ms=parse_time_ms(before, now, "before"),
                cursor=cursor,
                limit=limit,
            )
            return await ledger.audit(query)
        finally:
            await ledger.close()

    page = run(go)
    if as_json:
        emit_json(page.to_dict())
        return
    if not page.entries:
        click.echo("no audit entries")
    else:
        click.echo(
            table(
                ["seq", "at_ms", "action", "decision_id", "actor", "reason", "was"],
                [
                    (
                        entry.seq,
                        entry.at_ms,
                        entry.action,
                        printable(entry.decision_id),
                        printable(entry.actor),
                        printable(entry.reason),
                        entry.state_before,
                    )
                    for entry in page.entries
                ],
            )
        )
    if page.next_cursor is not None:
        click.echo(f"next page: --cursor {page.next_cursor}")

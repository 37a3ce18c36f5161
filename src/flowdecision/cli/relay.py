"""``relay`` (drain an outbox into a sink) and ``outbox cursors`` (see and move relay cursors)."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..core.defaults import DEFAULT_STORE_URL, LEGACY_OUTBOX_URL
from ..errors import FlowDecisionError, SinkConfigError
from ..observability.redact import printable
from ..store.chain import ChainReport
from .common import EXIT_STORE_MISSING, EXIT_USAGE, fail, report_chain, run, table

if TYPE_CHECKING:
    from ..sinks.relay import RelayStatus

__all__ = [
    "EXIT_PARKED",
    "cursors_cmd",
    "outbox_audit_cmd",
    "parked_cmd",
    "relay_cmd",
    "retry_cmd",
    "skip_cmd",
]

#: ``relay --once``: rows are left parked (their sink refused them; see ``outbox parked``).
EXIT_PARKED = 5

_FROM_HELP = (
    "Outbox URL: sqlite:///path or postgresql://...  [default: serve's default store, "
    f"{DEFAULT_STORE_URL}, or {LEGACY_OUTBOX_URL} where the old two-file layout is kept]"
)


def _outbox_url(url: str | None) -> str:
    """The outbox to read: ``url`` or the default, refused unless it is an existing outbox.

    A SQLite outbox that does not exist is reported (exit 4) rather than created
    empty: a relay on a mistyped path would otherwise wait forever. An existing
    one is opened normally, so an older schema is upgraded in place.
    """
    from ..connections.urls import sqlite_path
    from ..core.defaults import default_outbox_url
    from ..sinks.loader import sink_kind

    url = url or default_outbox_url()
    try:
        kind = sink_kind(url)
    except FlowDecisionError as error:
        fail(error, EXIT_USAGE)
    if kind != "outbox":
        fail(f"`{url}` is not an outbox (sqlite:/// or postgresql://)", EXIT_USAGE)
    if url.lower().startswith("sqlite:"):
        path = Path(sqlite_path(url, what="outbox", error=FlowDecisionError))
        if not path.exists():
            fail(f"outbox `{path}` does not exist (nothing was created)", EXIT_STORE_MISSING)
    return url


@click.command("relay")
@click.option("--from", "from_url", default=None, envvar="FLOWDECISION_RELAY_FROM",
              allow_from_autoenv=False, help=_FROM_HELP)  # fmt: skip
@click.option("--to", "to_url", required=True, envvar="FLOWDECISION_RELAY_TO",
              allow_from_autoenv=False,
              help="Sink URL: any sink serve takes (http(s)://, python:module:attr, "
              "procrastinate+…, dbos+…, temporal://…, restate+http://…).")  # fmt: skip
@click.option("--name", default="default", show_default=True,
              help="The relay's name: its durable cursor in the outbox. Relays with "
              "different names each get every row; one name delivers from one process "
              "at a time.")  # fmt: skip
@click.option("--concurrency", type=click.IntRange(1, 1000), default=32, show_default=True,
              envvar="FLOWDECISION_RELAY_CONCURRENCY", allow_from_autoenv=False,
              help="Runs delivered at once; each run's rows go one at a time, in seq "
              "order. 1: one row at a time, in seq order.")  # fmt: skip
@click.option("--batch", type=click.IntRange(1, 10_000), default=200, show_default=True,
              help="Rows read from the outbox at a time.")  # fmt: skip
@click.option("--window", type=click.IntRange(1, 100_000), default=None,
              help="Rows the relay may read past its saved cursor: a relay killed at any "
              "point delivers at most this many rows again.  [default: max(batch, 32 × "
              "concurrency)]")  # fmt: skip
@click.option("--lease-ms", type=click.IntRange(min=100), default=15_000, show_default=True,
              help="The cursor's lease: how soon another relay of this name takes over "
              "after this one dies.")  # fmt: skip
@click.option("--retry-cap-s", type=click.FloatRange(min=0.01), default=10.0, show_default=True,
              help="Longest pause between retries of a failed delivery.")  # fmt: skip
@click.option("--poll-max-s", type=click.FloatRange(min=0.005), default=0.25, show_default=True,
              help="SQLite: longest pause between polls for rows other processes "
              "wrote (PostgreSQL is woken by LISTEN/NOTIFY).")  # fmt: skip
@click.option("--once", is_flag=True,
              help="Deliver what is deliverable now, then exit: 0, or 5 when rows are "
              "left parked.")  # fmt: skip
@click.option("--otel/--no-otel", default=False, envvar="FLOWDECISION_OTEL",
              allow_from_autoenv=False, show_default=True,
              help="Export OpenTelemetry traces over OTLP (the standard OTEL_* "
              "variables; needs the `otel` extra): each delivery continues its row's "
              "stored trace.")  # fmt: skip
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))  # fmt: skip
def relay_cmd(
    from_url: str | None,
    to_url: str,
    name: str,
    concurrency: int,
    batch: int,
    window: int | None,
    lease_ms: int,
    retry_cap_s: float,
    poll_max_s: float,
    once: bool,
    otel: bool,
    log_level: str,
) -> None:
    """Deliver an outbox's rows to a sink, each run's rows in seq order, at least once.

    Different runs are delivered concurrently (--concurrency). The relay's cursor
    lives in the outbox's store and only passes rows the sink accepted or that
    were parked; the sink's dedup on the decision id makes the effect exactly
    once. Transient failures are retried with backoff; a row the sink refuses for
    good is parked with its run's later rows held behind it (`outbox parked`,
    `outbox retry`, `outbox skip`). An engine that is down at start is waited
    for. SIGTERM or Ctrl-C stop it cleanly (its lease is released for the next
    relay).
    """
    from ..service.logs import configure_logging
    from ..sinks.loader import check_sink_url
    from ..sinks.outbox import OutboxSink
    from ..sinks.relay import OutboxRelay

    outbox_url = _outbox_url(from_url)
    try:
        check_sink_url(to_url)
        if otel:
            from ..observability.tracing import sdk_problem

            problem = sdk_problem()
            if problem is not None:
                raise SinkConfigError(problem)
    except FlowDecisionError as error:
        fail(error, EXIT_USAGE)
    configure_logging(log_level)
    stop_tracing = None
    if otel:
        from ..observability.tracing import start_sdk

        stop_tracing = start_sdk()

    async def go() -> RelayStatus:
        relay = OutboxRelay(
            OutboxSink(outbox_url, poll_max_s=poll_max_s),
            to_url,
            name=name,
            batch=batch,
            concurrency=concurrency,
            window=window,
            lease_ms=lease_ms,
            retry_cap_s=retry_cap_s,
        )
        assert relay.outbox is not None
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, relay.stop)
        try:
            async with relay.outbox:
                click.echo(
                    f"flowdecision relay `{name}` ({relay.owner}) delivering to {_shown(to_url)}"
                    f" ({concurrency} at a time)",
                    err=True,
                )
                if once:
                    await relay.drain()
                else:
                    await relay.run()
                await relay.refresh()
        finally:
            await relay.close()
        return relay.status()

    try:
        status = run(go)
    finally:
        if stop_tracing is not None:
            stop_tracing()
    click.echo(
        f"delivered {status.delivered} rows; parked {status.parked_rows} "
        f"(and {status.held_rows} held behind them); lag {status.lag_rows} rows",
        err=True,
    )
    click.echo(json.dumps(status.to_dict(), separators=(",", ":")), err=True)
    if once and status.parked_rows:
        sys.exit(EXIT_PARKED)


def _shown(url: str) -> str:
    from ..connections.urls import redact_url

    return redact_url(url)


@click.command("cursors")
@click.option("--sink", "sink_url", default=None, envvar="FLOWDECISION_SINK",
              allow_from_autoenv=False, help=_FROM_HELP)  # fmt: skip
@click.option("--set", "set_to", nargs=2, type=(str, click.IntRange(min=0)), default=None,
              metavar="NAME SEQ",
              help="Move relay NAME's cursor to SEQ (its next row is SEQ+1). Refused "
              "while a relay of that name is running.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def cursors_cmd(sink_url: str | None, set_to: tuple[str, int] | None, as_json: bool) -> None:
    """List the relay cursors of an outbox with their lag (or move one with --set)."""
    from ..sinks.outbox import OutboxSink

    url = _outbox_url(sink_url)

    async def go() -> list[Any]:
        async with OutboxSink(url) as outbox:
            if set_to is not None:
                await outbox.set_cursor(*set_to)
            return await outbox.cursors()

    states = run(go)
    if as_json:
        click.echo(json.dumps([state.to_dict() for state in states], indent=2))
        return
    if not states:
        click.echo("no relay cursors yet", err=True)
        return
    rows = [
        (s.name, s.position, s.head_seq, s.lag_rows, f"{s.lag_seconds:.1f}",
         s.owner if s.leased else "-", s.delivered)
        for s in states
    ]  # fmt: skip
    headers = ["name", "position", "head", "lag_rows", "lag_s", "leased_by", "delivered"]
    click.echo(table(headers, rows))
    sys.stdout.flush()


_RELAY_NAME = click.option(
    "--name", "relay", default="default", show_default=True, help="The relay that parked the row."
)
_SINK_OPTION = click.option(
    "--sink", "sink_url", default=None, envvar="FLOWDECISION_SINK", allow_from_autoenv=False,
    help=_FROM_HELP,
)  # fmt: skip


@click.command("parked")
@_SINK_OPTION
@click.option("--name", "relay", default=None, help="Only this relay's rows.  [default: all]")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def parked_cmd(sink_url: str | None, relay: str | None, as_json: bool) -> None:
    """List the rows relays parked (their sink refused them for good) and the rows held
    behind them, which wait until the parked row is retried or skipped."""

    rows = _read_outbox(sink_url, lambda outbox: outbox.parked(relay))
    shown = [
        (r.relay, r.seq, printable(r.decision_id), printable(r.run_id), r.state, r.attempts,
         printable((r.error or "-")[:80]))
        for r in rows
    ]  # fmt: skip
    headers = ["relay", "seq", "decision", "run", "state", "attempts", "error"]
    _listing(as_json, "parked", rows, "no row is parked", headers, shown)


def _read_outbox(sink_url: str | None, read: Any) -> list[Any]:
    """``await read(outbox)`` on the outbox ``sink_url`` names (it must exist)."""
    from ..sinks.outbox import OutboxSink

    url = _outbox_url(sink_url)

    async def go() -> list[Any]:
        async with OutboxSink(url) as outbox:
            result: list[Any] = await read(outbox)
            return result

    return run(go)


def _listing(
    as_json: bool, key: str, items: list[Any], empty: str, headers: list[str], shown: list[Any]
) -> None:
    """``{key: [item.to_dict(), ...]}`` with ``--json``, else a table (or ``empty``)."""
    if as_json:
        click.echo(json.dumps({key: [item.to_dict() for item in items]}, indent=2))
    elif not items:
        click.echo(empty, err=True)
    else:
        click.echo(table(headers, shown))


def _parked_action(action: str, help_text: str) -> click.Command:
    @click.command(action, help=help_text)
    @click.argument("decision_id")
    @_SINK_OPTION
    @_RELAY_NAME
    @click.option("--actor", help="Who acts, for the audit trail (default: user@host).")
    @click.option("--reason", required=True, help="Why, for the audit trail.")
    @click.option("--json", "as_json", is_flag=True, help="Print the audit entry as JSON.")
    def command(
        decision_id: str,
        sink_url: str | None,
        relay: str,
        actor: str | None,
        reason: str,
        as_json: bool,
    ) -> None:
        from ..sinks.outbox import OutboxSink
        from .ops_cmds import default_actor

        url = _outbox_url(sink_url)

        async def go() -> Any:
            async with OutboxSink(url) as outbox:
                return await outbox.act_on_parked(
                    relay, action, decision_id, actor=actor or default_actor(), reason=reason
                )

        entry = run(go)
        if as_json:
            click.echo(json.dumps(entry.to_dict(), indent=2))
            return
        done = {"retry": "released for delivery", "skip": "skipped"}[action]
        click.echo(f"{printable(decision_id)} {done} (relay `{relay}`, audit seq {entry.seq})")

    return command


retry_cmd = _parked_action(
    "retry",
    "Deliver a parked row again: the relay sends it next in its run (then the run's held "
    "rows). Audited in the outbox (`outbox audit`).",
)
skip_cmd = _parked_action(
    "skip",
    "Drop a parked row: it is never delivered, and its run goes on with its next row. "
    "Audited in the outbox (`outbox audit`).",
)


@click.command("audit")
@_SINK_OPTION
@click.option("--name", "relay", default=None, help="Only this relay's actions.  [default: all]")
@click.option(
    "--verify",
    is_flag=True,
    help="Recompute the trail's hash chain (every relay's rows) instead of listing it; exit 7 "
    "naming the first row that does not match (docs/OPERATIONS.md).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def outbox_audit_cmd(sink_url: str | None, relay: str | None, verify: bool, as_json: bool) -> None:
    """The outbox's audit trail: operator retries and skips of parked rows, oldest first.

    With --verify, recompute its hash chain and name the first row that does not
    match (exit 7).
    """
    if verify:
        from ..sinks.outbox import OutboxSink

        async def check() -> ChainReport:
            async with OutboxSink(_outbox_url(sink_url)) as outbox:
                return await outbox.verify_audit()

        report_chain(run(check), "outbox audit trail", as_json)
        return
    entries = _read_outbox(sink_url, lambda outbox: outbox.audit(relay))
    shown = [
        (e.seq, e.at_ms, e.relay, e.action, printable(e.decision_id), printable(e.actor),
         printable(e.reason[:60]))
        for e in entries
    ]  # fmt: skip
    headers = ["seq", "at_ms", "relay", "action", "decision", "actor", "reason"]
    _listing(as_json, "entries", entries, "no action on a parked row yet", headers, shown)

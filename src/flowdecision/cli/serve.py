"""``serve`` (the HTTP decision service) and ``outbox tail`` (read an outbox in order)."""

from __future__ import annotations

import asyncio
import datetime
import sys
from collections.abc import Callable
from typing import Any

import click

from ..core.defaults import DEFAULT_STORE_URL, LEGACY_OUTBOX_URL, LOG_LEVELS
from ..core.limits import OUTBOX_FETCH_MAX
from ..errors import FlowDecisionError
from ..sinks.loader import SINK_SCHEMES
from .common import EXIT_ERROR, EXIT_USAGE, fail, run, table

__all__ = ["outbox", "serve_cmd"]


def _flag(*names: str, **kwargs: Any) -> Callable[[Any], Any]:
    """A flag whose absence means "not given" (so env and TOML settings apply)."""
    kwargs.setdefault("default", None)
    return click.option(*names, allow_from_autoenv=False, **kwargs)


@click.command("serve")
@_flag("--config", "config_file", type=click.Path(dir_okay=False), help="TOML settings file.")
@_flag("--host", help="Address to listen on.  [default: 127.0.0.1]")
@_flag("--port", type=int, help="Port to listen on (0 picks a free one).  [default: 8080]")
@_flag("--ledger", help=f"Ledger URL.  [default: {DEFAULT_STORE_URL}]")
@_flag(
    "--sink",
    help="Sink URL, one of: " + ", ".join(SINK_SCHEMES) + " (the first two are an outbox, "
    "http(s) a webhook; docs/SINKS.md).  [default: the ledger's own SQLite or PostgreSQL store "
    f"(one transaction per decision); {LEGACY_OUTBOX_URL} for other ledgers]",
)
@_flag("--production-branch", help="The branch allowed to submit.  [default: production]")
@_flag("--lease-ms", type=int, help="Claim lease in milliseconds.  [default: 30000]")
@_flag("--max-body-bytes", type=int, help="Request size limit.  [default: 2097152]")
@_flag(
    "--lossy-numbers/--no-lossy-numbers",
    help="Round numbers JSON cannot keep exactly, as the Rust original does, "
    "instead of answering 422.  [default: off]",
)
@_flag("--token-file", type=click.Path(dir_okay=False), help="File of accepted bearer tokens.")
@_flag("--auth-healthz/--no-auth-healthz", help="Require the token on /healthz too.")
@_flag("--allow-no-auth/--no-allow-no-auth", help="Allow no token on a non-loopback address.")
@_flag("--shutdown-grace-s", type=float, help="Grace period for in-flight work.  [default: 10]")
@_flag("--recent-limit", type=int, help="Decisions listed on the status page.  [default: 50]")
@_flag("--status-refresh-s", type=int, help="Status page refresh interval.  [default: 5]")
@_flag("--webhook-timeout-s", type=float, help="Webhook request timeout.  [default: 10]")
@_flag("--webhook-max-attempts", type=int, help="Webhook tries per delivery.  [default: 4]")
@_flag("--log-level", help=f"{', '.join(LOG_LEVELS)}.  [default: info]")
@_flag("--access-log/--no-access-log", help="Write a structured access log.  [default: on]")
@_flag(
    "--outage-summary-s",
    type=float,
    help="While a store is down, seconds between summary log lines.  [default: 30]",
)
@_flag(
    "--allowed-origins", help="Comma-separated browser origins allowed to call.  [default: none]"
)
@_flag("--allowed-hosts", help="Comma-separated extra Host names accepted.  [default: none]")
@_flag("--header-timeout-s", type=float, help="Time to send request headers.  [default: 10]")
@_flag("--body-timeout-s", type=float, help="Time to send a request body.  [default: 30]")
@_flag("--keep-alive-timeout-s", type=float, help="Idle keep-alive timeout.  [default: 5]")
@_flag(
    "--max-body-values",
    type=int,
    help="The most JSON values and containers a decision body may hold (413 above; counted "
    "before parsing).  [default: 20000]",
)
@_flag("--max-connections", type=int, help="Open connection cap.  [default: 1000]")
@_flag(
    "--write-timeout-s",
    type=float,
    help="Drop a connection whose client stops reading its answer this long.  [default: 30]",
)
@_flag(
    "--max-streams",
    type=int,
    help="Open outbox event streams and long-polls, at most (and at most half of "
    "--max-connections).  [default: 100]",
)
@_flag("--http", help="HTTP parser: auto, httptools, h11.  [default: auto]")
@_flag("--loop", help="Event loop: auto, uvloop, asyncio.  [default: auto]")
@_flag(
    "--edge",
    help="guarded: the service polices connections (timeouts, caps); plain: stock uvicorn, "
    "for a reverse proxy that does it (docs/SERVICE.md).  [default: guarded]",
)
@_flag("--workers", type=int, help="Server processes on the one port.  [default: 1]")
@_flag(
    "--otel/--no-otel",
    help="Export OpenTelemetry traces over OTLP, configured by the standard OTEL_* "
    "variables (needs the `otel` extra).  [default: off]",
)
@_flag(
    "--relay-to",
    help="Sink URL: also run an outbox relay here, delivering the outbox's rows to this "
    "sink (any sink URL).  [default: none]",
)
@_flag("--relay-name", help="The in-service relay's cursor name.  [default: default]")
@_flag(
    "--relay-concurrency",
    type=int,
    help="Runs the in-service relay delivers at once; each run's rows stay in order.  "
    "[default: 32]",
)
@_flag(
    "--admin-token-file",
    type=click.Path(dir_okay=False),
    help="File of admin tokens: release and forget over HTTP need one (never the submit "
    "token; also FLOWDECISION_ADMIN_TOKEN).  [default: none: actions refused]",
)
@_flag(
    "--keep-tombstones/--no-keep-tombstones",
    help="Prunes of this ledger keep tombstones, so dedup outlives them.  [default: off]",
)
@_flag(
    "--run-invariants/--no-run-invariants",
    help="A closed run takes no new decision, and a run has at most one complete/fail "
    "(docs/PROTOCOL.md). Never on a JSON file ledger.  [default: on]",
)
@_flag(
    "--approve-kinds",
    help="Hold decisions of these kinds for an operator's approval, comma-separated "
    "(schedule_step, schedule_steps, complete, fail; docs/PROTOCOL.md).  [default: none]",
)
@_flag(
    "--approve-steps",
    help="Hold decisions scheduling a step whose name matches one of these globs, "
    "comma-separated (e.g. 'payments.*,deploy').  [default: none]",
)
@_flag("--approve-runs", help="Hold every new decision of these runs, comma-separated.")
@_flag(
    "--hold-expire-ms",
    type=int,
    help="A hold not approved or rejected within this many ms is rejected (audited); "
    "0: never.  [default: 0]",
)
@_flag(
    "--reject-closes-run/--no-reject-closes-run",
    help="Rejecting a held decision closes its run.  [default: off]",
)
@_flag(
    "--hold-notify-url",
    help="An http(s) URL told of each new hold by a JSON POST (its bearer token: "
    "FLOWDECISION_HOLD_NOTIFY_TOKEN).  [default: none]",
)
def serve_cmd(config_file: str | None, **flags: Any) -> None:
    """Run the HTTP decision service (POST /v1/decisions, status page at /).

    Settings come from these flags, then FLOWDECISION_* environment variables,
    then the TOML file (--config or FLOWDECISION_CONFIG), then the defaults.
    The bearer token is read from FLOWDECISION_TOKEN or --token-file, never a flag.
    """
    from ..connections.urls import redact_url
    from ..service.config import MIN_TOKEN_CHARS, ConfigError, load_settings
    from ..service.logs import configure_logging
    from ..service.server import (
        bind_socket,
        check_edge,
        curl_example,
        event_loop_factory,
        http_protocol_class,
        serve,
        service_url,
    )

    try:
        settings = load_settings(flags, config_file=config_file)
        loop_factory = event_loop_factory(settings)
        http_protocol_class(settings)  # fails early when the chosen parser is missing
        check_edge(settings)  # ... or when uvicorn moved under the edge
        if settings.otel:
            from ..observability.tracing import sdk_problem

            problem = sdk_problem()
            if problem is not None:
                raise ConfigError(problem)
    except ConfigError as error:
        fail(error, EXIT_USAGE)
    configure_logging(settings.log_level)
    if settings.short_token_count():  # refused off loopback; on loopback a warning
        click.echo(
            f"warning: a bearer token is shorter than {MIN_TOKEN_CHARS} characters; "
            "use a long random one before serving beyond this machine",
            err=True,
        )
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as error:
        fail(f"cannot listen on {settings.host}:{settings.port}: {error}")

    def ready(url: str) -> None:
        click.echo(f"flowdecision serving on {url}")
        click.echo(f"  ledger {redact_url(settings.ledger)}, sink {redact_url(settings.sink)}")
        click.echo(f"  status page {url}/  health {url}/healthz  metrics {url}/metrics")
        click.echo("  try:")
        click.echo(f"    {curl_example(url, settings)}")
        sys.stdout.flush()

    if settings.workers > 1:
        from ..service.workers import prepare_stores, run_workers

        try:
            run(lambda: prepare_stores(settings))  # schema created once, errors reported once
            code = run_workers(settings, sock, lambda: ready(service_url(sock)))
        finally:
            sock.close()
        sys.exit(code)
    try:
        run(lambda: serve(settings, sock, ready), loop_factory=loop_factory)
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        sys.exit(EXIT_ERROR)
    finally:
        sock.close()


# -- outbox tail ------------------------------------------------------------------


@click.group("outbox")
def outbox() -> None:
    """Read the decisions an outbox sink accepted, in order."""


def _when(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat(
        timespec="milliseconds"
    )


@outbox.command("tail")
@click.option(
    "--sink",
    "sink_url",
    default=None,
    envvar="FLOWDECISION_SINK",
    allow_from_autoenv=False,
    help="Outbox URL: sqlite:///path or postgresql://...  [default: serve's default "
    f"store, {DEFAULT_STORE_URL}, or {LEGACY_OUTBOX_URL} "
    "where the old two-file layout is kept]",
)
@click.option("--after", type=click.IntRange(min=0), default=0, show_default=True,
              help="Start after this seq cursor.")  # fmt: skip
@click.option("--limit", type=click.IntRange(1, OUTBOX_FETCH_MAX), default=100, show_default=True,
              help="Rows per page (without --follow: rows in all).")  # fmt: skip
@click.option("--follow", "-f", is_flag=True, help="Keep polling for new rows until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between polls with --follow.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="One JSON object per row (JSON lines).")
def tail_cmd(
    sink_url: str | None, after: int, limit: int, follow: bool, interval: float, as_json: bool
) -> None:
    """Print outbox rows after a cursor; --follow keeps printing new ones.

    JSON lines carry seq, decision_id, request_hash, first_attempt,
    highest_attempt, accepted_at_ms and the request itself. Resume with
    --after <last seq>. Reads only: a missing outbox, or a database without
    outbox tables, is reported (exit 4), never created.
    """
    from ..core.defaults import default_outbox_url
    from ..sinks.outbox import parse_outbox_url

    sink_url = sink_url or default_outbox_url()
    try:
        parse_outbox_url(sink_url)  # offers only the schemes an outbox accepts
    except FlowDecisionError as error:
        fail(error, EXIT_USAGE)

    def show(entries: list[Any]) -> None:
        if as_json:
            for entry in entries:
                # The same bytes as the entry in GET /v1/outbox (OutboxEntry.to_json).
                click.echo(entry.to_json().decode("utf-8"))
        elif entries:
            rows = [
                (
                    e.seq,
                    e.decision_id,
                    e.first_attempt,
                    e.highest_attempt,
                    _when(e.accepted_at_ms),
                    e.request_hash[:16],
                )
                for e in entries
            ]
            headers = ["seq", "decision_id", "first", "highest", "accepted_at", "request_hash"]
            click.echo(table(headers, rows))
        sys.stdout.flush()

    async def go() -> None:
        from ..sinks.outbox import OutboxSink

        cursor = after
        # Read only: a missing store, or one without outbox tables, is reported (exit 4).
        async with OutboxSink(sink_url, create=False) as sink:
            while True:
                entries = await sink.fetch(after=cursor, limit=limit)
                if entries:
                    show(entries)
                    cursor = entries[-1].seq
                if not follow:
                    if not entries and not as_json:
                        click.echo(f"no outbox rows after seq {after}", err=True)
                    return
                if len(entries) < limit:
                    await asyncio.sleep(interval)

    try:
        run(go)
    except KeyboardInterrupt:
        pass

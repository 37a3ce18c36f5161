"""``relay`` (drain an outbox into a sink) and ``outbox cursors`` (see and move relay cursors)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import click

from ..defaults import DEFAULT_STORE_URL, LEGACY_OUTBOX_URL
from ..errors import FlowDecisionError
from .common import EXIT_STORE_MISSING, EXIT_USAGE, fail, run, table

__all__ = ["cursors_cmd", "relay_cmd"]

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
    from ..defaults import default_outbox_url
    from ..sinks.loader import sink_kind
    from ..store.url import sqlite_path

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
@click.option("--batch", type=click.IntRange(1, 10_000), default=200, show_default=True,
              help="Rows read (and the cursor advanced) per batch.")  # fmt: skip
@click.option("--lease-ms", type=click.IntRange(min=100), default=15_000, show_default=True,
              help="The cursor's lease: how soon another relay of this name takes over "
              "after this one dies.")  # fmt: skip
@click.option("--retry-cap-s", type=click.FloatRange(min=0.01), default=10.0, show_default=True,
              help="Longest pause between retries of a failed delivery.")  # fmt: skip
@click.option("--poll-max-s", type=click.FloatRange(min=0.005), default=0.25, show_default=True,
              help="SQLite: longest pause between polls for rows other processes "
              "wrote (PostgreSQL is woken by LISTEN/NOTIFY).")  # fmt: skip
@click.option("--once", is_flag=True, help="Deliver the rows there are now, then exit.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))  # fmt: skip
def relay_cmd(
    from_url: str | None,
    to_url: str,
    name: str,
    batch: int,
    lease_ms: int,
    retry_cap_s: float,
    poll_max_s: float,
    once: bool,
    log_level: str,
) -> None:
    """Deliver an outbox's rows to a sink, in seq order, at least once.

    The relay's cursor lives in the outbox's store and advances only after the
    sink accepted; the sink's dedup on the decision id makes the effect exactly
    once. Failed deliveries are retried with backoff until they pass. SIGTERM or
    Ctrl-C stop it cleanly (its lease is released for the next relay).
    """
    from ..service.logs import configure_logging
    from ..sinks.outbox import OutboxSink
    from ..sinks.relay import OutboxRelay

    outbox_url = _outbox_url(from_url)
    configure_logging(log_level)
    # One line per delivered row would drown the relay's own records.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))

    async def go() -> None:
        relay = OutboxRelay(
            OutboxSink(outbox_url, poll_max_s=poll_max_s),
            to_url,
            name=name,
            batch=batch,
            lease_ms=lease_ms,
            retry_cap_s=retry_cap_s,
        )
        assert relay.outbox is not None
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, relay.stop)
        try:
            async with relay.outbox:
                await relay.open()
                click.echo(
                    f"flowdecision relay `{name}` ({relay.owner}) delivering to {_shown(to_url)}",
                    err=True,
                )
                if once:
                    count = await relay.drain()
                    click.echo(f"delivered {count} rows", err=True)
                else:
                    await relay.run()
        finally:
            await relay.close()
            status = relay.status()
            click.echo(json.dumps(status.to_dict(), separators=(",", ":")), err=True)

    run(go)


def _shown(url: str) -> str:
    from ..redact import redact_url

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

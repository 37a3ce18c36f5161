"""``inspect``, ``prune`` and ``migrate``: operating a ledger."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ..connections.urls import parse_ledger_url, redact_url
from ..errors import FlowDecisionError, StoreMissingError
from ..ledger import Completed, Held, Ledger, Missing, Pending, Rejected, open_ledger
from ..ledger.base import LedgerEntry
from ..observability.redact import printable
from .common import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    emit_json,
    fail,
    json_option,
    ledger_option,
    parse_duration_ms,
    run,
    table,
)


@click.command("inspect")
@ledger_option
@click.argument("decision_id")
@click.option(
    "--request-hash",
    help="Also check the claim belongs to this request hash (a mismatch exits 3).",
)
@json_option
def inspect_cmd(ledger_url: str, decision_id: str, request_hash: str | None, as_json: bool) -> None:
    """Show one decision's claim state (never its owner).

    Reads only: a missing ledger is reported (exit 4), never created.
    """

    async def go() -> LedgerEntry | None:
        ledger = await open_ledger(ledger_url, create=False)
        try:
            return await ledger.lookup(decision_id)
        finally:
            await ledger.close()

    entry = run(go)
    if entry is not None and request_hash is not None and entry.request_hash != request_hash:
        # Not this request's claim: like a missing one, exit 3 (as --help says).
        fail(f"decision `{decision_id}` request hash conflicts with its claim", EXIT_NOT_FOUND)
    if entry is None:
        if as_json:
            emit_json({"decision_id": decision_id, **Missing().to_dict()})
        else:
            click.echo(f"decision `{printable(decision_id)}`: missing")
        sys.exit(EXIT_NOT_FOUND)
    if as_json:
        emit_json(entry.to_dict())  # GET /v1/decisions/{id}'s shape
        return
    state = entry.state
    rows: list[tuple[str, object]] = [
        ("decision_id", entry.decision_id),
        ("state", state.kind),
        ("attempts", entry.attempts),
        ("request_hash", entry.request_hash),
    ]
    if isinstance(state, Pending):
        rows.append(("lease_expires_at_ms", state.lease_expires_at_ms))
    if isinstance(state, Completed):
        rows.append(("completed_at_ms", state.completed_at_ms))
    if isinstance(state, Held):
        rows.append(("hold_expires_at_ms", state.expires_at_ms or "never"))
    if isinstance(state, Rejected):
        rows.append(("rejected_at_ms", state.rejected_at_ms))
    if entry.execution_identity is not None:
        rows.append(("identity", entry.execution_identity.digest))
    if entry.result_receipt is not None:
        rows.append(("result_digest", entry.result_receipt.result_digest))
    click.echo(table(["field", "value"], rows))


@click.command("prune")
@ledger_option
@click.option(
    "--before",
    "before_ms",
    type=click.IntRange(min=0),
    help="Prune completions before this epoch ms.",
)
@click.option("--older-than", help="Prune completions older than this age, e.g. 7d, 12h.")
@click.option(
    "--keep-tombstones",
    is_flag=True,
    help="Keep a tombstone of each pruned decision (id, request hash, attempts, completion "
    "time, receipt digest), so a late duplicate is still a duplicate.",
)
@click.option(
    "--tombstones-before",
    type=click.IntRange(min=0),
    help="Also delete tombstones of decisions completed before this epoch ms: the dedup horizon.",
)
@click.option("--tombstones-older-than", help="The same, as an age, e.g. 90d.")
@json_option
def prune_cmd(
    ledger_url: str,
    before_ms: int | None,
    older_than: str | None,
    keep_tombstones: bool,
    tombstones_before: int | None,
    tombstones_older_than: str | None,
    as_json: bool,
) -> None:
    """Remove completed records older than a cutoff (pending claims are kept).

    By default a pruned decision is gone and its id can be submitted again (the
    seed's behaviour). ``--keep-tombstones`` keeps a few dozen bytes of each, so
    dedup outlives pruning until ``--tombstones-before`` removes them. A
    missing ledger is reported (exit 4), never created.
    """
    records = before_ms is not None or older_than is not None
    tombstones = tombstones_before is not None or tombstones_older_than is not None
    if (before_ms is not None and older_than is not None) or (
        tombstones_before is not None and tombstones_older_than is not None
    ):
        fail("give a cutoff once: --before or --older-than, --tombstones-before or "
             "--tombstones-older-than", EXIT_USAGE)  # fmt: skip
    if not records and not tombstones:
        fail("give exactly one of --before MS or --older-than AGE", EXIT_USAGE)

    def show(total: int) -> None:
        # A live counter on stderr, one update per committed batch (scripts read stdout).
        if not as_json:
            click.echo(f"\rpruning... {total} removed", nl=False, err=True)

    def cutoff_of(ms: int | None, age: str | None, now: int) -> int | None:
        if age is not None:
            return max(now - parse_duration_ms(age), 0)
        return ms

    async def go() -> dict[str, Any]:
        ledger: Ledger = await open_ledger(ledger_url, create=False)
        try:
            report: dict[str, Any] = {}
            now = ledger.now_ms()
            cutoff = cutoff_of(before_ms, older_than, now)
            if cutoff is not None:
                report["before_ms"] = cutoff
                report["pruned"] = await ledger.prune_completed(
                    cutoff, progress=show, keep_tombstones=keep_tombstones or None
                )
                if keep_tombstones or getattr(ledger, "keep_tombstones", False):
                    report["tombstones_kept"] = True  # absent otherwise: the seed's shape
            horizon = cutoff_of(tombstones_before, tombstones_older_than, now)
            if horizon is not None:
                report["tombstones_before_ms"] = horizon
                report["tombstones_pruned"] = await ledger.prune_tombstones(horizon)
            return report
        finally:
            await ledger.close()

    for age in (older_than, tombstones_older_than):
        if age is not None:
            parse_duration_ms(age)  # usage errors before touching the store
    report = run(go)
    if records and not as_json:
        click.echo("", err=True)
    if as_json:
        emit_json(report)
        return
    if "pruned" in report:
        kept = " (tombstones kept)" if report.get("tombstones_kept") else ""
        click.echo(
            f"pruned {report['pruned']} completed decision(s) completed before "
            f"{report['before_ms']}{kept}"
        )
    if "tombstones_pruned" in report:
        click.echo(
            f"removed {report['tombstones_pruned']} tombstone(s) of decisions completed before "
            f"{report['tombstones_before_ms']}"
        )


@click.command("migrate")
@ledger_option
@click.option(
    "--outbox",
    "outbox_url",
    default=None,
    metavar="URL",
    help="Create or upgrade this outbox (sqlite:///path or postgresql://...); "
    "alone, without --ledger, it migrates only the outbox.",
)
@json_option
@click.pass_context
def migrate_cmd(ctx: click.Context, ledger_url: str, outbox_url: str | None, as_json: bool) -> None:
    """Create or upgrade the ledger schema (SQLite and PostgreSQL), and an outbox's.

    PostgreSQL stores are migrated only by this command; SQLite stores also
    migrate themselves when they open (see docs/OPERATIONS.md). Every URL is
    checked before any store is touched, and the output names each store.
    """
    from ..sinks.outbox import parse_outbox_url

    # `--outbox` alone means the outbox alone: the default ledger is not touched.
    ledger_given = ctx.get_parameter_source("ledger_url") not in (
        click.core.ParameterSource.DEFAULT,
        None,
    )
    migrate_ledger = outbox_url is None or ledger_given
    try:  # usage errors before anything is created
        if migrate_ledger:
            parse_ledger_url(ledger_url)
        if outbox_url is not None:
            parse_outbox_url(outbox_url)
    except FlowDecisionError as error:
        fail(error)  # exit 1, as a bad URL is for every command that opens a store

    report: dict[str, Any] = {}
    lines: list[str] = []
    if migrate_ledger:
        result = run(lambda: _migrate_ledger(ledger_url))
        if result is None:
            report = {"migrated": False, "reason": "this ledger has no schema to migrate"}
            lines.append(report["reason"])
        else:
            report = {"url": redact_url(ledger_url), **_versions(*result)}
            lines.append(
                f"ledger {redact_url(ledger_url)}: schema at version {result[1]}{_was(*result)}"
            )
    if outbox_url is not None:
        outbox_result = run(lambda: _migrate_outbox(outbox_url))
        report["outbox"] = {"url": redact_url(outbox_url), **_versions(*outbox_result)}
        lines.append(
            f"outbox {redact_url(outbox_url)}: schema at version {outbox_result[1]}"
            f"{_was(*outbox_result)}"
        )
    if not as_json:
        for line in lines:
            click.echo(line)
    elif set(report) == {"migrated", "reason"}:
        click.echo(json.dumps(report))  # one line, as before
    else:
        emit_json(report)


async def _migrate_ledger(url: str) -> tuple[int, int] | None:
    """Migrate a SQL ledger; None for a store without a schema (memory, a JSON file)."""
    kind, target = parse_ledger_url(url)
    if kind == "postgresql":
        from ..ledger.postgres import PostgresLedger

        pg = PostgresLedger(target)  # no schema check: migrating is the point
        try:
            return await pg.migrate()
        finally:
            await pg.close()
    if kind == "sqlite":
        from ..ledger.sqlite import SqliteLedger

        lite = SqliteLedger(target)
        try:
            return await lite.migrate()
        finally:
            await lite.close()
    if kind == "file":
        # Nothing to migrate, but a file this version cannot read (a newer
        # schema_version, corrupt JSON) is refused as every other command does.
        ledger = await open_ledger(url, create=False)
        try:
            await ledger.lookup("")
        except StoreMissingError:
            pass
        finally:
            await ledger.close()
    return None


async def _migrate_outbox(url: str) -> tuple[int, int]:
    from ..sinks.outbox import OutboxSink

    outbox = OutboxSink(url)
    try:
        return await outbox.migrate()
    finally:
        await outbox.close()


def _versions(before: int, after: int) -> dict[str, object]:
    return {"migrated": after != before, "version_before": before, "version_after": after}


def _was(before: int, after: int) -> str:
    return f" (was {before})" if after != before else " (already up to date)"

"""``flowdecision chaos``: the crash harness (see :mod:`flowdecision.chaos`)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from ..chaos import ChaosConfig, cleanup, run_chaos, summary_rows
from ..connections.urls import parse_ledger_url
from ..errors import LedgerUnavailableError, StoreMissingError
from .common import EXIT_USAGE, emit_json, fail, run, table

#: The table both SQL ledgers keep their claims in (ledger/sql/*/0001_init.sql).
_CLAIMS_TABLE = "flowdecision_claims"


async def ledger_holds_records(url: str) -> bool:
    """Whether the ledger ``url`` names exists and holds at least one record.

    Reads only: nothing is created, migrated or changed.
    """
    kind, target = parse_ledger_url(url)
    if kind == "file":
        from ..ledger.jsonfile import JsonFileLedger

        try:
            return bool(await JsonFileLedger(target, create=False).records())
        except StoreMissingError:
            return False
    if kind == "sqlite":
        return await asyncio.to_thread(_sqlite_holds_records, Path(target))
    if kind == "postgresql":
        return await _postgres_holds_records(target)
    return False  # memory: a new, empty ledger per process


def _sqlite_holds_records(path: Path) -> bool:
    import sqlite3

    from ..store.sqlite import connect_wal

    if not path.exists():
        return False
    try:
        conn = connect_wal(path, busy_timeout_ms=5_000, create=False)
        try:
            table = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (_CLAIMS_TABLE,)
            ).fetchone()
            if table is None:
                return False
            row = conn.execute(f"SELECT EXISTS (SELECT 1 FROM {_CLAIMS_TABLE})").fetchone()
            return bool(row and row[0])
        finally:
            conn.close()
    except sqlite3.Error as error:
        raise LedgerUnavailableError(f"sqlite ledger `{path}`: {error}") from error


async def _postgres_holds_records(dsn: str) -> bool:
    from ..ledger.postgres import describe_dsn

    try:
        import asyncpg

        conn = await asyncpg.connect(dsn)
        try:
            if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", _CLAIMS_TABLE):
                return False
            return bool(await conn.fetchval(f"SELECT EXISTS (SELECT 1 FROM {_CLAIMS_TABLE})"))
        finally:
            await conn.close()
    except Exception as error:
        raise LedgerUnavailableError(
            f"PostgreSQL ledger {describe_dsn(dsn)}: {type(error).__name__}: {error}"
        ) from error


__all__ = ["chaos"]


@click.command("chaos")
@click.option(
    "--ledger",
    "ledger_url",
    required=True,
    envvar="FLOWDECISION_LEDGER",
    help="Ledger URL shared by the workers: file:///dir, sqlite:///path or postgresql://...",
)
@click.option(
    "--outbox",
    "outbox_url",
    default=None,
    help="Outbox URL (default: set by --layout).",
)
@click.option(
    "--layout",
    type=click.Choice(["shared", "separate"]),
    default=None,
    help="shared: the outbox in the ledger's own store, one transaction per decision "
    "(default for SQLite and PostgreSQL ledgers); separate: claim, submit, complete "
    "with a SQLite outbox in the work directory (PostgreSQL: its database, same path).",
)
@click.option("--workers", default=8, show_default=True, type=click.IntRange(2, 64))
@click.option("--decisions", default=5000, show_default=True, type=click.IntRange(1))
@click.option("--lease-ms", default=200, show_default=True, type=click.IntRange(10))
@click.option(
    "--concurrency", default=4, show_default=True, type=click.IntRange(1), help="Per worker."
)
@click.option(
    "--kill-every-ms", default=1000, show_default=True, type=click.IntRange(0), help="0: never."
)
@click.option(
    "--pause-every-ms", default=1500, show_default=True, type=click.IntRange(0), help="0: never."
)
@click.option(
    "--pause-ms", default=None, type=click.IntRange(1), help="SIGSTOP length [3 x lease]."
)
@click.option("--duplicate-rate", default=0.2, show_default=True, type=click.FloatRange(0, 1))
@click.option("--conflict-rate", default=0.05, show_default=True, type=click.FloatRange(0, 1))
@click.option("--slow-sink-rate", default=0.1, show_default=True, type=click.FloatRange(0, 1))
@click.option("--sink-raise-rate", default=0.02, show_default=True, type=click.FloatRange(0, 1))
@click.option(
    "--sink",
    "sink_url",
    default=None,
    help="temporal://host:port[/namespace]: then drain the outbox into this Temporal server "
    "through `flowdecision relay` processes killed and restarted, and check that Temporal "
    "applied every decision once, in order (the harness runs its own worker).",
)
@click.option(
    "--failover-command",
    default=None,
    help="The failover fault: a command that fails the ledger's PostgreSQL over (kills the "
    "primary, promotes a standby, rebuilds the old primary); --ledger must list every host "
    "with target_session_attrs=read-write.",
)
@click.option(
    "--failover-every-ms",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Run --failover-command this often (0: never).",
)
@click.option(
    "--failovers",
    "max_failovers",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="At most this many failovers (0: no limit).",
)
@click.option(
    "--approvals",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="The approval phase: hold this many decisions for approval, then approve them in "
    "bulk through `flowdecision approve` processes that race and are SIGKILLed; each must "
    "be delivered and approved once (SQLite and PostgreSQL ledgers).",
)
@click.option("--seed", default=None, type=int, help="Reproduce a workload and fault schedule.")
@click.option("--workdir", default=None, help="Keep journals here (default: a temp dir).")
@click.option("--keep", is_flag=True, help="Keep the temporary work directory.")
@click.option("--timeout", "timeout_s", default=900.0, show_default=True, help="Seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--force",
    is_flag=True,
    help="Run even if the ledger already holds decisions (chaos adds thousands of its own).",
)
def chaos(
    ledger_url: str,
    outbox_url: str | None,
    layout: str | None,
    workers: int,
    decisions: int,
    lease_ms: int,
    concurrency: int,
    kill_every_ms: int,
    pause_every_ms: int,
    pause_ms: int | None,
    duplicate_rate: float,
    conflict_rate: float,
    slow_sink_rate: float,
    sink_raise_rate: float,
    sink_url: str | None,
    failover_command: str | None,
    failover_every_ms: int,
    max_failovers: int,
    approvals: int,
    seed: int | None,
    workdir: str | None,
    keep: bool,
    timeout_s: float,
    as_json: bool,
    force: bool,
) -> None:
    """Kill, pause and restart real dispatcher processes, then verify exactly once.

    Exit code 0 when every check passes, 1 otherwise. A ledger that already
    holds decisions is refused (exit 2) unless --force: point chaos at a new one.
    """
    if not force and run(lambda: ledger_holds_records(ledger_url)):
        fail(
            "the --ledger store already holds decisions and chaos would add thousands of "
            "test decisions to it; point --ledger at a new ledger, or pass --force",
            EXIT_USAGE,
        )
    try:
        cfg = ChaosConfig(
            ledger_url=ledger_url,
            outbox_url=outbox_url,
            layout=layout,
            workers=workers,
            decisions=decisions,
            lease_ms=lease_ms,
            concurrency=concurrency,
            kill_every_ms=kill_every_ms,
            pause_every_ms=pause_every_ms,
            pause_ms=pause_ms,
            duplicate_rate=duplicate_rate,
            conflict_rate=conflict_rate,
            slow_sink_rate=slow_sink_rate,
            sink_raise_rate=sink_raise_rate,
            sink=sink_url,
            failover_command=failover_command,
            failover_every_ms=failover_every_ms if failover_command else 0,
            max_failovers=max_failovers,
            approvals=approvals,
            seed=seed,
            workdir=workdir,
            timeout_s=timeout_s,
        ).resolved()
    except ValueError as error:
        raise click.BadParameter(str(error)) from error
    tty = sys.stderr.isatty() and not as_json

    def progress(done: int, total: int, stats: dict[str, int]) -> None:
        width = 30
        filled = width * done // total if total else width
        line = (
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} proposals  "
            f"kills {stats.get('kills', 0)}  pauses {stats.get('pauses', 0)}"
            + (f"  failovers {stats['failovers']}" if stats.get("failovers") else "")
        )
        click.echo(line, nl=False, err=True)

    try:
        report = run_chaos(cfg, progress=progress if tty else None)
    finally:
        if tty:
            click.echo("", err=True)
        if workdir is None and not keep:
            cleanup(cfg)
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo(table(["figure", "value"], list(summary_rows(report))))
        click.echo(f"verdict: {'PASS' if report.ok else 'FAIL'} (seed {cfg.seed})")
        if keep or workdir:
            click.echo(f"journals: {cfg.workdir}")
    sys.exit(0 if report.ok else 1)

"""``flowdecision chaos``: the crash harness (see :mod:`flowdecision.chaos`)."""

from __future__ import annotations

import sys

import click

from ..chaos import ChaosConfig, cleanup, run_chaos, summary_rows
from .common import emit_json, table

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
    help="Outbox URL (default: sqlite in the work directory; the ledger's database for "
    "PostgreSQL).",
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
@click.option("--seed", default=None, type=int, help="Reproduce a workload and fault schedule.")
@click.option("--workdir", default=None, help="Keep journals here (default: a temp dir).")
@click.option("--keep", is_flag=True, help="Keep the temporary work directory.")
@click.option("--timeout", "timeout_s", default=900.0, show_default=True, help="Seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def chaos(
    ledger_url: str,
    outbox_url: str | None,
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
    seed: int | None,
    workdir: str | None,
    keep: bool,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Kill, pause and restart real dispatcher processes, then verify exactly once.

    Exit code 0 when every check passes, 1 otherwise.
    """
    try:
        cfg = ChaosConfig(
            ledger_url=ledger_url,
            outbox_url=outbox_url,
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

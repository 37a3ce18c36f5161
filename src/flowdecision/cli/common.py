"""Helpers shared by the subcommands: ledger option, output, errors, durations."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click

from ..core.defaults import DEFAULT_STORE_URL, LEGACY_LEDGER_URL, default_ledger_url
from ..errors import ActionRefusedError, FlowDecisionError, RunClosedError, StoreMissingError
from ..observability.redact import json_safe, printable, redact_text
from ..store.chain import ChainReport

T = TypeVar("T")

DEFAULT_LEDGER_URL = DEFAULT_STORE_URL

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_STORE_MISSING = 4
#: `submit`: the service refused a decision because its run is closed (409 run_closed).
EXIT_RUN_CLOSED = 6
#: `audit --verify`, `outbox audit --verify`: the audit trail's hash chain is broken.
EXIT_AUDIT_BROKEN = 7

#: Set to show the traceback of an unexpected error instead of one line.
DEBUG_ENV = "FLOWDECISION_DEBUG"

#: Top-level modules that only the ``service`` extra installs.
SERVICE_MODULES = frozenset({"starlette", "uvicorn", "aiohttp", "prometheus_client"})

ledger_option = click.option(
    "--ledger",
    "ledger_url",
    default=default_ledger_url,
    show_default=f"{DEFAULT_STORE_URL}, or {LEGACY_LEDGER_URL} where the old "
    "two-file layout is kept",
    envvar="FLOWDECISION_LEDGER",
    help="Ledger URL: memory:, file:///dir (or a bare directory), sqlite:///path, postgresql://...",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


def one_line(text: object) -> str:
    """``text`` on one line (error messages may embed driver output with newlines)."""
    return " ".join(str(text).split())


def fail(message: object, code: int = EXIT_ERROR) -> NoReturn:
    """Print ``error: message`` as one line on stderr and exit with ``code``.

    Every URL in it is redacted (a driver's message may repeat the URL it was
    given, password included), and control and format characters of ids are
    shown escaped.
    """
    click.echo(f"error: {printable(redact_text(one_line(message)))}", err=True)
    sys.exit(code)


def fail_for(error: BaseException) -> NoReturn:
    """Report any exception as one clean line with the exit code its kind maps to.

    A missing store exits 4, an operator action refused (an unknown decision, or
    one whose state the action does not take) 3; other flowdecision and OS errors exit 1 with their
    message; anything else (a bug) names its type too, and ``FLOWDECISION_DEBUG=1``
    re-raises it for the traceback.
    """
    if isinstance(error, StoreMissingError):
        fail(error, EXIT_STORE_MISSING)
    if isinstance(error, ActionRefusedError):  # an unknown decision, or one in another state
        fail(error, EXIT_NOT_FOUND)
    if isinstance(error, RunClosedError):  # an approval of a decision whose run closed
        fail(error, EXIT_RUN_CLOSED)
    if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] in (
        SERVICE_MODULES
    ):
        fail(
            f"this command needs the service extra (module `{error.name}` is missing): "
            "pip install 'flowdecision[service]'"
        )
    if isinstance(error, FlowDecisionError | OSError):
        fail(error)
    if os.environ.get(DEBUG_ENV):
        raise error
    fail(f"unexpected {type(error).__name__}: {error} (set {DEBUG_ENV}=1 for the traceback)")


def run(
    coro_fn: Callable[[], Awaitable[T]],
    *,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> T:
    """Run a coroutine; turn flowdecision errors into a clean message and exit 1.

    ``loop_factory`` picks the event loop (``serve`` uses uvloop when installed).
    """
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(_call(coro_fn))
    except FlowDecisionError as error:
        fail_for(error)


class CleanErrorsGroup(click.Group):
    """A command group whose commands never print a traceback (see :func:`fail_for`)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # click reports these itself, with their own exit codes
        except Exception as error:
            fail_for(error)


async def _call(coro_fn: Callable[[], Awaitable[T]]) -> T:
    return await coro_fn()


def emit_json(value: Any) -> None:
    """Print ``value`` as indented JSON; format characters (bidi controls) as JSON escapes."""
    click.echo(json_safe(json.dumps(value, indent=2, ensure_ascii=False)))


def report_chain(report: ChainReport, what: str, as_json: bool) -> None:
    """Print what verifying an audit trail's hash chain found (``what`` names the
    trail); exit :data:`EXIT_AUDIT_BROKEN` naming the first row that does not match."""
    if as_json:
        emit_json(report.to_dict())
    elif report.first_break is None:
        legacy = f", {report.legacy} from before the chain (unverified)" if report.legacy else ""
        click.echo(
            f"{what}: intact: {report.rows} row(s){legacy}; head {report.head} "
            f"(seq {report.head_seq}): keep it elsewhere to detect a cut tail later"
        )
    else:
        broken = report.first_break
        click.echo(f"{what}: BROKEN at seq {broken.seq}: {broken.problem}")
    if report.first_break is not None:
        sys.exit(EXIT_AUDIT_BROKEN)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table; control and format characters are shown escaped."""
    cells = [[str(h) for h in headers]] + [[printable(str(c)) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d|w)\s*$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


def parse_duration_ms(text: str) -> int:
    """``500ms``, ``30s``, ``15m``, ``12h``, ``7d``, ``2w`` -> milliseconds."""
    match = _DURATION.match(text)
    if not match:
        raise click.BadParameter(
            f"`{text}` is not a duration; use a number and one of ms, s, m, h, d, w (e.g. 7d)"
        )
    return int(match.group(1)) * _UNIT_MS[match.group(2)]

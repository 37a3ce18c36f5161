"""Helpers shared by the subcommands: ledger option, output, errors, durations."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import click

from ..errors import FlowDecisionError

T = TypeVar("T")

DEFAULT_LEDGER_URL = "sqlite:///.flowdecision/ledger.db"

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3

ledger_option = click.option(
    "--ledger",
    "ledger_url",
    default=DEFAULT_LEDGER_URL,
    show_default=True,
    envvar="FLOWDECISION_LEDGER",
    help="Ledger URL: memory:, file:///dir (or a bare directory), sqlite:///path, postgresql://...",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


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
        click.echo(f"error: {error}", err=True)
        sys.exit(EXIT_ERROR)


async def _call(coro_fn: Callable[[], Awaitable[T]]) -> T:
    return await coro_fn()


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
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

"""``submit``: post decisions to a running decision service (the client, from a shell).

The input is one decision (a JSON document, which may span lines) or a stream
of JSON lines (one decision per line). It is told apart by its first non-blank
line: if that line is a JSON value on its own, the input is JSON lines.
Decisions are sent one at a time, in order, with their bytes unchanged; the
first failure that is not a duplicate stops the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any, NoReturn

import click

from ..core.defaults import SERVICE_URL
from ..errors import FlowDecisionError
from ..observability import tracing
from ..observability.redact import json_safe, printable, redact_text
from .common import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_RUN_CLOSED, EXIT_USAGE

if TYPE_CHECKING:
    from ..client import SubmitResult, SyncDecisionClient

__all__ = ["submit_cmd"]

#: Exit code for a decision the service refused: its id is bound to other content
#: (409 conflict) or it comes from a forked branch (403). The same code as a
#: missing or conflicting decision in `inspect`.
EXIT_REFUSED = EXIT_NOT_FOUND


class _InputError(Exception):
    """The input is not a decision or a JSON-lines stream of decisions."""


def _non_blank(stream: IO[bytes]) -> Iterator[tuple[int, bytes, bytes]]:
    """``(line number, raw line, stripped line)`` for each line that is not blank."""
    for number, raw in enumerate(stream, start=1):
        line = raw.strip()
        if line:
            yield number, raw, line


def _decisions(stream: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """``(line number, JSON bytes)`` per decision: one document, or one per line."""
    lines = _non_blank(stream)
    first = next(lines, None)
    if first is None:
        return
    number, raw, line = first
    try:
        json.loads(line)
    except ValueError:
        # Not a JSON value on its own line: the whole input is one document.
        document = raw + stream.read()
        try:
            json.loads(document)
        except ValueError as error:
            raise _InputError(
                f"not a JSON document nor JSON lines (line {number}: {error})"
            ) from None
        yield number, document.strip()
        return
    yield number, line
    for number, _raw, line in lines:
        try:
            json.loads(line)
        except ValueError as error:
            raise _InputError(f"line {number} is not JSON: {error}") from None
        yield number, line


def _count_lines(stream: IO[bytes]) -> int | None:
    """Non-blank lines of a regular file (then rewound), or None for a pipe."""
    try:
        if not stream.seekable():
            return None
        start = stream.tell()
        total = sum(1 for raw in stream if raw.strip())
        stream.seek(start)
    except OSError:
        return None
    return total


def _result_json(number: int, result: SubmitResult) -> dict[str, Any]:
    # The service's answer body (SubmitResult.to_dict), between the line and the request id.
    return {"line": number, **result.to_dict(), "request_id": result.request_id}


def _exit_code(error: Exception) -> int:
    from ..client import (
        ServiceAuthError,
        ServiceBranchError,
        ServiceConflictError,
        ServiceDecisionRejectedError,
        ServiceInvalidRequestError,
        ServiceRunClosedError,
        ServiceTooLargeError,
    )

    if isinstance(error, ServiceRunClosedError):
        return EXIT_RUN_CLOSED
    if isinstance(error, ServiceConflictError | ServiceBranchError | ServiceDecisionRejectedError):
        return EXIT_REFUSED
    if isinstance(error, ServiceInvalidRequestError | ServiceTooLargeError | ServiceAuthError):
        return EXIT_USAGE
    return EXIT_ERROR


def _fail(number: int, error: Exception, as_json: bool) -> NoReturn:
    from ..client import ServiceError

    code = _exit_code(error)
    if as_json:
        detail: dict[str, Any] = {"message": str(error)}
        if isinstance(error, ServiceError):
            detail = {
                "status": error.status,
                "code": error.error_code,
                "message": error.message,
                "request_id": error.request_id,
                **dict(error.details),
            }
        else:
            detail["code"] = getattr(error, "code", "error")
        click.echo(json_safe(json.dumps({"line": number, "error": detail}, ensure_ascii=False)))
    click.echo(f"error: line {number}: {shown(error)}", err=True)
    sys.exit(code)


def _open_client(
    url: str, token_file: str | None, timeout: float, retries: int, wait_s: float | None
) -> SyncDecisionClient:
    try:
        from ..client import RetryOptions, SyncDecisionClient, read_token_file
    except ImportError as error:  # httpx and aiohttp are optional dependencies
        click.echo(
            f"error: `flowdecision submit` needs the client extra ({error}); "
            "install it with: pip install 'flowdecision[client]'",
            err=True,
        )
        sys.exit(EXIT_USAGE)
    try:
        token = read_token_file(token_file) if token_file else os.environ.get("FLOWDECISION_TOKEN")
        return SyncDecisionClient(
            url,
            token=token or None,
            timeout=timeout,
            retry=RetryOptions(max_tries=retries + 1),
            wait_s=wait_s,
        )
    except ValueError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(EXIT_USAGE)


@click.command("submit")
@click.argument("source", metavar="FILE|-", type=click.File("rb"))
@click.option(
    "--url",
    default=SERVICE_URL,
    show_default=True,
    envvar="FLOWDECISION_URL",
    help="Base URL of the decision service.",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    help="File whose first line is the bearer token (default: $FLOWDECISION_TOKEN).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per result.")
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress bar on stderr for a JSON-lines stream.  [default: when stderr is a terminal]",
)
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    help="Ask the service to wait up to N seconds for another owner's answer (Prefer: wait=N).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds per HTTP request.",
)
@click.option(
    "--retries",
    type=click.IntRange(min=0),
    default=4,
    show_default=True,
    help="Retries per decision on busy, 503 and connection failures.",
)
@click.option(
    "--trace",
    is_flag=True,
    help="Start a root span for this submission and export it over OTLP (standard "
    "OTEL_* variables; needs the `otel` extra); prints its trace id on stderr.",
)
def submit_cmd(
    source: IO[bytes],
    url: str,
    token_file: str | None,
    as_json: bool,
    progress: bool | None,
    wait_s: float | None,
    timeout: float,
    retries: int,
    trace: bool,
) -> None:
    """Submit one decision (a JSON file) or a JSON-lines stream (FILE, or - for stdin).

    Prints one line per result: `submitted` or `duplicate` (both mean the
    decision is in), or `held` (it waits for an operator's approval), the
    decision id and the attempt; --json prints JSON lines with the receipt.
    Stops at the first failure that is not a duplicate.

    Exit codes: 0 every decision is in (or held); 1 the service failed or could
    not be reached; 2 bad input, usage or token; 3 refused (conflict, forked
    branch, or a rejected decision); 6 its run is closed.
    """
    with contextlib.ExitStack() as tracing_on:
        if trace:
            tracing_on.enter_context(_root_span())
        client = _open_client(url, token_file, timeout, retries, wait_s)
        _submit_all(source, client, as_json, progress)


@contextlib.contextmanager
def _root_span() -> Iterator[None]:
    """The SDK on (OTLP per OTEL_*), one ``flowdecision submit`` root span, flushed at exit."""
    problem = tracing.sdk_problem()
    if problem is not None:
        click.echo(f"error: {problem.replace('--otel', '--trace')}", err=True)
        sys.exit(EXIT_USAGE)
    shutdown = tracing.start_sdk()
    try:
        with tracing.SpanScope("flowdecision submit", kind=tracing.CLIENT):
            ids = tracing.current_ids()
            if ids is not None:
                click.echo(f"trace {ids[0]}", err=True)
            yield
    finally:
        shutdown()  # export the spans before the process exits


def _submit_all(
    source: IO[bytes], client: SyncDecisionClient, as_json: bool, progress: bool | None
) -> None:
    """Submit every decision of ``source`` with ``client``, then close it."""
    total = _count_lines(source)
    show = progress if progress is not None else sys.stderr.isatty()
    number = 0
    try:
        decisions = _decisions(source)
        first = next(decisions, None)
        if first is None:
            click.echo("error: no decision in the input", err=True)
            sys.exit(EXIT_USAGE)

        def stream() -> Iterator[tuple[int, bytes]]:
            yield first
            yield from decisions

        # A bar only for a stream: one decision needs none.
        one_document = (total is not None and total <= 1) or b"\n" in first[1]
        with click.progressbar(
            stream(),
            length=total,
            label="submitting",
            show_pos=True,
            file=sys.stderr,
            hidden=not show or one_document,
        ) as bar:
            for number, body in bar:
                result = client.submit(body)
                if as_json:
                    click.echo(
                        json_safe(json.dumps(_result_json(number, result), ensure_ascii=False))
                    )
                else:
                    click.echo(
                        f"{result.outcome.value} {printable(result.decision_id)} "
                        f"attempt {result.attempt}"
                    )
    except _InputError as error:
        if as_json:
            detail = {"code": "invalid_input", "message": str(error)}
            click.echo(json_safe(json.dumps({"line": None, "error": detail}, ensure_ascii=False)))
        click.echo(f"error: {shown(error)}", err=True)
        sys.exit(EXIT_USAGE)
    except FlowDecisionError as error:
        _fail(number, error, as_json)
    finally:
        client.close()


def shown(error: object) -> str:
    """An error's text as the terminal may show it: URLs redacted, ids escaped."""
    return printable(redact_text(str(error)))

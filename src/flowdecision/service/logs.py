"""Structured (JSON lines) logging, a cheap access log and the current request's id.

Log records never carry tokens, ``Authorization`` headers, query strings,
owner ids or passwords: the access log writes a fixed set of fields, the
formatter drops any extra field whose name suggests a secret and redacts every
URL in the rest (:func:`flowdecision.observability.redact.redact_text`), and format
characters (bidi controls) are written as JSON escapes.

The request id lives in a context variable, set by the boundary middleware for
the duration of one request. That is what lets every record logged while
serving it, and every error body built for it, carry the id without each
function passing it along.

Cost per request. The access log writes one line per request, so it must be
cheap (it was half of ``/healthz``'s CPU through :mod:`logging`). Once
:func:`configure_logging` has installed the :class:`LineWriter`, an access
line is built directly as JSON text (no ``LogRecord``, no caller lookup, no
dict to serialize) and appended to a buffer. The buffer is written with one
``write`` + ``flush`` per event-loop iteration (a ``call_soon`` scheduled by
the first line of the iteration), at once for warnings and errors, for lines
logged outside the event loop's thread, past :data:`FLUSH_BYTES`, and at
exit. Without that writer (the app embedded in another program) the access
line goes through :mod:`logging` as before, so the host's handlers see it.
Request ids are a random per-process prefix plus a counter, not ``uuid4``
(one ``os.urandom`` system call per request).
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import itertools
import json
import logging
import os
import sys
import threading
import time
from json.encoder import encode_basestring
from typing import Any, TextIO

from ..observability import tracing as _tracing
from ..observability.redact import json_safe, redact_text

__all__ = [
    "ACCESS_LOGGER",
    "FLUSH_BYTES",
    "JsonFormatter",
    "LineWriter",
    "configure_logging",
    "current_request_id",
    "describe_cause",
    "flush_logs",
    "new_request_id",
    "request_id_for",
    "request_id_var",
    "write_access_line",
]

#: The access log's logger name (the ``logger`` field of every access line).
ACCESS_LOGGER = "flowdecision.access"
#: A buffer this large is written at once rather than at the end of the loop iteration.
FLUSH_BYTES = 64 * 1024

#: The id of the request being served in this context (None outside requests).
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "flowdecision_request_id", default=None
)


def current_request_id() -> str | None:
    """The id of the request being served, if any."""
    return request_id_var.get()


class _RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to records logged while a request is served, and
    ``trace_id`` / ``span_id`` while a span is recording (tracing on)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            request_id = request_id_var.get()
            if request_id is not None:
                record.request_id = request_id
        if _tracing.active() and not hasattr(record, "trace_id"):
            ids = _tracing.current_ids()
            if ids is not None:
                record.trace_id, record.span_id = ids
        return True


_STANDARD = set(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}
_SECRET_HINTS = ("token", "owner", "authorization", "password", "secret", "cookie")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, [``pid``], ``message``, extras.

    ``pid=True`` (several workers) adds the process id to every line.
    """

    def __init__(self, *, pid: bool = False) -> None:
        super().__init__()
        self.pid = os.getpid() if pid else None

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        if self.pid is not None:
            out["pid"] = self.pid
        out["message"] = redact_text(record.getMessage())
        for key, value in record.__dict__.items():
            if key in _STANDARD or key.startswith("_"):
                continue
            if any(hint in key.lower() for hint in _SECRET_HINTS):
                continue
            if isinstance(value, int | float | bool | None):
                out[key] = value
            else:  # a URL (or a driver message quoting one) loses its password
                out[key] = redact_text(value if isinstance(value, str) else str(value))
        if record.exc_info:
            out["exception"] = redact_text(self.formatException(record.exc_info))
        # Bidi controls and other format characters of ids as JSON escapes: the
        # line decodes to the same text, and a terminal shows no reordering.
        return json_safe(json.dumps(out, ensure_ascii=False))


class LineWriter(logging.Handler):
    """A logging handler (JSON lines) whose buffer is written once per loop iteration.

    Every line, from a log record or from :func:`write_access_line`, goes
    through the same buffer, so lines keep their order. Nothing is lost on a
    graceful exit: the buffer is written at the end of the loop iteration that
    filled it, at interpreter exit, and by :func:`flush_logs`. ``max_write``
    bounds each write to whole lines totalling at most that many bytes (for
    several processes writing to one pipe: writes up to ``PIPE_BUF`` bytes are
    never interleaved).
    """

    def __init__(self, stream: TextIO, *, pid: bool = False, max_write: int | None = None) -> None:
        super().__init__()
        self.stream = stream
        self.max_write = max_write
        pid_field = f'"pid": {os.getpid()}, ' if pid else ""
        #: The constant middle of every access line (see :func:`write_access_line`).
        self.access_head = (
            f'"level": "info", "logger": "{ACCESS_LOGGER}", {pid_field}'
            '"message": "http request", "event": "http_request", "request_id": '
        )
        self._buffer: list[str] = []
        self._size = 0
        self._scheduled: asyncio.AbstractEventLoop | None = None
        # Lines may come from worker threads (the ledger's, the outbox's) too.
        self._guard = threading.Lock()
        self.setFormatter(JsonFormatter(pid=pid))
        self.addFilter(_RequestIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.append(line, urgent=record.levelno >= logging.WARNING)

    def append(self, line: str, *, urgent: bool = False) -> None:
        """Queue ``line`` (without its newline); write now if urgent or off the loop."""
        with self._guard:
            self._buffer.append(line)
            self._size += len(line)
            if urgent or self._size >= FLUSH_BYTES:
                self._write_locked()
                return
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                # No running loop in this thread (a worker thread, or no loop at all):
                # nobody would run a scheduled flush, so write now.
                self._write_locked()
                return
            if self._scheduled is not loop or loop.is_closed():
                self._scheduled = loop
                loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write whatever is buffered (one ``write``, one ``flush``)."""
        with self._guard:
            self._scheduled = None
            self._write_locked()

    def _write_locked(self) -> None:
        if not self._buffer:
            return
        lines, self._buffer, self._size = self._buffer, [], 0
        try:
            for chunk in self._chunks(lines):
                self.stream.write(chunk)
                self.stream.flush()
        except (OSError, ValueError):
            pass  # stderr closed or gone: nowhere left to report it

    def _chunks(self, lines: list[str]) -> list[str]:
        if self.max_write is None:
            lines.append("")  # for the final newline
            return ["\n".join(lines)]
        chunks: list[str] = []
        current: list[str] = []
        size = 0
        for line in lines:
            length = len(line.encode("utf-8")) + 1
            if current and size + length > self.max_write:
                chunks.append("\n".join(current) + "\n")
                current, size = [], 0
            current.append(line)
            size += length
        chunks.append("\n".join(current) + "\n")
        return chunks

    def close(self) -> None:
        self.flush()
        super().close()


_writer: LineWriter | None = None


def configure_logging(
    level: str,
    stream: TextIO | None = None,
    *,
    pid: bool = False,
    max_write: int | None = None,
) -> LineWriter:
    """Send every log record to ``stream`` (stderr) as JSON lines at ``level``.

    ``pid`` and ``max_write`` are for workers (see :class:`LineWriter`).
    """
    global _writer
    writer = LineWriter(stream if stream is not None else sys.stderr, pid=pid, max_write=max_write)
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
        if existing is _writer:
            existing.close()
    root.addHandler(writer)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    _writer = writer
    return writer


def flush_logs() -> None:
    """Write the buffered log lines now (shutdown, before the process exits)."""
    if _writer is not None:
        _writer.flush()


atexit.register(flush_logs)

_root = logging.getLogger()
_access_logger = logging.getLogger(ACCESS_LOGGER)


def write_access_line(
    request_id: str,
    method: str,
    path: str,
    route: str,
    status: int,
    sent: int,
    duration_ms: float,
    client: str | None,
) -> None:
    """Log one request: one JSON line with the access log's fixed fields.

    The fields and the line are those :class:`JsonFormatter` would write for
    the same record (``ts``, ``level``, ``logger``, ``message``, ``event``,
    ``request_id``, ``method``, ``path``, ``route``, ``status``, ``bytes``,
    ``duration_ms``, ``client``), built without :mod:`logging`'s machinery
    when the :class:`LineWriter` is in place and the logger's level allows INFO.
    """
    writer = _writer
    if (
        writer is None
        or writer not in _root.handlers
        or _access_logger.handlers
        or not _access_logger.isEnabledFor(logging.INFO)
    ):
        # Not our handler (embedded app, test harness) or filtered: the general path.
        _access_logger.info(
            "http request",
            extra={
                "event": "http_request",
                "request_id": request_id,
                "method": method,
                "path": path,
                "route": route,
                "status": status,
                "bytes": sent,
                "duration_ms": duration_ms,
                "client": client,
            },
        )
        return
    ids = _tracing.current_ids() if _tracing.active() else None
    target = _access_targets.get((method, path, route))
    if target is None:
        target = _access_target(method, path, route)
    writer.append(
        f'{{"ts": {round(time.time(), 3)}, {writer.access_head}{encode_basestring(request_id)}, '
        f'{target}"status": {status}, "bytes": {sent}, "duration_ms": {duration_ms}, '
        f'"client": {"null" if client is None else encode_basestring(client)}'
        + ("}" if ids is None else f', "trace_id": "{ids[0]}", "span_id": "{ids[1]}"}}')
    )


#: (method, path, route) -> their access-line fields, for the few a service is sent.
_access_targets: dict[tuple[str, str, str], str] = {}
#: How many _access_targets keeps (paths are the clients' to choose).
_ACCESS_TARGETS_MAX = 256


def _access_target(method: str, path: str, route: str) -> str:
    """The ``method``, ``path`` and ``route`` fields of an access line, remembered."""
    target = (
        f'"method": {encode_basestring(method)}, "path": {json_safe(encode_basestring(path))}, '
        f'"route": {encode_basestring(route)}, '
    )
    if len(_access_targets) >= _ACCESS_TARGETS_MAX:
        _access_targets.clear()  # a client making up paths: start over
    _access_targets[method, path, route] = target
    return target


# -- request ids -------------------------------------------------------------------------

_id_prefix = ""
_id_counter = itertools.count(1)


def _new_prefix() -> None:
    # 64 random bits per process (re-drawn in a forked child), then a counter:
    # unique across processes and restarts without a system call per request.
    global _id_prefix, _id_counter
    _id_prefix = os.urandom(8).hex()
    _id_counter = itertools.count(1)


_new_prefix()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_prefix)


def new_request_id() -> str:
    """A new request id: 16 hex digits for this process, then a hex counter (alphanumeric)."""
    return f"{_id_prefix}{next(_id_counter):08x}"


def request_id_for(header: bytes | None) -> str:
    """The client's ``X-Request-Id`` (``header``) if it is short and plain, else a new id."""
    if header is not None:
        text = bytes(header).decode("latin-1")
        # Only echo ids that are short and plain; anything else is replaced.
        if 0 < len(text) <= 64 and all(c.isascii() and (c.isalnum() or c in "-_.") for c in text):
            return text
    return new_request_id()


def describe_cause(error: BaseException) -> str:
    """``Type: message`` of ``error`` and its chained causes, for the log only.

    This is where sink exception text, paths and driver errors go: operators
    need them, clients must never see them.
    """
    parts: list[str] = []
    seen: BaseException | None = error
    while seen is not None and len(parts) < 4:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return " <- ".join(parts)

"""Structured (JSON lines) logging and the current request's id.

Log records never carry tokens, ``Authorization`` headers, query strings or
owner ids: the access log writes a fixed set of fields, and the formatter drops
any extra field whose name suggests a secret.

The request id lives in a context variable, set by the boundary middleware for
the duration of one request. That is what lets every record logged while
serving it, and every error body built for it, carry the id without each
function passing it along.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import uuid
from typing import Any

from starlette.types import Scope

__all__ = [
    "JsonFormatter",
    "configure_logging",
    "current_request_id",
    "describe_cause",
    "request_id_for",
    "request_id_var",
]

#: The id of the request being served in this context (None outside requests).
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "flowdecision_request_id", default=None
)


def current_request_id() -> str | None:
    """The id of the request being served, if any."""
    return request_id_var.get()


class _RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to records logged while a request is served."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            request_id = request_id_var.get()
            if request_id is not None:
                record.request_id = request_id
        return True


_STANDARD = set(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}
_SECRET_HINTS = ("token", "owner", "authorization", "password", "secret", "cookie")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``message`` and extras."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key in _STANDARD or key.startswith("_"):
                continue
            if any(hint in key.lower() for hint in _SECRET_HINTS):
                continue
            out[key] = value if isinstance(value, str | int | float | bool | None) else str(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str) -> None:
    """Send every log record to stderr as JSON lines at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(_RequestIdFilter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


def request_id_for(scope: Scope) -> str:
    """The client's ``X-Request-Id`` if it is short and plain, else a new random id."""
    return _incoming_request_id(scope) or uuid.uuid4().hex


def _incoming_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = bytes(value).decode("latin-1")
            # Only echo ids that are short and plain; anything else is replaced.
            if 0 < len(text) <= 64 and all(
                c.isascii() and (c.isalnum() or c in "-_.") for c in text
            ):
                return text
    return None


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

"""Structured (JSON lines) logging and the access-log middleware.

Log records never carry tokens, ``Authorization`` headers, query strings or
owner ids: the access log writes a fixed set of fields, and the formatter drops
any extra field whose name suggests a secret.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["AccessLogMiddleware", "JsonFormatter", "configure_logging"]

access_log = logging.getLogger("flowdecision.access")

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
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


class AccessLogMiddleware:
    """Logs one structured record per HTTP request and sets ``X-Request-Id``.

    Fields: method, path (no query string), route template, status, bytes,
    duration, client address, request id. Headers are never logged.
    ``on_response(method, route, status)`` feeds the request counter metric.
    """

    def __init__(self, app: ASGIApp, *, enabled: bool = True, on_response: Any = None) -> None:
        self.app = app
        self.enabled = enabled
        self.on_response = on_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = _incoming_request_id(scope) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500
        sent = 0

        async def send_wrapper(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("ascii")))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "<unmatched>"
            if self.on_response is not None:
                self.on_response(scope["method"], template, status)
            if self.enabled:
                client = scope.get("client")
                access_log.info(
                    "http request",
                    extra={
                        "event": "http_request",
                        "request_id": request_id,
                        "method": scope["method"],
                        "path": scope["path"],
                        "route": template,
                        "status": status,
                        "bytes": sent,
                        "duration_ms": round((time.perf_counter() - started) * 1000, 3),
                        "client": f"{client[0]}:{client[1]}" if client else None,
                    },
                )


def _incoming_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = bytes(value).decode("latin-1")
            # Only echo ids that are short and plain; anything else is replaced.
            if 0 < len(text) <= 64 and all(c.isalnum() or c in "-_." for c in text):
                return text
    return None

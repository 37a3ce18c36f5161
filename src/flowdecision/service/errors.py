"""The one JSON error shape every endpoint uses: ``{"error": {"code", "message", ...}}``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

__all__ = ["error_response", "http_exception_handler", "unhandled_exception_handler"]

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}


def error_response(
    status: int,
    code: str,
    message: str,
    *,
    headers: Mapping[str, str] | None = None,
    **details: Any,
) -> JSONResponse:
    """A JSON error response; ``details`` become extra members of ``error``."""
    body: dict[str, Any] = {"code": code, "message": message}
    body.update(details)
    return JSONResponse({"error": body}, status_code=status, headers=dict(headers or {}))


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    status = int(getattr(exc, "status_code", 500))
    detail = str(getattr(exc, "detail", "") or "")
    headers = getattr(exc, "headers", None)
    code = _HTTP_CODES.get(status, f"http_{status}")
    if status == 404:
        detail = f"no such endpoint: {request.method} {request.url.path}"
    return error_response(status, code, detail or code.replace("_", " "), headers=headers)


async def unhandled_exception_handler(request: Request, exc: Exception) -> Response:
    # The details go to the log (Starlette logs the traceback), never to the caller.
    return error_response(500, "internal", "internal server error")

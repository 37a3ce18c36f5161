"""What a request brings, read one way for every route: query parameters, headers, body.

A bad parameter or header is a 422 ``invalid_parameter`` naming it
(:func:`bad_param`): a value given twice, a number out of range (however many
digits it has: ``int()`` refuses strings of over 4,300 digits with a
``ValueError``, so the length is judged first), a value the route's query
refuses. A body over its limit is a 413 ``payload_too_large``, answered before
it is read whole (:func:`read_body_within`).
"""

from __future__ import annotations

from starlette.datastructures import QueryParams
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope

from ..errors import FlowDecisionError
from .errors import error_response

__all__ = [
    "BadParamError",
    "bad_param",
    "bounded_int",
    "declared_over",
    "one_header",
    "one_param",
    "read_body_within",
]

#: How much of a refused value an error message repeats.
SHOWN_CHARS = 40


class BadParamError(FlowDecisionError, code="invalid_parameter"):
    """A refused query parameter (or, as ``where`` says, header or path parameter):
    its name and the problem."""

    def __init__(self, name: str, problem: str, *, where: str = "query parameter") -> None:
        super().__init__(name, problem)
        self.name = name
        # A library error that names the parameter itself ("`state` must be one of
        # ..."): named once, by the message's prefix.
        self.problem = problem.removeprefix(f"`{name}` ")
        self.where = where


def bad_param(bad: BadParamError) -> JSONResponse:
    """The 422 ``invalid_parameter`` for ``bad``."""
    return error_response(
        422, "invalid_parameter", f"{bad.where} `{bad.name}` {bad.problem}",
        field=bad.name, problem=bad.problem,
    )  # fmt: skip


def one_param(query: QueryParams, name: str, *, empty_ok: bool = False) -> str | None:
    """The one value of query parameter ``name``, None without it.

    Given twice it is refused (Starlette would use the last one and drop the
    rest unread); an empty value is None with ``empty_ok``, refused otherwise.
    """
    values = query.getlist(name)
    if len(values) > 1:
        raise BadParamError(name, f"must be given at most once, got {len(values)} values")
    if not values:
        return None
    if values[0] == "":
        if empty_ok:
            return None
        raise BadParamError(name, "must not be empty (leave it out instead)")
    return values[0]


def one_header(scope: Scope, name: str) -> str | None:
    """The one value of header ``name``, decoded as UTF-8 (Starlette's latin-1 would
    garble a fullwidth digit in the message); sent twice it is refused."""
    wanted = name.lower().encode("ascii")
    values = [value for key, value in scope["headers"] if key == wanted]
    if len(values) > 1:
        raise BadParamError(name, f"must be sent at most once, got {len(values)}", where="header")
    if not values:
        return None
    return bytes(values[0]).decode("utf-8", "replace")


def bounded_int(name: str, raw: str, low: int, high: int, *, where: str = "query parameter") -> int:
    """``raw`` as an integer in ``low..high``: ASCII digits only (``int()`` and
    ``str.isdigit()`` also take fullwidth and Arabic-Indic ones)."""
    if (
        not (raw.isascii() and raw.isdigit())
        or len(raw.lstrip("0")) > len(str(high))
        or not low <= int(raw) <= high
    ):
        raise BadParamError(
            name, f"must be an integer in {low}..{high}, got `{raw[:SHOWN_CHARS]}`", where=where
        )
    return int(raw)


def declared_over(declared: bytes, limit: int) -> bool:
    """Whether a ``Content-Length`` of ASCII digits exceeds ``limit`` (its length judged
    before ``int()``, which refuses over 4,300 digits)."""
    return len(declared.lstrip(b"0")) > len(str(limit)) or int(declared) > limit


class _TooLarge(Exception):
    pass


async def read_body_within(
    receive: Receive, declared: bytes | None, limit: int
) -> bytes | JSONResponse:
    """The request body, or the 413 when it (or its ``Content-Length``, ``declared``)
    exceeds ``limit`` bytes: then it was not read whole (the edge lingers on the rest).

    ``ClientDisconnect`` if the client hangs up meanwhile (the boundary records a 499).
    """
    try:
        if declared is not None and declared.isdigit() and declared_over(declared, limit):
            raise _TooLarge
        return await _read_body(receive, limit)
    except _TooLarge:
        return error_response(
            413,
            "payload_too_large",
            f"request body exceeds {limit} bytes",
            limit_bytes=limit,
        )


async def _read_body(receive: Receive, limit: int) -> bytes:
    """The request body, read whole (what ``Request.stream`` reads, without its generator).

    Raises :class:`_TooLarge` past ``limit`` bytes and ``ClientDisconnect`` if the
    client hangs up meanwhile (the boundary then records a 499).
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "http.request":
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _TooLarge
            if not message.get("more_body", False):
                if not chunks:
                    return chunk  # the usual case: the whole body in one message
                chunks.append(chunk)
                return b"".join(chunks)
            chunks.append(chunk)
        elif kind == "http.disconnect":
            raise ClientDisconnect

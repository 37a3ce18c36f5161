"""The service edge: what stands between the network and uvicorn's HTTP parser.

An optional seam. ``serve --edge=guarded`` (the default) runs the service
through it; ``serve --edge=plain`` runs stock uvicorn and leaves these jobs to
a reverse proxy in front (docs/SERVICE.md, "Behind a proxy"). Nothing else in
the service imports this package: only ``service/server.py`` chooses it.

uvicorn leaves gaps a hostile or careless client can use, and the edge fills
them, one module per job:

- :mod:`.connections`: the connection cap. Accepts connections itself, keeps
  their number under a cap derived from ``RLIMIT_NOFILE``, evicts the
  longest-waiting idle connection at the cap and answers 503 ``overloaded``
  when every connection is busy;
- :mod:`.timeouts`: header, body and keep-alive timeouts (408), and the cap on
  a request head's size and number of fields (431);
- :mod:`.linger`: lingering close, so a client that writes its whole body
  before reading reads a 413 instead of a reset;
- :mod:`.coalesce`: write coalescing, one ``send`` per small response (the
  only performance job; the others are correctness);
- :mod:`.base`: what they share (limits, per-connection state, the JSON
  answers the edge sends itself, malformed HTTP answered as JSON 400);
- :mod:`.contract`: every uvicorn internal the edge relies on, checked before
  serving and by ``tests/test_service_edge.py``.

**When to delete this package.** When uvicorn has header and body read
timeouts (its issue #157, https://github.com/encode/uvicorn/issues/157, was
closed with both unchecked; PR #1685, which added them, was not merged), a cap
on the request head, and a close that does not reset unread bodies, the
timeouts and lingering close can go; the connection cap can go once
``limit_concurrency`` refuses before accepting. Write coalescing is worth about
one system call per response and can go with them.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any

from .base import HEAD_MAX_BYTES, HEAD_MAX_FIELDS, LINGER_S, EdgeLimits, edge_answer
from .connections import Acceptor, ConnectionTable, effective_max_connections
from .contract import contract_problems
from .linger import LingeringClose
from .timeouts import Timeouts

__all__ = [
    "HEAD_MAX_BYTES",
    "HEAD_MAX_FIELDS",
    "LINGER_S",
    "Acceptor",
    "ConnectionTable",
    "EdgeLimits",
    "contract_problems",
    "edge_answer",
    "edge_protocol",
    "effective_max_connections",
    "serve_through_edge",
]


def edge_protocol(base: type[asyncio.Protocol], table: ConnectionTable) -> type[asyncio.Protocol]:
    """``base`` (a uvicorn HTTP protocol class) with the edge's limits, counted in ``table``.

    The parts are mixed in before ``base`` and each passes every call on:
    lingering close first (it discards what a lingering client still sends),
    then the timeouts and head cap, then the shared state (which installs the
    coalescing transport and answers malformed HTTP as JSON).
    """
    return type(f"Edge{base.__name__}", (LingeringClose, Timeouts, base), {"_table": table})


def serve_through_edge(
    server: Any, sockets: Sequence[socket.socket], limits: EdgeLimits
) -> ConnectionTable:
    """Accept connections on ``sockets`` through the edge, for a started ``uvicorn.Server``.

    Call it after ``server.startup(sockets=[])`` (uvicorn ran the lifespan and
    listens on nothing). The acceptors go into ``server.servers``, so uvicorn's
    shutdown stops them as it would its own listening servers.
    """
    table = ConnectionTable(limits)
    protocol = edge_protocol(server.config.http_protocol_class, table)
    config, state, app_state = server.config, server.server_state, server.lifespan.state

    def factory() -> asyncio.Protocol:
        return protocol(config=config, server_state=state, app_state=app_state)  # type: ignore[call-arg]

    for sock in sockets:
        acceptor = Acceptor(sock, factory, table)
        acceptor.start()
        server.servers.append(acceptor)
    return table

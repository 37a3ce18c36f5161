"""The ceiling for bench/service_bench.py: a bare Starlette app on flowdecision's server stack.

    python bench/service_ceiling.py [flowdecision serve flags...]
    python bench/service_ceiling.py --plain-uvicorn    # the reference row instead

runs ``flowdecision serve`` itself, with the same flags, socket binding, uvicorn
settings (event loop, HTTP implementation, worker processes...), with one change:
every ``uvicorn.Config`` it builds serves :data:`app` below instead of the
flowdecision app. The ceiling therefore follows whatever ``serve`` does to its
server stack, without this file knowing about it. (The flowdecision ledger and
sink are still opened by ``serve`` but stay idle.)

The app is named by import string (``service_ceiling:app``), so worker processes
spawned by uvicorn import it too; this file's directory must be on PYTHONPATH
for them, which service_bench.py arranges. ``GET /healthz`` answers
``{"ceiling":true}`` so the benchmark can check the swap took effect.

``--plain-uvicorn`` serves the same app the way uvicorn's documentation shows,
``uvicorn.run(app, host=..., port=...)`` with uvicorn's defaults (uvicorn binds
the socket, picks the loop and HTTP implementation itself, access log off): a
reference that does not move when ``serve`` changes, so a regression in
``serve``'s stack (which would lower the ceiling too) still shows.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

#: The import string uvicorn is given instead of flowdecision's app.
APP_IMPORT = "service_ceiling:app"
#: The line ``flowdecision serve`` prints when it is ready (``--plain-uvicorn`` too).
READY_PREFIX = "flowdecision serving on "
#: What the ceiling answers on GET /healthz.
CEILING_BODY = b'{"ceiling":true}'


async def healthz(request: Request) -> JSONResponse:
    return JSONResponse({"ceiling": True})


app = Starlette(routes=[Route("/healthz", healthz, methods=["GET"])])


class NullSink:
    """A sink that accepts every decision and keeps nothing.

    For decomposition experiments only (``service_bench.py --serve-args
    "--sink python:service_ceiling:NullSink"``): what a POST costs without an outbox.
    """

    async def submit(self, request: object, attempt: int) -> None:
        return None


def _swap_app_in_uvicorn() -> None:
    import uvicorn.config

    original = uvicorn.config.Config

    class CeilingConfig(original):  # type: ignore[misc, valid-type]
        def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
            kwargs["factory"] = False
            super().__init__(APP_IMPORT, *args, **kwargs)

    uvicorn.Config = CeilingConfig  # type: ignore[misc]
    uvicorn.config.Config = CeilingConfig  # type: ignore[misc]


class _ReadyServer(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(f"{READY_PREFIX}http://{self.config.host}:{self.config.port}", flush=True)


def _plain_uvicorn() -> None:
    # uvicorn binds host:port itself here (asyncio's create_server), so pick a free
    # port first; the tiny race with another process taking it is harmless in a bench.
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    config = uvicorn.Config(
        APP_IMPORT, host="127.0.0.1", port=port, log_level="warning", access_log=False
    )
    _ReadyServer(config).run()  # what uvicorn.run does: uvicorn picks the event loop


def main() -> None:
    if sys.argv[1:] == ["--plain-uvicorn"]:
        _plain_uvicorn()
        return
    _swap_app_in_uvicorn()
    from flowdecision.cli import main as flowdecision_main

    sys.argv = ["flowdecision", "serve", *sys.argv[1:]]
    flowdecision_main()


if __name__ == "__mp_main__":
    # A worker of `serve --workers N`: multiprocessing's spawn imports the parent's
    # main module (this file) under this name before running the worker, so the
    # swap is made in every worker too.
    _swap_app_in_uvicorn()

if __name__ == "__main__":
    main()

"""The DBOS sink: each accepted decision starts one DBOS workflow whose id is the decision id.

Needs the ``dbos`` extra (``pip install flowdecision[dbos]``); importing
:mod:`flowdecision` never imports DBOS.

Library (DBOS configured and launched by your application)::

    @DBOS.workflow()
    async def handle_decision(request_json: str, attempt: int) -> None: ...

    sink = DBOSSink(handle_decision)   # or queue=DBOS.register_queue("decisions")

Service: ``flowdecision serve --sink 'dbos+sqlite:///dbos.sqlite?workflow=myapp.flows:handle_decision'``
or ``'dbos+postgresql://user@host/db?workflow=…'`` (see :func:`parse_dbos_url`);
flowdecision then configures DBOS with that system database, imports the
module (which must only *define* its workflows), launches DBOS in the service
process and destroys it on shutdown.

**What the workflow receives**: ``request_json`` (``str``, the request's exact
wire JSON: ``DecisionRequest.parse(request_json)`` rebuilds the same request)
and ``attempt`` (``int``, the claim attempt that started it). The workflow must
be an ``async def``. With tracing on, the workflow is started inside DBOS's
``PropagateOtelContext``: DBOS stores the W3C trace context of the dispatch's
``flowdecision.sink.submit`` span with the workflow (its ``dbos.otelContext``
attribute), so the workflow's spans join the decision's trace, after a
recovery too (docs/OBSERVABILITY.md). DBOS records spans only with its
``enable_otlp`` option: the URL form sets it when tracing is on; an
application that configures DBOS itself sets it there.

**Why a workflow runs once.** The workflow id is the decision id and DBOS's
default workflow-id reuse policy is ``return-existing``: starting an id that
exists (running, finished or failed) records nothing new and returns a handle
to the existing workflow. So a re-submission after a crash between the sink
and the ledger's completion, or a late one from a stale owner, starts nothing.
:meth:`DBOSSink.submit` returns once DBOS has recorded the workflow in its
system database (it does not wait for the workflow to finish). DBOS compares
only the function (and queue), not the arguments, so a different request
under a used id would be silently absorbed here; the ledger refuses such a
request (a conflict) before any sink sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..connections.urls import redact_url, sqlite_path
from ..core.model import DecisionRequest
from ..observability.redact import redact_text
from ..observability.tracing import active
from ..store.sqlite import create_private_file
from .base import check_attempt

if TYPE_CHECKING:
    from dbos import Queue
from ..connections.urls import load_attribute, split_engine_url
from ..errors import DBOSSinkError, SinkConfigError

__all__ = ["DBOSSink", "DBOSSinkError", "DBOSUrl", "parse_dbos_url"]

#: The workflow signature the sink calls: ``workflow(request_json, attempt)``.
DecisionWorkflow = Callable[[str, int], Awaitable[Any]]


class DBOSSink:
    """A :class:`~flowdecision.sinks.Sink` starting one DBOS workflow per decision.

    ``workflow`` is an ``async`` function registered with ``@DBOS.workflow()``.
    With ``queue`` the workflow is enqueued on that DBOS queue (run by any DBOS
    process listening to it) instead of started in this process. DBOS itself
    must be configured and launched; :meth:`close` leaves it alone unless
    ``owns_dbos`` (set by the URL loader).
    """

    def __init__(
        self, workflow: DecisionWorkflow, *, queue: Queue | None = None, owns_dbos: bool = False
    ) -> None:
        if not inspect.iscoroutinefunction(workflow):
            raise DBOSSinkError(
                "DBOS sink needs an async workflow function "
                f"(async def workflow(request_json, attempt)), got {workflow!r}"
            )
        self.workflow = workflow
        self.queue = queue
        self._owns_dbos = owns_dbos

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        """Start (or find) the workflow whose id is ``request.decision_id``."""
        await self.start(request, attempt)

    async def start(self, request: DecisionRequest, attempt: int) -> str:
        """Like :meth:`submit`; returns the workflow id (the decision id)."""
        check_attempt(attempt)
        from dbos import DBOS, SetWorkflowID

        text = request.to_json().decode("utf-8")
        propagate: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if active():
            from dbos import PropagateOtelContext

            propagate = PropagateOtelContext()
        try:
            # Explicit, not DBOS's default by chance: an existing id returns its workflow.
            with (
                propagate,
                SetWorkflowID(request.decision_id, workflow_id_reuse_policy="return-existing"),
            ):
                if self.queue is not None:
                    handle = await self.queue.enqueue_async(self.workflow, text, attempt)
                else:
                    handle = await DBOS.start_workflow_async(self.workflow, text, attempt)
        except Exception as error:
            raise DBOSSinkError(
                f"DBOS did not start the workflow for decision `{request.decision_id}`: {error}"
            ) from error
        return handle.get_workflow_id()

    async def close(self) -> None:
        """Destroy DBOS if this sink configured it (the URL form); else nothing."""
        if self._owns_dbos:
            self._owns_dbos = False
            from dbos import DBOS

            # destroy() joins DBOS's threads; keep the event loop free meanwhile.
            await asyncio.to_thread(DBOS.destroy)


@dataclass(frozen=True, slots=True)
class DBOSUrl:
    """A parsed ``dbos+<system database URL>?workflow=module:function`` sink URL."""

    system_database_url: str
    workflow: str
    app_name: str


def parse_dbos_url(url: str) -> DBOSUrl:
    """Split ``dbos+sqlite:///path?workflow=module:function[&name=APP]`` (or ``dbos+postgresql://…``).

    ``workflow`` (required) names the async workflow function; ``name`` is the
    DBOS application name (default ``flowdecision``). Every other query
    parameter stays in the system database URL.
    """
    target, params = split_engine_url(url, "dbos", ("workflow", "name"))
    if not target.startswith(("sqlite:///", "postgresql://", "postgres://")):
        raise SinkConfigError(
            f"DBOS sink URL `{redact_url(url)}` must name its system database: "
            "dbos+sqlite:///path?workflow=module:function or dbos+postgresql://…?workflow=…"
        )
    workflow = params.get("workflow", "")
    module, sep, attribute = workflow.rpartition(":")
    if not sep or not module or not attribute:
        raise SinkConfigError(
            f"DBOS sink URL `{redact_url(url)}` needs ?workflow=module:function "
            "(the async workflow)"
        )
    return DBOSUrl(
        system_database_url=target, workflow=workflow, app_name=params.get("name") or "flowdecision"
    )


def _log_through_the_host() -> None:
    """Send DBOS's log records to the host's handlers (the service's JSON lines).

    DBOS installs its own plain-text console handler, and stops propagation,
    unless its logger already has a handler when it starts; a NullHandler is
    enough to keep its records flowing to the root logger.
    """
    logger = logging.getLogger("dbos")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
        logger.propagate = True


async def open_dbos_url(url: str) -> DBOSSink:
    """Configure and launch DBOS on the URL's system database; a sink owning DBOS."""
    from dbos import DBOS

    parsed = parse_dbos_url(url)
    # Importing the module registers its @DBOS.workflow functions before launch.
    workflow = load_attribute(url, parsed.workflow)
    _log_through_the_host()
    if parsed.system_database_url.startswith("sqlite:"):
        # It holds decision payloads: private (0600) like every other store, not
        # whatever SQLite creates under the umask.
        create_private_file(
            Path(
                sqlite_path(
                    parsed.system_database_url, what="DBOS system database", error=SinkConfigError
                )
            )
        )
    try:
        DBOS(
            config={
                "name": parsed.app_name,
                "system_database_url": parsed.system_database_url,
                # Tracing on (serve --otel): DBOS's workflow and step spans join the
                # decisions' traces, exported by the provider the service registered.
                "enable_otlp": active(),
            }
        )
        DBOS.launch()
    except Exception as error:
        await asyncio.to_thread(DBOS.destroy)
        raise SinkConfigError(
            f"DBOS sink `{redact_url(url)}`: DBOS did not launch: {redact_text(str(error))}"
        ) from error
    try:
        return DBOSSink(workflow, owns_dbos=True)
    except DBOSSinkError:
        await asyncio.to_thread(DBOS.destroy)
        raise

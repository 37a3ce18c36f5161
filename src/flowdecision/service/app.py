"""The decision service: the ASGI app (:class:`~.pipeline.Pipeline`) around one
:class:`~.runtime.Service`.

The module map (every module of the service and of the library) and a tour of
one ``POST`` through them, file by file, are in docs/ARCHITECTURE.md.

The lifespan opens the ledger and the sink the settings name (unless a started
:class:`Service` is handed in), checks the ledger before serving, and on
shutdown waits until the grace deadline for in-flight dispatches before closing
them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace

from ..connections.urls import redact_url
from .auth import Auth
from .boundary import RequestRecord
from .config import Settings
from .guards import BrowserGuard
from .handlers import AppContext, routes
from .metrics import ServiceMetrics
from .operations import admin_may
from .pipeline import Pipeline
from .runtime import Service

__all__ = ["Service", "create_app"]

log = logging.getLogger("flowdecision.service")


def create_app(settings: Settings, *, service: Service | None = None) -> Pipeline:
    """The ASGI app. With ``service`` the app uses (and on shutdown closes) it."""
    # Imported here so `python -m flowdecision.service.openapi` runs it fresh.
    from .openapi import OPENAPI_PATH, openapi_route

    context = AppContext(
        settings=settings,
        service=service,
        ledger_shown=redact_url(settings.ledger),
        sink_shown=redact_url(settings.sink),
    )
    metrics = context.metrics = ServiceMetrics(
        lambda: context.service.dispatcher.health() if context.service is not None else None,
        healthy=lambda: context.service is None or context.service.cached_health().healthy,
        cursors=lambda: context.service.cursor_states() if context.service is not None else (),
        own_relay=lambda: context.service.relay_status() if context.service is not None else None,
        holds=lambda: context.service.hold_figures() if context.service is not None else None,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Pipeline) -> AsyncIterator[None]:
        current = context.service
        if current is None:
            current = context.service = await Service.start(settings)
        if current.notifier is not None:
            notifications = metrics.hold_notifications
            current.notifier.on_result = lambda result: notifications.labels(result).inc()
        current.start_relay()  # `relay_to`: drain the outbox inside the service
        current.start_expiry()  # `hold_expire_ms`: reject holds past their time
        # Readiness: the ledger is checked before the first request, so a corrupt
        # or unreachable ledger shows in /healthz (503, with its code) from the start.
        health = await current.check_health()
        if not health.ledger.ok:
            log.error(
                "ledger check failed at startup; /healthz answers 503 until it passes",
                extra={"code": health.ledger.code},
            )
        log.info(
            "service started",
            extra={
                "ledger": context.ledger_shown,
                "sink": context.sink_shown,
                "branch": settings.production_branch,
            },
        )
        try:
            yield
        finally:
            await current.stop(settings.shutdown_grace_s)
            log.info("service stopped")

    # Admin tokens pass authentication on the operator's routes only; the action
    # routes then ask for one. The contract is public: it holds nothing a caller
    # could not read in the repository.
    tokens, admin_tokens = settings.tokens(), settings.admin_tokens()
    public = frozenset({OPENAPI_PATH} if settings.auth_healthz else {"/healthz", OPENAPI_PATH})
    return Pipeline(
        [*routes(), openapi_route()],
        guard=BrowserGuard.from_settings(settings),
        auth=Auth(tokens=tokens, public=public, admin_tokens=admin_tokens, admin_may=admin_may),
        record=RequestRecord(
            access_log_enabled=settings.access_log, on_response=metrics.count_request
        ),
        lifespan=lifespan,
        state=SimpleNamespace(context=context, settings=settings, metrics=metrics),
    )

"""Open a sink from a URL.

* ``sqlite:///path`` or ``postgresql://...`` -- an :class:`~flowdecision.sinks.outbox.OutboxSink`;
* ``http://...`` or ``https://...`` -- a :class:`~flowdecision.sinks.webhook.WebhookSink`;
* ``python:module:attribute`` -- a custom sink: a class (instantiated without
  arguments), a factory function (called without arguments; may be async) or a
  ready instance. The result must have an ``async def submit(request, attempt)``;
  an async ``open()`` is awaited after loading and ``close()``/``aclose()`` on
  shutdown, when present;
* ``procrastinate+postgresql://…?task=NAME`` -- a
  :class:`~flowdecision.sinks.procrastinate.ProcrastinateSink` (extra ``procrastinate``);
* ``dbos+sqlite:///path?workflow=module:function`` or ``dbos+postgresql://…?workflow=…``
  -- a :class:`~flowdecision.sinks.dbos.DBOSSink` (extra ``dbos``);
* ``temporal://host:port/namespace?task_queue=Q&workflow=Name`` -- a
  :class:`~flowdecision.sinks.temporal.TemporalSink` (extra ``temporal``);
* ``restate+http://ingress:8080/Service/handler`` (or ``/Object/{run_id}/handler``)
  -- a :class:`~flowdecision.sinks.restate.RestateSink`.

The engine sinks import their engine only when their URL is opened, so
``import flowdecision`` never needs procrastinate, DBOS or temporalio.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from ..connections.urls import load_attribute, redact_url
from ..core.defaults import WEBHOOK_MAX_ATTEMPTS, WEBHOOK_TIMEOUT_S
from ..errors import SinkConfigError
from ..observability.redact import redact_text
from .base import Sink, has_async_submit

__all__ = [
    "SINK_SCHEMES",
    "SinkConfigError",
    "WebhookOptions",
    "check_sink_url",
    "close_sink",
    "open_sink",
]

SINK_SCHEMES = (
    "sqlite:///path",
    "postgresql://...",
    "http(s)://...",
    "python:module:attribute",
    "procrastinate+postgresql://...?task=NAME",
    "dbos+sqlite:///path?workflow=module:function",
    "dbos+postgresql://...?workflow=module:function",
    "temporal://host:port/namespace?task_queue=Q&workflow=Name",
    "restate+http(s)://ingress/Service/handler",
)
#: Engine sinks: URL prefix -> (kind, the pip extra that provides the engine).
_ENGINE_PREFIXES = {
    "procrastinate+": ("procrastinate", "procrastinate"),
    "dbos+": ("dbos", "dbos"),
    "temporal://": ("temporal", "temporal"),
    "restate+": ("restate", "restate"),
}


@dataclass(frozen=True, slots=True)
class WebhookOptions:
    timeout_s: float = WEBHOOK_TIMEOUT_S
    max_attempts: int = WEBHOOK_MAX_ATTEMPTS
    token: str | None = None


def sink_kind(url: str) -> str:
    """The sink kind: ``outbox``, ``webhook``, ``python``, ``procrastinate``, ``dbos``,
    ``temporal`` or ``restate``.

    Raises :class:`SinkConfigError` for anything else.
    """
    if url.startswith("python:"):
        return "python"
    for prefix, (kind, _) in _ENGINE_PREFIXES.items():
        if url.lower().startswith(prefix):
            return kind
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("sqlite", "postgres", "postgresql"):
        return "outbox"
    if scheme in ("http", "https"):
        return "webhook"
    shown = f"`{scheme}`" if scheme else "(none)"
    raise SinkConfigError(
        f"unsupported sink URL scheme {shown} in `{redact_url(url)}`: "
        f"expected one of {', '.join(SINK_SCHEMES)}"
    )


def check_sink_url(url: str) -> str:
    """The sink kind of ``url``, after checking everything that can be checked without
    connecting: the scheme, the engine's own URL syntax and required parameters, the
    extra it needs. Raises :class:`SinkConfigError` (a configuration error: exit 2)."""
    kind = sink_kind(url)
    if kind == "outbox":
        from .outbox import parse_outbox_url

        try:
            parse_outbox_url(url)
        except Exception as error:
            raise SinkConfigError(f"outbox sink URL `{redact_url(url)}`: {error}") from None
    elif kind == "webhook" and not urlsplit(url).hostname:
        raise SinkConfigError(f"webhook URL `{redact_url(url)}` has no host")
    elif kind == "procrastinate":
        _require_extra(url, "procrastinate", "procrastinate")
        from .procrastinate import parse_procrastinate_url

        parse_procrastinate_url(url)
    elif kind == "dbos":
        _require_extra(url, "dbos", "dbos")
        from .dbos import parse_dbos_url

        parse_dbos_url(url)
    elif kind == "temporal":
        _require_extra(url, "temporalio", "temporal")
        from .temporal import parse_temporal_url

        parse_temporal_url(url)
    elif kind == "restate":
        from .restate import parse_restate_url

        parse_restate_url(url)
    elif kind == "python":
        _python_spec(url)
    return kind


def _python_spec(url: str) -> str:
    """``module:attribute`` of a ``python:`` sink URL, or :class:`SinkConfigError`."""
    spec = url[len("python:") :]
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise SinkConfigError(
            f"custom sink URL `{redact_url(url)}` must look like python:module:attribute"
        )
    return spec


async def open_sink(url: str, *, webhook: WebhookOptions | None = None) -> Sink:
    """Create and open the sink ``url`` names."""
    kind = sink_kind(url)
    if kind == "outbox":
        from .outbox import OutboxSink

        outbox = OutboxSink(url)
        await outbox.open()
        return cast(Sink, outbox)
    if kind == "webhook":
        from .webhook import WebhookSink

        options = webhook or WebhookOptions()
        if not urlsplit(url).hostname:
            raise SinkConfigError(f"webhook URL `{redact_url(url)}` has no host")
        sink = WebhookSink(
            url,
            timeout_s=options.timeout_s,
            max_attempts=options.max_attempts,
            token=options.token,
        )
        return await sink.open()
    if kind == "procrastinate":
        _require_extra(url, "procrastinate", "procrastinate")
        from .procrastinate import open_procrastinate_url

        return cast(Sink, await open_procrastinate_url(url))
    if kind == "dbos":
        _require_extra(url, "dbos", "dbos")
        from .dbos import open_dbos_url

        return cast(Sink, await open_dbos_url(url))
    if kind == "temporal":
        _require_extra(url, "temporalio", "temporal")
        from .temporal import open_temporal_url

        return cast(Sink, await open_temporal_url(url))
    if kind == "restate":
        _require_extra(url, "aiohttp", "restate")
        from .restate import open_restate_url

        options = webhook or WebhookOptions()
        return cast(Sink, await open_restate_url(url, timeout_s=options.timeout_s))
    return await _load_python(url)


def _require_extra(url: str, module: str, extra: str) -> None:
    """Fail clearly when an engine sink's package is not installed."""
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise SinkConfigError(
            f"sink `{redact_url(url)}` needs the `{module}` package: "
            f"pip install 'flowdecision[{extra}]' "
            f"({error})"
        ) from error


async def _load_python(url: str) -> Sink:
    target = load_attribute(url, _python_spec(url))
    if inspect.isclass(target) or (callable(target) and not hasattr(target, "submit")):
        try:
            target = target()
        except Exception as error:
            raise SinkConfigError(
                f"custom sink `{redact_url(url)}`: creating it failed: {redact_text(str(error))}"
            ) from error
        if inspect.isawaitable(target):
            target = await target
    if not has_async_submit(target):
        raise SinkConfigError(
            f"custom sink `{redact_url(url)}` must provide `async def submit(request, attempt)`, "
            f"got {type(target).__qualname__}"
        )
    opener = getattr(target, "open", None)
    if opener is not None and inspect.iscoroutinefunction(opener):
        await opener()
    return cast(Sink, target)


async def close_sink(sink: object) -> None:
    """Call the sink's ``aclose()`` or ``close()`` if it has one (awaiting it if async)."""
    for name in ("aclose", "close"):
        closer = getattr(sink, name, None)
        if callable(closer):
            result = closer()
            if inspect.isawaitable(result):
                await result
            return

"""Open a sink from a URL.

* ``sqlite:///path`` or ``postgresql://...`` -- an :class:`~flowdecision.sinks.outbox.OutboxSink`;
* ``http://...`` or ``https://...`` -- a :class:`~flowdecision.sinks.webhook.WebhookSink`;
* ``python:module:attribute`` -- a custom sink: a class (instantiated without
  arguments), a factory function (called without arguments; may be async) or a
  ready instance. The result must have an ``async def submit(request, attempt)``;
  an async ``open()`` is awaited after loading and ``close()``/``aclose()`` on
  shutdown, when present.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, cast
from urllib.parse import urlsplit

from ..errors import FlowDecisionError
from .base import Sink, has_async_submit

__all__ = ["SINK_SCHEMES", "SinkConfigError", "WebhookOptions", "close_sink", "open_sink"]

SINK_SCHEMES = ("sqlite:///path", "postgresql://...", "http(s)://...", "python:module:attribute")


class SinkConfigError(FlowDecisionError):
    """The sink URL is malformed, names an unknown scheme, or loads something unusable."""

    code: ClassVar[str] = "sink_config"


@dataclass(frozen=True, slots=True)
class WebhookOptions:
    timeout_s: float = 10.0
    max_attempts: int = 4
    token: str | None = None


def sink_kind(url: str) -> str:
    """``outbox``, ``webhook`` or ``python`` (raises :class:`SinkConfigError` otherwise)."""
    if url.startswith("python:"):
        return "python"
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("sqlite", "postgres", "postgresql"):
        return "outbox"
    if scheme in ("http", "https"):
        return "webhook"
    shown = f"`{scheme}`" if scheme else "(none)"
    raise SinkConfigError(
        f"unsupported sink URL scheme {shown} in `{url}`: expected one of {', '.join(SINK_SCHEMES)}"
    )


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
            raise SinkConfigError(f"webhook URL `{url}` has no host")
        sink = WebhookSink(
            url,
            timeout_s=options.timeout_s,
            max_attempts=options.max_attempts,
            token=options.token,
        )
        return await sink.open()
    return await _load_python(url)


async def _load_python(url: str) -> Sink:
    spec = url[len("python:") :]
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise SinkConfigError(f"custom sink URL `{url}` must look like python:module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise SinkConfigError(
            f"custom sink `{url}`: cannot import `{module_name}`: {error}"
        ) from error
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise SinkConfigError(
                f"custom sink `{url}`: `{module_name}` has no attribute `{attribute}`"
            ) from None
    if inspect.isclass(target) or (callable(target) and not hasattr(target, "submit")):
        try:
            target = target()
        except Exception as error:
            raise SinkConfigError(f"custom sink `{url}`: creating it failed: {error}") from error
        if inspect.isawaitable(target):
            target = await target
    if not has_async_submit(target):
        raise SinkConfigError(
            f"custom sink `{url}` must provide `async def submit(request, attempt)`, "
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

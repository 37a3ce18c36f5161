"""What the engine sinks' URLs share: ``ENGINE+STORE_URL?…`` split into the store's URL
and the sink's own parameters, and ``module:attribute`` specs imported."""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import parse_qsl, urlencode

from ..errors import SinkConfigError
from ..redact import redact_url

__all__ = ["load_attribute", "split_engine_url"]


def split_engine_url(
    url: str, engine: str, own_params: tuple[str, ...]
) -> tuple[str, dict[str, str]]:
    """Split ``ENGINE+STORE_URL?...`` into the store URL and the sink's own parameters.

    The parameters named in ``own_params`` are removed from the query (each may
    appear once); all others stay in the returned store URL (``sslmode`` …).
    """
    prefix = f"{engine}+"
    if not url.lower().startswith(prefix):
        raise SinkConfigError(f"`{redact_url(url)}` is not a {engine}+… sink URL")
    target = url[len(prefix) :]
    # Cut the query textually: urlunsplit would rewrite sqlite:////abs/path.
    base, _, query = target.partition("?")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as error:
        raise SinkConfigError(
            f"{engine} sink URL `{redact_url(url)}` is malformed: {error}"
        ) from error
    own: dict[str, str] = {}
    rest: list[tuple[str, str]] = []
    for name, value in pairs:
        if name in own_params:
            if name in own:
                raise SinkConfigError(f"{engine} sink URL `{redact_url(url)}` sets `{name}` twice")
            own[name] = value
        else:
            rest.append((name, value))
    store = f"{base}?{urlencode(rest)}" if rest else base
    return store, own


def load_attribute(url: str, spec: str) -> Any:
    """Import ``module:attribute`` (the attribute may be dotted) for the sink ``url``."""
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise SinkConfigError(
            f"sink URL `{redact_url(url)}`: `{spec}` must look like module:attribute"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise SinkConfigError(
            f"sink `{redact_url(url)}`: cannot import `{module_name}`: {error}"
        ) from error
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise SinkConfigError(
                f"sink `{redact_url(url)}`: `{module_name}` has no attribute `{attribute}`"
            ) from None
    return target

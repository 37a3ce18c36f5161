"""Types of the optional C extension built from _otlp.c (see tracer.c_encoder)."""

from typing import Any

def configure(
    kinds: tuple[Any, ...], codes: tuple[Any, ...], unset_status: Any, empty_state: Any, /
) -> None: ...
def span(span: Any, /) -> bytes | None: ...

"""Types of the optional C extension built from _fastreq.c (see model.DecisionRequest.parse)."""

from typing import Any

from .core.model import DecisionRequest

def decode(body: object, /) -> DecisionRequest | None: ...
def configure_types(
    request: type[Any], schedule_step: type[Any], step: type[Any], default_retry: Any, /
) -> None: ...
def configure_digests(
    sha256: Any, identity_domain: str, evidence_domain: str, result_domain: str, /
) -> None: ...

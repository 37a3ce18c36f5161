"""Types of the optional C extension built from _fastreq.c (see model.DecisionRequest.parse)."""

from typing import Any

def decode(body: object, /) -> tuple[Any, ...] | None: ...
def configure(
    sha256: Any, identity_domain: str, evidence_domain: str, result_domain: str, /
) -> None: ...

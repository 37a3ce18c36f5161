"""What a common request body costs, decoded in C (``_fastreq``) or in Python, with its
wire texts, request hash and receipt (issue 39, "JSON once": do the C writers pay?).

    .venv/bin/python bench/fastreq_texts.py            # medians of 5 rounds, µs per body

Counts process CPU time (not wall time), in process, no I/O.
"""

from __future__ import annotations

import statistics
import time

import flowdecision.core.model as model
from flowdecision.core.identity import decision_receipt
from flowdecision.core.model import DecisionRequest, request_hash
from post_costs import common_body  # the same body (bench/ is on the path)

BODIES = [common_body(n) for n in range(20_000)]


def per_body(fast: bool) -> float:
    """µs of CPU per body: parse, wire text, decision text, request hash, receipt."""
    saved = model._fast_decode
    if not fast:
        model._fast_decode = None
    try:
        started = time.process_time()
        for body in BODIES:
            request = DecisionRequest.parse(body)
            request.to_json()
            request.decision_json()
            request_hash(request)
            decision_receipt(request)
        return (time.process_time() - started) / len(BODIES) * 1e6
    finally:
        model._fast_decode = saved


def main() -> None:
    if model._fast_decode is None:
        raise SystemExit(
            "the _fastreq extension is not built (python setup.py build_ext --inplace)"
        )
    rounds: dict[str, list[float]] = {"C (_fastreq)": [], "Python + orjson": []}
    for _ in range(5):
        rounds["C (_fastreq)"].append(per_body(True))
        rounds["Python + orjson"].append(per_body(False))
    for name, values in rounds.items():
        print(f"{name:16} {statistics.median(values):6.1f} µs per body (median of 5)")


if __name__ == "__main__":
    main()

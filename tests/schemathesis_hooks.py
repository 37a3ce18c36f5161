"""Schemathesis hooks for tests/test_schemathesis.py (loaded through SCHEMATHESIS_HOOKS).

Generated decisions almost never name the production branch, so nearly every
POST would be a 403 and the POST -> GET link would never be followed. Half of
the generated request bodies are sent on the production branch instead.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import strategies as st


@schemathesis.hook
def flatmap_body(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy[Any]:
    if isinstance(body, dict) and isinstance(body.get("authority_branch_id"), str):
        return st.sampled_from([body, {**body, "authority_branch_id": "production"}])
    return st.just(body)


@schemathesis.hook
def map_query(context: schemathesis.HookContext, query: Any) -> Any:
    # `GET /v1/outbox?wait=S` may wait up to 30 s for a row, longer than the run's
    # request timeout: keep the long-poll short (its behaviour is tested in
    # tests/test_outbox_http.py).
    if isinstance(query, dict) and isinstance(query.get("wait"), int):
        return {**query, "wait": min(query["wait"], 1)}
    return query

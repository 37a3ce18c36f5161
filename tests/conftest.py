"""Shared fixtures. Backend and PostgreSQL fixtures live in their own block below."""

from __future__ import annotations

# ---------------------------------------------------------------------------
# END ledger backends + PostgreSQL
# ---------------------------------------------------------------------------
# ---------------------------------------------------------------------------
# BEGIN engine servers (issue 15; defined in tests/engine_fixtures.py)
# ---------------------------------------------------------------------------
from tests.engine_fixtures import (  # noqa: F401 (fixtures, re-exported)
    restate_deployment,
    restate_effects,
    restate_server,
    temporal_server,
    temporal_worker,
)

# ---------------------------------------------------------------------------
# BEGIN ledger backends + PostgreSQL (issue 3; defined in tests/ledger_fixtures.py)
# ---------------------------------------------------------------------------
from tests.ledger_fixtures import (  # noqa: F401 (fixtures and a hook, re-exported)
    backend,
    pg_empty_url,
    pg_server_url,
    pg_url,
    pytest_terminal_summary,
    shared_store_url,
)

# ---------------------------------------------------------------------------
# END engine servers
# ---------------------------------------------------------------------------

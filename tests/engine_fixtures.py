"""Session fixtures over tests/engine_servers.py, re-exported by tests/conftest.py.

Each server starts once per test session, when a test first asks for it, and
stops at the end. None skips: a server that cannot start fails the tests that
need it, with the reason.

* ``temporal_server`` -- a :class:`~tests.engine_servers.TemporalServer`;
* ``temporal_worker`` -- a worker process for tests/temporal_workflows.py on the
  task queue :data:`TEMPORAL_QUEUE` of that server;
* ``restate_server`` -- a :class:`~tests.engine_servers.RestateServer`;
* ``restate_deployment`` -- examples/restate_service.py served by hypercorn and
  registered with ``restate_server``; ``restate_effects`` is the file its
  ``Decisions/handle`` appends one line per decision to.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine_servers import (
    RestateDeployment,
    RestateServer,
    TemporalServer,
    TemporalWorkerProcess,
)

#: The task queue the session's Temporal worker polls.
TEMPORAL_QUEUE = "flowdecision-tests"


@pytest.fixture(scope="session")
def temporal_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TemporalServer]:
    server = TemporalServer(tmp_path_factory.mktemp("temporal"))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def temporal_worker(temporal_server: TemporalServer) -> Iterator[TemporalWorkerProcess]:
    worker = TemporalWorkerProcess(temporal_server, TEMPORAL_QUEUE)
    try:
        yield worker.start()
    finally:
        worker.stop()


@pytest.fixture(scope="session")
def restate_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestateServer]:
    server = RestateServer(tmp_path_factory.mktemp("restate"))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def restate_effects(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("restate-effects") / "effects.log"


@pytest.fixture(scope="session")
def restate_deployment(
    restate_server: RestateServer, restate_effects: Path
) -> Iterator[RestateDeployment]:
    deployment = RestateDeployment(
        "examples.restate_service:app",
        restate_effects.parent,
        env={"FLOWDECISION_RESTATE_EFFECTS": str(restate_effects)},
    )
    try:
        deployment.start()
        restate_server.register(deployment.uri)
        yield deployment
    finally:
        deployment.stop()

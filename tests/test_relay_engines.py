"""``flowdecision relay`` into real Temporal and Restate servers: a relay SIGKILLed
mid-batch and restarted, and the engine stopped and restarted under a running
relay. Every row is delivered, and the engine applies each decision once, in order.

The servers, the Temporal worker and the Restate service are the session's
(tests/engine_fixtures.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from flowdecision.sinks import OutboxSink
from tests.engine_fixtures import TEMPORAL_QUEUE
from tests.engine_servers import RestateServer, TemporalServer, stopped
from tests.service_process import ServiceProcess, decision, wait_for
from tests.test_relay_process import HOLDS, RelayProcess, _cli
from tests.test_restate_sink import applied


def _fill(url: str, run_id: str, count: int, start: int = 0) -> list[str]:
    ids = [f"{run_id}-d{index:03d}" for index in range(start, start + count)]

    async def go() -> None:
        async with OutboxSink(url) as outbox:
            for decision_id in ids:
                await outbox.submit(decision(decision_id, run_id=run_id), 1)

    asyncio.run(go())
    return ids


def _fill_runs(url: str, run_ids: list[str], per_run: int) -> dict[str, list[str]]:
    """``per_run`` decisions for each run, the runs' rows interleaved in the outbox."""
    expected: dict[str, list[str]] = {run_id: [] for run_id in run_ids}

    async def go() -> None:
        async with OutboxSink(url) as outbox:
            for index in range(per_run):
                for run_id in run_ids:
                    decision_id = f"{run_id}-d{index:03d}"
                    await outbox.submit(decision(decision_id, run_id=run_id), 1)
                    expected[run_id].append(decision_id)

    asyncio.run(go())
    return expected


def _position(cwd: Path, url: str) -> int:
    done = _cli(cwd, "outbox", "cursors", "--sink", url, "--json")
    assert done.returncode == 0, done.stderr
    (cursor,) = json.loads(done.stdout)
    return int(cursor["position"])


class Temporal:
    """The decisions a FlowRun workflow applied (its ``effects`` query)."""

    def __init__(self, server: TemporalServer, run_id: str) -> None:
        self.server = server
        self.run_id = run_id

    def applied(self) -> list[str]:
        async def query() -> list[list[Any]]:
            client = await Client.connect(self.server.address)
            try:
                result: list[list[Any]] = await client.get_workflow_handle(self.run_id).query(
                    "effects"
                )
                return result
            except Exception:  # not started yet, or the server is restarting
                return []

        return [effect[1] for effect in asyncio.run(query())]


class Restate:
    """The decisions a DecisionRun object applied, in the order it applied them."""

    def __init__(self, server: RestateServer, run_id: str) -> None:
        self.server = server
        self.run_id = run_id

    def applied(self) -> list[str]:
        try:
            state = asyncio.run(applied(self.server, self.run_id))
        except Exception:  # the server is restarting
            return []
        return sorted(state, key=lambda decision_id: state[decision_id]["order"])


@pytest.fixture(params=["temporal", "restate"])
def engine(request: pytest.FixtureRequest) -> tuple[str, Any]:
    """(sink URL, an object whose ``applied()`` lists the run's applied decision ids)."""
    run_id = f"run-{uuid.uuid4().hex[:10]}"
    if request.param == "temporal":
        request.getfixturevalue("temporal_worker")
        server: Any = request.getfixturevalue("temporal_server")
        return server.url(TEMPORAL_QUEUE, "FlowRun"), Temporal(server, run_id)
    request.getfixturevalue("restate_deployment")
    server = request.getfixturevalue("restate_server")
    return server.url("DecisionRun", "apply", keyed_by_run=True), Restate(server, run_id)


def _target(engine: tuple[str, Any], run_id: str) -> Any:
    """The engine's view of another run."""
    return type(engine[1])(engine[1].server, run_id)


def test_runs_delivered_concurrently_each_in_seq_order(
    engine: tuple[str, Any], tmp_path: Path
) -> None:
    sink_url, first = engine
    url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    runs = [first, *(_target(engine, f"{first.run_id}-{n}") for n in range(1, 6))]
    expected = _fill_runs(url, [target.run_id for target in runs], 8)
    done = _cli(tmp_path, "relay", "--from", url, "--to", sink_url, "--once",
                "--concurrency", "6")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "delivered 48 rows; parked 0" in done.stderr
    for target in runs:
        wait_for(lambda target=target: len(target.applied()) == 8, timeout=120)
        assert target.applied() == expected[target.run_id]


def test_an_engine_down_when_the_relay_starts_is_waited_for(
    engine: tuple[str, Any], tmp_path: Path
) -> None:
    sink_url, target = engine
    url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    ids = _fill(url, target.run_id, 3)
    with stopped(target.server):
        relay = RelayProcess(tmp_path, url, sink_url, "--retry-cap-s", "1")
        try:
            wait_for(lambda: "relay delivery failed; retrying" in relay.text(), timeout=120)
            assert relay.proc.poll() is None, relay.text()  # waiting, not exited
        except BaseException:
            relay.terminate()
            raise
    try:
        wait_for(lambda: target.applied() == ids, timeout=180)
    finally:
        assert relay.terminate() == 0, relay.text()


def test_a_relay_killed_mid_batch_and_restarted_applies_each_decision_once(
    engine: tuple[str, Any], tmp_path: Path
) -> None:
    sink_url, first = engine
    url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    runs = [first, *(_target(engine, f"{first.run_id}-{n}") for n in range(1, 4))]
    # Restate takes ~1,000 decisions/s here, Temporal ~50: enough rows that the kill
    # lands mid-way either way. 4 runs, their rows interleaved: 4 lanes at once.
    per_run = 150 if isinstance(first, Restate) else 20
    expected = _fill_runs(url, [target.run_id for target in runs], per_run)
    total = 4 * per_run

    def applied() -> int:
        return sum(len(target.applied()) for target in runs)

    options = ("--batch", "100", "--lease-ms", "1000", "--concurrency", "8")
    relay = RelayProcess(tmp_path, url, sink_url, *options)
    wait_for(lambda: applied() >= 4, timeout=120)
    relay.kill()
    assert _position(tmp_path, url) < total  # killed mid-way
    second = RelayProcess(tmp_path, url, sink_url, *options)
    try:
        wait_for(lambda: applied() >= total, timeout=120)
        wait_for(lambda: _position(tmp_path, url) == total, timeout=60)
    finally:
        assert second.terminate() == 0, second.text()
    # The second relay redelivered the rows past the saved cursor; the engine
    # absorbed them: each decision applied once, each run in seq order.
    assert HOLDS in second.text()
    for target in runs:
        assert target.applied() == expected[target.run_id]


def test_an_engine_stopped_and_restarted_under_a_running_relay(
    engine: tuple[str, Any], tmp_path: Path
) -> None:
    sink_url, target = engine
    server = target.server
    url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    ids = _fill(url, target.run_id, 5)
    relay = RelayProcess(tmp_path, url, sink_url, "--retry-cap-s", "1", "--poll-max-s", "0.05")
    try:
        wait_for(lambda: target.applied() == ids, timeout=120)
        with stopped(server):
            more = _fill(url, target.run_id, 5, start=5)
            wait_for(lambda: "relay delivery failed; retrying" in relay.text(), timeout=120)
            assert _position(tmp_path, url) == 5  # nothing lost, nothing skipped
        wait_for(lambda: target.applied() == ids + more, timeout=180)
        wait_for(lambda: _position(tmp_path, url) == 10, timeout=60)
    finally:
        assert relay.terminate() == 0, relay.text()


def test_serve_relay_to_an_engine_that_is_down_keeps_trying_and_says_so(
    engine: tuple[str, Any], tmp_path: Path
) -> None:
    """``serve --relay-to`` with the engine down at start: the relay never dies silently;
    /healthz's body and /metrics say it waits; the same service delivers once the engine
    is up."""
    import httpx

    sink_url, target = engine
    server = target.server
    server.stop()
    try:
        proc = ServiceProcess(tmp_path, "--relay-to", sink_url)
    except BaseException:
        server.start()
        raise
    with proc:
        try:
            body = decision(f"{target.run_id}-d000", run_id=target.run_id).to_json()
            answer = httpx.post(f"{proc.url}/v1/decisions", content=body, headers=proc.headers)
            assert answer.status_code == 201, answer.text  # the POST commits locally

            def waiting() -> bool:
                relay = httpx.get(f"{proc.url}/healthz").json().get("relay") or {}
                return relay.get("state") in ("opening", "retrying", "backing_off")

            wait_for(waiting, timeout=120)
            health = httpx.get(f"{proc.url}/healthz")
            assert health.status_code == 200  # the replica still takes POSTs
            relay = health.json()["relay"]
            assert relay["name"] == "default" and relay["last_error"], relay
            metrics = httpx.get(f"{proc.url}/metrics").text
            state = relay["state"]
            assert f'flowdecision_relay_state{{relay="default",state="{state}"}} 1.0' in metrics
            assert 'flowdecision_relay_state{relay="default",state="delivering"} 0.0' in metrics
        finally:
            server.start()
        wait_for(lambda: target.applied() == [f"{target.run_id}-d000"], timeout=180)
        wait_for(
            lambda: httpx.get(f"{proc.url}/healthz").json()["relay"]["state"] == "idle",
            timeout=60,
        )

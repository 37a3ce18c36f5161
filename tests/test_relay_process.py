"""``flowdecision relay`` as real processes against a real HTTP receiver: SIGKILLed
mid-batch and restarted, the receiver stopped and restarted under it, two
processes with one name, and ``outbox cursors``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from flowdecision.model import DecisionRequest
from flowdecision.sinks import OutboxSink
from tests.helpers import request
from tests.service_process import ROOT, wait_for
from tests.webhook_receiver import WebhookReceiver

#: The log record of a relay that got its cursor's lease (JSON log lines).
HOLDS = '"message": "relay holds its cursor"'


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", *args],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


class RelayProcess:
    """``flowdecision relay --from URL --to URL ...`` with its stderr in a file."""

    def __init__(self, cwd: Path, outbox: str, to: str, *args: str) -> None:
        self.log = cwd / f"relay-{time.monotonic_ns()}.log"
        self._err = open(self.log, "wb")  # closed in wait()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowdecision.cli", "relay", "--from", outbox, "--to", to,
             *args],
            cwd=cwd, env=_env(), stdout=subprocess.DEVNULL, stderr=self._err,
        )  # fmt: skip

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.wait()

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.wait()

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            self._err.close()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _fill(url: str, count: int) -> list[str]:
    ids = [f"d-{index:04d}" for index in range(count)]

    async def go() -> None:
        async with OutboxSink(url) as outbox:
            for decision_id in ids:
                await outbox.submit(request(decision_id=decision_id, run_id="run-7"), 1)

    asyncio.run(go())
    return ids


def _received(receiver: WebhookReceiver) -> list[str]:
    return [DecisionRequest.parse(body).decision_id for _, _, body in list(receiver.requests)]


def _cursors(cwd: Path, url: str) -> list[dict[str, object]]:
    done = _cli(cwd, "outbox", "cursors", "--sink", url, "--json")
    assert done.returncode == 0, done.stderr
    result: list[dict[str, object]] = json.loads(done.stdout)
    return result


def test_a_relay_sigkilled_mid_batch_and_restarted_delivers_every_row(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    ids = _fill(url, 120)
    with WebhookReceiver() as receiver:
        receiver.delay_s = 0.005
        options = ("--name", "billing", "--batch", "50", "--lease-ms", "1000")
        first = RelayProcess(tmp_path, url, receiver.url, *options)
        wait_for(lambda: len(receiver.requests) >= 70, timeout=60)  # inside the second batch
        first.kill()
        before = _received(receiver)
        (cursor,) = _cursors(tmp_path, url)
        # Killed mid-batch: rows were accepted that the cursor does not record yet.
        assert 50 <= int(cursor["position"]) < len(set(before)), (cursor, len(before))
        second = RelayProcess(tmp_path, url, receiver.url, *options)
        wait_for(lambda: set(_received(receiver)) == set(ids), timeout=60)
        assert second.terminate() == 0, second.text()
    received = _received(receiver)
    counts = Counter(received)
    # At least once, in seq order per run; the redeliveries are exactly the rows
    # accepted after the cursor's last advance (the receiver's dedup absorbs them).
    redelivered = sorted(decision_id for decision_id, n in counts.items() if n > 1)
    assert redelivered == [
        d for d in ids if int(cursor["position"]) < ids.index(d) + 1 <= len(set(before))
    ]
    assert max(counts.values()) == 2
    (final,) = _cursors(tmp_path, url)
    assert (final["position"], final["lag_rows"], final["leased"]) == (120, 0, False)
    assert HOLDS in second.text()


def test_a_receiver_stopped_and_restarted_under_a_running_relay(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    ids = _fill(url, 30)
    receiver = WebhookReceiver().start()
    port = receiver.port
    relay = RelayProcess(
        tmp_path, url, receiver.url, "--retry-cap-s", "0.2", "--poll-max-s", "0.05"
    )
    try:
        wait_for(lambda: set(_received(receiver)) == set(ids), timeout=60)
        receiver.stop()  # the engine goes down
        more = [f"late-{index}" for index in range(10)]

        async def add() -> None:
            async with OutboxSink(url) as outbox:
                for decision_id in more:
                    await outbox.submit(request(decision_id=decision_id), 1)

        asyncio.run(add())
        wait_for(lambda: "relay delivery failed; retrying" in relay.text(), timeout=60)
        (cursor,) = _cursors(tmp_path, url)
        assert (cursor["position"], cursor["lag_rows"]) == (30, 10)
        back = WebhookReceiver(port=port).start()  # the engine comes back on its address
        try:
            wait_for(lambda: set(_received(back)) == set(more), timeout=60)
        finally:
            back.stop()
        assert _received(back) == more  # in seq order, each once
    finally:
        assert relay.terminate() == 0, relay.text()
    (cursor,) = _cursors(tmp_path, url)
    assert (cursor["position"], cursor["lag_rows"]) == (40, 0)


def test_two_relay_processes_with_one_name_deliver_one_at_a_time(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    ids = _fill(url, 60)
    with WebhookReceiver() as receiver:
        receiver.delay_s = 0.01
        options = ("--name", "one", "--lease-ms", "1500", "--batch", "10")
        relays = [RelayProcess(tmp_path, url, receiver.url, *options) for _ in range(2)]
        wait_for(lambda: len(receiver.requests) >= 20, timeout=60)
        holder = next(r for r in relays if HOLDS in r.text())
        other = relays[1 - relays.index(holder)]
        assert "another relay holds its cursor" in other.text()
        holder.kill()  # the other takes over once the lease expires
        wait_for(lambda: set(_received(receiver)) == set(ids), timeout=60)
        assert other.terminate() == 0, other.text()
        assert HOLDS in other.text()
    assert receiver.most_in_flight == 1
    received = _received(receiver)
    assert sorted(set(received)) == ids and len(received) - len(ids) <= 10


def test_relay_refuses_a_missing_outbox_and_a_bad_sink(tmp_path: Path) -> None:
    done = _cli(tmp_path, "relay", "--from", f"sqlite:///{tmp_path / 'nope.db'}", "--to",
                "http://127.0.0.1:9/x")  # fmt: skip
    assert done.returncode == 4 and "does not exist" in done.stderr
    assert not (tmp_path / "nope.db").exists()
    url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    _fill(url, 1)
    # A configuration error exits 2 at once, before anything is opened (as `serve` does).
    done = _cli(tmp_path, "relay", "--from", url, "--to", "ftp://example/x", "--once")
    assert done.returncode == 2 and "unsupported sink URL scheme" in done.stderr, done.stderr
    for bad, problem in (
        ("temporal://127.0.0.1:7233/default?workflow=W", "needs ?task_queue="),
        ("restate+http://127.0.0.1:9", "Restate sink URL"),
        ("python:nodots", "python:module:attribute"),
    ):
        done = _cli(tmp_path, "relay", "--from", url, "--to", bad, "--once")
        assert done.returncode == 2 and problem in done.stderr, (bad, done.stderr)
    done = _cli(tmp_path, "relay", "--from", url, "--to", "python:tests.helpers:RecordingSink",
                "--once")  # fmt: skip
    assert done.returncode == 0 and "delivered 1 rows" in done.stderr, done.stderr
    done = _cli(tmp_path, "outbox", "cursors", "--sink", url, "--set", "default", "0")
    assert done.returncode == 0 and "default" in done.stdout, done.stderr
    assert _cursors(tmp_path, url)[0]["position"] == 0

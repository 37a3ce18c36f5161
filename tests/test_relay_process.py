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

from flowdecision.core.model import DecisionRequest
from flowdecision.sinks import OutboxSink
from tests.engine_servers import free_port
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


def _fill_runs(url: str, runs: int, per_run: int) -> dict[str, list[str]]:
    expected: dict[str, list[str]] = {}

    async def go() -> None:
        async with OutboxSink(url) as outbox:
            for index in range(per_run):
                for run in range(runs):
                    run_id = f"run-{run}"
                    decision_id = f"{run_id}-d{index:02d}"
                    await outbox.submit(request(decision_id=decision_id, run_id=run_id), 1)
                    expected.setdefault(run_id, []).append(decision_id)

    asyncio.run(go())
    return expected


def test_a_webhook_400_parks_one_row_and_every_other_run_is_delivered(tmp_path: Path) -> None:
    """The issue's new user: 30 decisions over 3 runs, the 6th refused with HTTP 400."""
    url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    expected = _fill_runs(url, runs=3, per_run=10)
    poison = "run-2-d01"  # the 6th row
    with WebhookReceiver() as receiver:
        receiver.refuse.add(poison)
        done = _cli(tmp_path, "relay", "--from", url, "--to", receiver.url, "--once")
        # --once returns; its exit code says rows are parked, its summary tells the truth.
        assert done.returncode == 5, done.stderr
        assert "delivered 21 rows; parked 1 (and 8 held behind them); lag 0 rows" in done.stderr
        delivered = [d for d in _received(receiver) if d != poison]
        for run_id in ("run-0", "run-1"):
            assert [d for d in delivered if d.startswith(run_id)] == expected[run_id]
        assert [d for d in delivered if d.startswith("run-2")] == ["run-2-d00"]

        listed = _cli(tmp_path, "outbox", "parked", "--sink", url, "--json")
        assert listed.returncode == 0, listed.stderr
        parked = json.loads(listed.stdout)["parked"]
        assert [(row["decision_id"], row["state"]) for row in parked][:2] == [
            (poison, "parked"),
            ("run-2-d02", "held"),
        ]
        assert "HTTP 400" in parked[0]["error"] and len(parked) == 9
        (cursor,) = _cursors(tmp_path, url)
        assert (cursor["parked_rows"], cursor["held_rows"], cursor["lag_rows"]) == (1, 8, 0)

        # A held row is not the one to act on: exit 3, as for any refused action.
        held = _cli(tmp_path, "outbox", "skip", "run-2-d03", "--sink", url, "--reason", "x")
        assert held.returncode == 3 and "held behind" in held.stderr, held.stderr

        # The receiver is fixed; an operator retries: the run is delivered, in order.
        receiver.refuse.clear()
        retried = _cli(tmp_path, "outbox", "retry", poison, "--sink", url, "--reason", "fixed",
                       "--actor", "ops@example")  # fmt: skip
        assert retried.returncode == 0 and "released for delivery" in retried.stdout
        done = _cli(tmp_path, "relay", "--from", url, "--to", receiver.url, "--once")
        assert done.returncode == 0, done.stderr
        assert "delivered 9 rows; parked 0 (and 0 held behind them)" in done.stderr
        run2 = [d for d in _received(receiver) if d.startswith("run-2")]
        # (the receiver records the refused try too: the poison's first POST got its 400)
        assert run2 == ["run-2-d00", poison, poison, *expected["run-2"][2:]]
        audit = _cli(tmp_path, "outbox", "audit", "--sink", url, "--json")
        (entry,) = json.loads(audit.stdout)["entries"]
        assert (entry["action"], entry["decision_id"], entry["actor"]) == (
            "retry",
            poison,
            "ops@example",
        )
        missing = _cli(tmp_path, "outbox", "retry", poison, "--sink", url, "--reason", "again")
        assert missing.returncode == 3 and "is not parked" in missing.stderr


def test_a_relay_started_before_its_receiver_waits_for_it(tmp_path: Path) -> None:
    """An engine down when the relay starts: it keeps trying, backing off, then delivers."""
    url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    ids = _fill(url, 20)
    port = free_port()  # nothing listens there yet: connections are refused
    relay = RelayProcess(
        tmp_path, url, f"http://127.0.0.1:{port}/hooks/decisions", "--retry-cap-s", "0.5"
    )
    try:
        wait_for(lambda: "relay delivery failed; retrying" in relay.text(), timeout=60)
        assert relay.proc.poll() is None  # still running, not exited
        with WebhookReceiver(port=port) as back:
            wait_for(lambda: set(_received(back)) == set(ids), timeout=60)
            assert _received(back) == ids  # one run: in seq order, each once
    finally:
        assert relay.terminate() == 0, relay.text()
    # One warning per kind of failure, not one per try.
    assert relay.text().count("relay delivery failed; retrying") <= 3, relay.text()

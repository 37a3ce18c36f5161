"""A full disk named as such: ``store_full`` (transient, ``Retry-After``) on SQLite
(``SQLITE_FULL``) and PostgreSQL (SQLSTATE 53100), ``/healthz`` 503 naming it,
one log line when it starts, summaries while it lasts, one when it ends.

Real full disks: a size-limited tmpfs that each test mounts and removes (root
can mount here; without root the test fails saying so, it is never skipped).
SQLite keeps its file on it; PostgreSQL keeps the ledger's and the outbox's
tables in a tablespace on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from flowdecision import Dispatcher
from flowdecision.errors import DispatchStoreFullError, StoreFullError
from flowdecision.ledger.opening import open_ledger
from flowdecision.ledger.postgres import PostgresLedger
from flowdecision.observability.outage import Outage
from flowdecision.service.runtime import OK, _check
from flowdecision.sinks import OutboxSink
from tests.helpers import step_request
from tests.postgres_server import PostgresServer
from tests.service_process import ServiceProcess, decision

BRANCH = "production"
#: A decision this large fills a 4 MiB disk within a few dozen writes.
PAYLOAD = "x" * 60_000


def _mount(path: Path, size: str, owner: str | None = None) -> None:
    options = f"size={size},mode=0700"
    if owner is not None:
        entry = pwd.getpwnam(owner)
        options += f",uid={entry.pw_uid},gid={entry.pw_gid}"
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"cannot mount a size-limited tmpfs at {path} (the full-disk tests need root): "
            f"{proc.stderr.strip()}",
            pytrace=False,
        )


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, mounted for this test and removed after it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount(disk, "4m")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path, leave_bytes: int, name: str = "filler") -> Path:
    """Fill ``disk`` with one file until about ``leave_bytes`` are free."""
    filler = disk / name
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    with open(filler, "wb") as out:
        out.write(b"\0" * max(0, free - leave_bytes))
    return filler


def _big(decision_id: str) -> Any:
    return step_request(decision_id, {"blob": PAYLOAD})


async def test_sqlite_full_disk_is_store_full_and_recovers_without_a_restart(
    small_disk: Path,
) -> None:
    url = f"sqlite:///{small_disk / 'flowdecision.db'}"
    ledger = await open_ledger(url)
    outbox = await OutboxSink(url).open()
    try:
        dispatcher = Dispatcher(BRANCH, outbox, ledger, owner_id="owner-a")
        assert dispatcher.joint
        filler = _fill(small_disk, 300_000)
        accepted: list[str] = []
        with pytest.raises(DispatchStoreFullError) as caught:
            for n in range(200):
                outcome = await dispatcher.dispatch(_big(f"d-{n}"))
                assert outcome.submitted
                accepted.append(f"d-{n}")
        error = caught.value
        assert error.code == "store_full" and "disk is full" in str(error)
        refused = f"d-{len(accepted)}"
        assert await ledger.read_record(refused) is None and await outbox.get(refused) is None
        assert dispatcher.ledger_outage.active and dispatcher.ledger_outage.code == "store_full"
        # Reads still work; a duplicate answers and does not end the outage.
        assert not (await dispatcher.dispatch(_big(accepted[0]))).submitted
        assert dispatcher.ledger_outage.active
        filler.unlink()
        assert (await dispatcher.dispatch(_big(refused))).submitted
        assert not dispatcher.ledger_outage.active
        for decision_id in accepted:
            record = await ledger.read_record(decision_id)
            assert record is not None and record.status.value == "completed"
            assert await outbox.get(decision_id) is not None
    finally:
        await outbox.close()
        await ledger.close()
    conn = sqlite3.connect(small_disk / "flowdecision.db")
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()


def _post(url: str, body: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    req = urllib.request.Request(
        f"{url}/v1/decisions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return (
                resp.status,
                {k.lower(): v for k, v in resp.headers.items()},
                json.loads(resp.read()),
            )
    except urllib.error.HTTPError as error:
        return (
            error.code,
            {k.lower(): v for k, v in error.headers.items()},
            json.loads(error.read()),
        )


def _healthz(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _padded(decision_id: str, n: int) -> bytes:
    """A POST body with :data:`PAYLOAD` in its step input."""
    return (
        decision(decision_id, n=n).to_json().replace(b'"n":', b'"pad":"%s","n":' % PAYLOAD.encode())
    )


def _lines(log: str, message: str) -> list[dict[str, Any]]:
    found = []
    for line in log.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("message") == message:
                found.append(record)
    return found


def test_serve_answers_store_full_names_it_in_healthz_and_logs_start_summary_end(
    small_disk: Path, tmp_path: Path
) -> None:
    db = small_disk / "flowdecision.db"
    with ServiceProcess(tmp_path, "--ledger", f"sqlite:///{db}", "--outage-summary-s", "1") as svc:
        _fill(small_disk, 300_000)
        statuses: list[int] = []
        for n in range(200):
            body = _padded(f"big-{n}", n)
            status, headers, answer = _post(svc.url, body)
            statuses.append(status)
            if status != 201:
                break
        assert status == 503, (statuses, answer)
        assert answer["error"]["code"] == "store_full" and headers["retry-after"] == "1"
        assert "disk space" in answer["error"]["message"]
        code, health = _healthz(svc.url)
        assert code == 503 and health["reason"] == "store_full"
        assert health["checks"]["ledger"] == {"status": "failed", "code": "store_full"}
        # It lasts over two summary periods, with requests refused all along. The store
        # may find room inside its own files meanwhile (a WAL that a checkpoint emptied
        # starts over in place): then requests are accepted, which ends that outage, and
        # the next refusal starts another; the test takes what is left of the disk too
        # and waits for a whole refused stretch again.
        refused, outages, accepted_last, fills = 1, 1, False, 0
        stretch = time.monotonic()
        give_up = stretch + 30
        while time.monotonic() - stretch < 2.5:
            assert time.monotonic() < give_up, "the store never stayed full for 2.5 s"
            status, _, answer = _post(svc.url, body)
            if status == 201:
                accepted_last, fills = True, fills + 1
                _fill(small_disk, 0, name=f"filler-{fills}")
                body = _padded(f"again-{fills}", 0)
                refused, stretch = 0, time.monotonic()
                continue
            assert (status, answer.get("error", {}).get("code")) == (503, "store_full"), answer
            if accepted_last:
                outages += 1
            accepted_last = False
            refused += 1
            time.sleep(0.1)
        assert 500 not in statuses
        for taken in small_disk.glob("filler*"):
            taken.unlink()
        status, _, answer = _post(svc.url, body)
        assert status == 201, answer
        time.sleep(1.1)  # the probe's cached result expires
        _code, health = _healthz(svc.url)
        # The ledger check passes again (the minute's error rate may still be high).
        assert health["checks"]["ledger"] == {"status": "ok", "code": None}, health
        assert health["reason"] in (None, "error_rate")
        svc.stop()
        log = svc.log_text()
    started = _lines(log, "store unavailable")
    summaries = _lines(log, "store still unavailable")
    ended = _lines(log, "store available again")
    # One outage, or one more for each time the store found room by itself (above).
    assert [r["code"] for r in started] == ["store_full"] * outages, log[-3000:]
    assert 1 <= len(summaries) <= 2 + 2 * outages
    assert all(r["code"] == "store_full" for r in summaries)
    assert summaries[-1]["attempts"] >= refused // 2
    assert len(ended) == outages and ended[-1]["attempts"] >= refused
    # No line per refused request (they are at debug level).
    assert not [r for r in _lines(log, "request failed") if r.get("code") == "store_full"]


def test_healthz_recovers_with_the_first_successful_write_every_time(
    small_disk: Path, tmp_path: Path
) -> None:
    """Issue 38: /healthz stayed 503 `store_full` after writes succeeded again (a probe's
    result from the outage, reused; a probe's read that found no room restarting it)."""
    db = small_disk / "flowdecision.db"
    with ServiceProcess(tmp_path, "--ledger", f"sqlite:///{db}") as svc:
        for episode in range(3):
            filler = _fill(small_disk, 300_000, name=f"filler-{episode}")
            for n in range(200):
                status, _, answer = _post(svc.url, _padded(f"e{episode}-{n}", n))
                if status != 201:
                    break
            assert (status, answer["error"]["code"]) == (503, "store_full"), answer
            code, health = _healthz(svc.url)  # probed during the outage
            assert (code, health["checks"]["ledger"]["code"]) == (503, "store_full"), health
            filler.unlink()
            status, _, answer = _post(svc.url, _padded(f"e{episode}-room", 0))
            assert status == 201, answer
            # At once, not after the probe's cached result expires.
            _code, health = _healthz(svc.url)
            assert health["checks"]["ledger"] == {"status": "ok", "code": None}, (episode, health)
            assert health["reason"] in (None, "error_rate")


async def test_a_probe_read_that_finds_no_room_does_not_start_a_full_disk_outage() -> None:
    outage = Outage(logging.getLogger("test"), "store")

    async def read_without_room() -> None:
        raise StoreFullError("sqlite ledger `x`: the disk is full")

    assert await _check(read_without_room, "ledger", outage) == OK
    assert not outage.active  # only a refused write starts one (and a write ends it)


# -- PostgreSQL: the tables in a tablespace on a small tmpfs ---------------------------------


@pytest.fixture
def pg_small_tablespace(tmp_path: Path) -> Iterator[tuple[PostgresServer, str]]:
    """A throwaway server (as the ``postgres`` account) and a database whose
    ledger and outbox tables live in a tablespace on an 8 MiB tmpfs."""
    server = PostgresServer(fast=True)
    # Inside the server's own directory: its account can reach it.
    disk = server.base / "small"
    mounted = False
    try:
        server.start()
        disk.mkdir()
        _mount(disk, "8m", owner=server.os_user)
        mounted = True
        (disk / "ts").mkdir()
        if server.os_user is not None:
            entry = pwd.getpwnam(server.os_user)
            os.chown(disk / "ts", entry.pw_uid, entry.pw_gid)

        async def setup() -> str:
            conn = await asyncpg.connect(server.url("postgres"))
            try:
                await conn.execute(f"CREATE TABLESPACE small LOCATION '{disk / 'ts'}'")
                await conn.execute("CREATE DATABASE fulldb")
            finally:
                await conn.close()
            url = server.url("fulldb")
            ledger = PostgresLedger(url)
            try:
                await ledger.migrate()
            finally:
                await ledger.close()
            await OutboxSink(url).migrate()
            conn = await asyncpg.connect(url)
            try:
                for table in ("flowdecision_claims", "flow_decision_outbox"):
                    await conn.execute(f"ALTER TABLE {table} SET TABLESPACE small")
                await conn.execute("ALTER DATABASE fulldb SET default_tablespace = small")
            finally:
                await conn.close()
            return url

        yield server, asyncio.run(setup())
    finally:
        if mounted:
            with contextlib.suppress(Exception):
                server.halt()
            subprocess.run(["umount", "-l", str(disk)], check=False)
        server.stop()


async def test_postgres_disk_full_sqlstate_53100_is_store_full(
    pg_small_tablespace: tuple[PostgresServer, str],
) -> None:
    _server, url = pg_small_tablespace
    conn = await asyncpg.connect(url)
    try:
        # Fill the tablespace with another table until the server says the disk is full.
        await conn.execute("CREATE TABLE filler (pad text) TABLESPACE small")
        await conn.execute("ALTER TABLE filler ALTER COLUMN pad SET STORAGE PLAIN")
        with pytest.raises(asyncpg.DiskFullError):
            for _ in range(10_000):
                await conn.execute("INSERT INTO filler SELECT repeat('x', 7000)")
    finally:
        await conn.close()
    ledger = await PostgresLedger.connect(url)
    outbox = await OutboxSink(url).open()
    try:
        dispatcher = Dispatcher(BRANCH, outbox, ledger, owner_id="owner-a")
        with pytest.raises(DispatchStoreFullError) as caught:
            for n in range(200):
                await dispatcher.dispatch(_big(f"p-{n}"))
        assert caught.value.code == "store_full" and "disk is full" in str(caught.value)
        assert dispatcher.ledger_outage.code == "store_full"
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("DROP TABLE filler")
        finally:
            await conn.close()
        assert (await dispatcher.dispatch(_big("p-after"))).submitted
        assert not dispatcher.ledger_outage.active
    finally:
        await outbox.close()
        await ledger.close()

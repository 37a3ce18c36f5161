"""Store identity and descriptions of PostgreSQL DSNs, multi-host ones included.

Two stores are the same only when they are the same database on the same hosts
(as the same user): an outbox in database ``b`` is never taken for a ledger's
store in database ``a`` because both DSNs list several hosts. Every message
names such a store by all its hosts, its database and its user, never its
password.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import asyncpg
import pytest

from flowdecision import Dispatcher
from flowdecision.chaos.config import ChaosConfig
from flowdecision.chaos.journal import Journal
from flowdecision.chaos.worker import ChaosSink
from flowdecision.connections.urls import describe_dsn, parse_pg_dsn
from flowdecision.core.model import Complete
from flowdecision.ledger.postgres import PostgresLedger
from flowdecision.sinks import OutboxSink
from flowdecision.store.joint import postgres_key
from tests.helpers import request

BRANCH = "production"


def test_multi_host_dsns_of_two_databases_are_two_stores() -> None:
    a = "postgresql://postgres@h:5432,h:5433/a?target_session_attrs=read-write"
    b = "postgresql://postgres@h:5432,h:5433/b?target_session_attrs=read-write"
    assert postgres_key(a) != postgres_key(b)
    assert postgres_key(a) == postgres_key(a.replace("read-write", "any"))


def test_same_database_on_other_hosts_or_as_another_user_is_another_store() -> None:
    base = "postgresql://app@db1:5432,db2:5432/flow"
    assert postgres_key(base) != postgres_key("postgresql://app@db1:5432,db3:5432/flow")
    assert postgres_key(base) != postgres_key("postgresql://app@db1:5432/flow")
    assert postgres_key(base) != postgres_key("postgresql://other@db1:5432,db2:5432/flow")
    # The hosts' order, host-name case, a password and the default port are not identity.
    assert postgres_key(base) == postgres_key("postgresql://app:secret@DB2,db1:5432/flow")
    # The query-string spellings (libpq's) name the same store.
    assert postgres_key(base) == postgres_key("postgresql:///flow?host=db1,db2&port=5432&user=app")
    assert postgres_key(base) == postgres_key("postgres://app@db1,db2/?dbname=flow")


def test_descriptions_name_every_host_the_database_and_the_user_but_no_password() -> None:
    dsn = "postgresql://app:hunter2@db1:5432,[::1]:6543/flow?target_session_attrs=read-write"
    shown = describe_dsn(dsn)
    assert shown == "app@db1:5432,[::1]:6543/flow"
    assert "hunter2" not in shown and "unparseable" not in shown
    sock = describe_dsn("postgresql://app@/flow?host=/run/pg&port=5433&password=pw")
    assert sock == "app@/run/pg:5433/flow" and "pw" not in sock.replace("/run/pg", "")
    target = parse_pg_dsn("postgresql://app@db1,db2:6000/flow")
    assert target.hosts == (("db1", 5432), ("db2", 6000))
    assert (target.database, target.user) == ("flow", "app")


def test_a_dsn_that_cannot_be_parsed_says_why_and_joins_nothing() -> None:
    bad = "postgresql://app:pw@db1:notaport/flow"
    shown = describe_dsn(bad)
    assert "notaport" in shown and "pw" not in shown.replace("notaport", "")
    assert postgres_key(bad) != postgres_key("postgresql://app@db1/flow")


# -- the real thing: one server, two databases, one multi-host DSN each ---------------


def _two_host_url(server_url: str, database: str) -> str:
    """``server_url``'s server listed twice in the netloc (``h:p,h:p``), as the
    issue's reproduction has it, for ``database``."""
    target = parse_pg_dsn(server_url)
    (host, port), user = target.hosts[0], target.user
    spec = f"{quote(host, safe='')}:{port}"
    return f"postgresql://{user}@{spec},{spec}/{database}?target_session_attrs=read-write"


@pytest.fixture
async def databases(pg_server_url: str) -> AsyncIterator[tuple[str, str]]:
    """Databases ``a`` and ``b`` on one server, each with the ledger and the outbox."""
    conn = await asyncpg.connect(pg_server_url)
    urls = []
    try:
        for name in ("flowdecision_ident_a", "flowdecision_ident_b"):
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            await conn.execute(f'CREATE DATABASE "{name}"')
            url = _two_host_url(pg_server_url, name)
            ledger = PostgresLedger(url)
            try:
                await ledger.migrate()
            finally:
                await ledger.close()
            await OutboxSink(url).migrate()
            urls.append(url)
        yield urls[0], urls[1]
    finally:
        await conn.close()


async def _outbox_rows(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        count: int = await conn.fetchval("SELECT count(*) FROM flow_decision_outbox")
        return count
    finally:
        await conn.close()


@pytest.mark.parametrize("sink_kind", ["outbox", "chaos"])
async def test_an_outbox_in_another_database_is_not_joined(
    databases: tuple[str, str], sink_kind: str, tmp_path: Path
) -> None:
    url_a, url_b = databases
    ledger = await PostgresLedger.connect(url_a)
    outbox = await OutboxSink(url_b).open()
    journal = Journal(tmp_path / "journal.jsonl", {}) if sink_kind == "chaos" else None
    try:
        sink: OutboxSink | ChaosSink = outbox
        if journal is not None:
            sink = ChaosSink(
                outbox,
                journal,
                ChaosConfig(url_a, slow_sink_rate=0.0, sink_raise_rate=0.0),
                random.Random(1),
            )
        assert "unparseable" not in ledger.where and "flowdecision_ident_a" in ledger.where
        dispatcher = Dispatcher(BRANCH, sink, ledger, owner_id="owner-a")
        assert not dispatcher.joint
        outcome = await dispatcher.dispatch(
            request(decision_id="d-1", decision=Complete(output=None))
        )
        assert outcome.submitted
        # The row is in the outbox the user configured, and nowhere else.
        assert (await _outbox_rows(url_b), await _outbox_rows(url_a)) == (1, 0)
        record = await ledger.read_record("d-1")
        assert record is not None and record.status.value == "completed"
    finally:
        if journal is not None:
            journal.close()
        await outbox.close()
        await ledger.close()


async def test_the_same_database_through_the_multi_host_dsn_is_joined(
    databases: tuple[str, str],
) -> None:
    url_a, _ = databases
    ledger = await PostgresLedger.connect(url_a)
    # Another spelling of the same hosts and database (the other order, no attrs).
    outbox = await OutboxSink(url_a.partition("?")[0]).open()
    try:
        dispatcher = Dispatcher(BRANCH, outbox, ledger, owner_id="owner-a")
        assert dispatcher.joint
        assert (await dispatcher.dispatch(request(decision_id="d-2"))).submitted
        assert await _outbox_rows(url_a) == 1
    finally:
        await outbox.close()
        await ledger.close()

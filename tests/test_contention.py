"""Cross-process contention: several OS processes, each with its own connection.

Every process claims the same decision ids at the same moment (a barrier
releases them together). Exactly one claim per id and live lease may win;
everyone else must see ``Busy`` with the winner's expiry. Then the leases
expire and all processes race again for the takeover: again exactly one
winner per id, on attempt 2.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections import Counter
from pathlib import Path
from typing import Any

from flowdecision.ledger import Busy, Claimed, Ledger

PROCESSES = 4
IDS = [f"contended-{index}" for index in range(40)]


async def _open(kind: str, target: str) -> Ledger:
    if kind == "sqlite":
        from flowdecision.ledger.sqlite import SqliteLedger

        return await SqliteLedger.open(target)
    from flowdecision.ledger.postgres import PostgresLedger

    return await PostgresLedger.connect(target, max_size=4)


async def _worker_main(
    kind: str, target: str, owner: str, phases: list[tuple[str, int | None, int]], barrier: Any
) -> list[list[tuple[str, str, int]]]:
    ledger = await _open(kind, target)
    results: list[list[tuple[str, str, int]]] = []
    try:
        for prefix, now_ms, lease_ms in phases:
            await asyncio.to_thread(barrier.wait, 60)
            outcomes = await asyncio.gather(
                *(
                    ledger.claim(
                        f"{prefix}{decision_id}", "h", owner, lease_ms=lease_ms, now_ms=now_ms
                    )
                    for decision_id in IDS
                )
            )
            phase: list[tuple[str, str, int]] = []
            for decision_id, outcome in zip(IDS, outcomes, strict=True):
                if isinstance(outcome, Claimed):
                    phase.append((decision_id, "claimed", outcome.attempt))
                elif isinstance(outcome, Busy):
                    phase.append((decision_id, "busy", outcome.lease_expires_at_ms))
                else:
                    phase.append((decision_id, type(outcome).__name__, 0))
            results.append(phase)
    finally:
        await ledger.close()
    return results


def _worker(
    kind: str,
    target: str,
    owner: str,
    phases: list[tuple[str, int | None, int]],
    barrier: Any,
    queue: Any,
) -> None:
    try:
        queue.put((owner, asyncio.run(_worker_main(kind, target, owner, phases, barrier))))
    except BaseException as error:  # report, never hang the parent
        queue.put((owner, f"{type(error).__name__}: {error}"))
        barrier.abort()


def _race(kind: str, target: str, phases: list[tuple[str, int | None, int]]) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(kind, target, f"proc-{index}", phases, barrier, queue))
        for index in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    try:
        results = [queue.get(timeout=240) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    failures = [result for _, result in results if isinstance(result, str)]
    assert not failures, failures
    return results


def _check(results: list[Any], phase_index: int, attempt: int) -> None:
    by_id: dict[str, Counter[str]] = {decision_id: Counter() for decision_id in IDS}
    expiries: dict[str, set[int]] = {decision_id: set() for decision_id in IDS}
    for _owner, phases in results:
        for decision_id, what, value in phases[phase_index]:
            by_id[decision_id][what] += 1
            if what == "claimed":
                assert value == attempt, (decision_id, value)
            else:
                expiries[decision_id].add(value)
    for decision_id, counts in by_id.items():
        assert counts == Counter({"claimed": 1, "busy": PROCESSES - 1}), (decision_id, counts)
        assert len(expiries[decision_id]) == 1, (decision_id, expiries[decision_id])


def _phases(use_db_clock: bool) -> list[tuple[str, int | None, int]]:
    phases: list[tuple[str, int | None, int]] = [
        ("", 1_000, 500),  # first claims: one winner per id
        ("", 2_000, 500),  # all leases expired: one takeover per id, attempt 2
    ]
    if use_db_clock:
        phases.append(("clock-", None, 60_000))  # the store's own clock
    return phases


def test_sqlite_processes_claim_each_id_once(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    results = _race("sqlite", str(path), _phases(use_db_clock=True))
    _check(results, 0, 1)
    _check(results, 1, 2)
    _check(results, 2, 1)


def test_postgres_processes_claim_each_id_once(pg_url: str) -> None:
    import asyncpg

    async def truncate() -> None:
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute("TRUNCATE flowdecision_claims")
        finally:
            await conn.close()

    asyncio.run(truncate())
    results = _race("postgres", pg_url, _phases(use_db_clock=True))
    _check(results, 0, 1)
    _check(results, 1, 2)
    _check(results, 2, 1)

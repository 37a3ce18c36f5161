"""Bytes per full record and per tombstone, measured in a SQLite ledger and a JSON file.

N decisions are submitted through the dispatcher (identity and receipt, as the
service stores them), the store is measured, then pruned with
``keep_tombstones`` and measured again (SQLite after VACUUM). Run:
``.venv/bin/python bench/tombstone_bytes.py [N]``; results go to docs/OPERATIONS.md.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import tempfile
from pathlib import Path

from flowdecision import Dispatcher
from flowdecision.core.model import Complete, DecisionRequest
from flowdecision.ledger import JsonFileLedger, Ledger, SqliteLedger


class NullSink:
    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        return None


def _request(i: int) -> DecisionRequest:
    return DecisionRequest(
        decision_id=f"run-{i // 10:06d}-decision-{i:08d}",
        run_id=f"run-{i // 10:06d}",
        authority_branch_id="production",
        causation_event_id=f"event-{i:08d}",
        decision=Complete(output={"ok": True}),
    )


def _sqlite_bytes(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("VACUUM")
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
        return int(pages) * int(size)
    finally:
        conn.close()


async def _fill(ledger: Ledger, n: int) -> None:
    dispatcher = Dispatcher("production", NullSink(), ledger)
    await asyncio.gather(*(dispatcher.dispatch(_request(i)) for i in range(n)))


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        path = Path(root) / "ledger.db"
        await (await SqliteLedger.open(path)).close()
        empty = _sqlite_bytes(path)
        ledger = await SqliteLedger.open(path)
        await _fill(ledger, n)
        await ledger.close()
        full = _sqlite_bytes(path)
        ledger = await SqliteLedger.open(path)
        await ledger.prune_completed(ledger.now_ms() + 1, keep_tombstones=True)
        await ledger.close()
        buried = _sqlite_bytes(path)
        print(
            f"sqlite: {(full - empty) / n:.0f} bytes per full record (with indexes), "
            f"{(buried - empty) / n:.0f} bytes per tombstone (n={n})"
        )
        directory = Path(root) / "file"
        json_ledger = JsonFileLedger(directory)
        small = min(n, 200)  # the JSON file rewrites itself per mutation
        await _fill(json_ledger, small)
        data = (directory / "flow-decisions.json").stat().st_size
        await json_ledger.prune_completed(json_ledger.now_ms() + 1, keep_tombstones=True)
        side = (directory / "flow-decisions.ops.json").stat().st_size
        print(
            f"json file: {data / small:.0f} bytes per full record in flow-decisions.json; "
            f"{side / small:.0f} bytes per decision beside it once pruned to tombstones "
            f"(tombstone + first-claim time and run; n={small})"
        )


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000))

"""Two replicas on one default store, one decision sent to both at once (docs/SERVICE.md,
"Deployment", step 4): exactly one submits; on the default layouts the other waits
for it and answers 200 ``duplicate``, never 409 ``busy``.

The claim, the outbox row and the completion are one transaction there, so no
other replica ever sees the decision pending. ``bench/replica_race.py`` runs the
same race 100 times per layout, including one where the outbox is elsewhere
(then the loser mostly gets 409 ``busy``).
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.service_process import ServiceProcess, decision

PAIRS = 20


def _send(
    client: httpx.Client, body: bytes, barrier: threading.Barrier, statuses: list[int]
) -> None:
    barrier.wait()  # both threads send at the same moment
    answer = client.post(
        "/v1/decisions", content=body, headers={"Content-Type": "application/json"}
    )
    statuses.append(answer.status_code)


def race(urls: list[str], pairs: int) -> Counter[tuple[int, ...]]:
    """Send ``pairs`` new decisions to both replicas at once; count sorted status pairs."""
    clients = [httpx.Client(base_url=url, timeout=30) for url in urls]
    counts: Counter[tuple[int, ...]] = Counter()
    try:
        for client in clients:
            client.get("/healthz")  # open the keep-alive connections first
        for _ in range(pairs):
            body = decision(f"race-{uuid.uuid4().hex[:12]}").to_json()
            barrier = threading.Barrier(len(clients))
            statuses: list[int] = []
            threads = [
                threading.Thread(target=_send, args=(c, body, barrier, statuses)) for c in clients
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            counts[tuple(sorted(statuses))] += 1
    finally:
        for client in clients:
            client.close()
    return counts


@pytest.mark.parametrize("layout", ["sqlite", "postgres"])
def test_two_replicas_racing_one_decision_on_the_default_layout(
    layout: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if layout == "sqlite":
        ledger = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    else:
        ledger = request.getfixturevalue("pg_url")  # migrated: ledger and outbox
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with (
        ServiceProcess(tmp_path / "a", "--ledger", ledger) as one,
        ServiceProcess(tmp_path / "b", "--ledger", ledger) as two,
    ):
        counts = race([one.url, two.url], PAIRS)
    assert counts == Counter({(200, 201): PAIRS})


def test_service_md_says_what_the_race_does() -> None:
    from tests.service_process import ROOT

    text = " ".join((ROOT / "docs" / "SERVICE.md").read_text().split())
    step = text.split("4. No sticky sessions are needed.")[1].split(" 5. ")[0]
    assert "answers 200 `duplicate` itself" in step
    assert "409 `busy`" in step.split("When the sink is not in the ledger's database")[1]

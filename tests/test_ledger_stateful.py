"""Every backend against the pure reference model, over random operation sequences.

The reference model is a dict of records driven by the pure functions of
:mod:`flowdecision.ledger.machine` (plus the argument checks the API makes).
Each step runs one operation on the backend (alternating between two ledger
instances on the same store) and on the model, and requires the same result or
the same error message, and then the same stored records.

Several ids, owners and hashes; identities that match, mismatch or are absent;
receipts bound to the identity, bound to another one, or conflicting with the
stored one; and time that moves forward, stands still or goes backward.
The terminal summary reports how many examples ran per backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from flowdecision.core.identity import ExecutionIdentity, ResultOutcome, ResultReceipt, digest_bytes
from flowdecision.errors import LedgerError
from flowdecision.ledger import ClaimKey, Ledger, machine
from flowdecision.ledger.machine import ClaimRecord, Transition

from .helpers import identity
from .ledger_stores import STATEFUL_EXAMPLES, STATEFUL_STEPS, LedgerStore, make_root, remove_root

T = TypeVar("T")

IDS = ("d1", "d2", "d3")
OWNERS = ("alice", "bob", "carol")
HASHES = ("h1", "h2")
IDENTITIES: tuple[ExecutionIdentity | None, ...] = (None, identity("one"), identity("two"))
LEASES = (0, 1, 10, 50)
TICKS = (-40, -1, 0, 0, 1, 5, 20, 60)


def _receipt(ident: ExecutionIdentity, variant: int) -> ResultReceipt:
    return ResultReceipt.new(
        ident,
        digest_bytes("a3s.test.flow-evidence", b"event"),
        ResultOutcome.SUCCEEDED,
        digest_bytes("a3s.test.flow-result", f"result-{variant}".encode()),
        6 + variant,
    )


# receipt choice: None, bound to the call's identity (two variants that conflict
# with each other), or bound to some other identity.
RECEIPTS = ("none", "same-0", "same-1", "other")

EXAMPLES = {"memory": 300, "file": 150, "sqlite": 300, "postgres": 300}
STEPS = 25


class Reference:
    """The pure model: a dict of records, the machine functions, the API's checks."""

    def __init__(self) -> None:
        self.records: dict[str, ClaimRecord] = {}

    def apply(self, decision_id: str, op: Callable[[ClaimRecord | None], Transition[T]]) -> T:
        transition = op(self.records.get(decision_id))
        if transition.changed and transition.record is not None:
            self.records[decision_id] = transition.record
        return transition.result


def _outcome(call: Callable[[], T]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except LedgerError as error:
        return "error", str(error)


async def _aoutcome(call: Awaitable[T]) -> tuple[str, Any]:
    try:
        return "ok", await call
    except LedgerError as error:
        return "error", str(error)


def build_machine(
    kind: str, store: LedgerStore, loop: asyncio.AbstractEventLoop, ledgers: list[Ledger]
) -> type[RuleBasedStateMachine]:
    def run(coro: Awaitable[T]) -> T:
        return loop.run_until_complete(coro)  # type: ignore[arg-type]

    class LedgerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            run(store.reset())
            if not ledgers:
                ledgers.append(run(store()))
                ledgers.append(run(store()))
            self.model = Reference()
            self.now = 1_000
            STATEFUL_EXAMPLES[kind] = STATEFUL_EXAMPLES.get(kind, 0) + 1

        def _ledger(self, which: int) -> Ledger:
            return ledgers[which]

        def _check(self, got: tuple[str, Any], want: tuple[str, Any]) -> None:
            STATEFUL_STEPS[kind] = STATEFUL_STEPS.get(kind, 0) + 1
            assert got == want

        @rule(delta=st.sampled_from(TICKS))
        def tick(self, delta: int) -> None:
            self.now = max(0, self.now + delta)

        @rule(
            which=st.integers(0, 1),
            decision_id=st.sampled_from(IDS),
            request_hash=st.sampled_from(HASHES),
            owner=st.sampled_from(OWNERS),
            ident=st.sampled_from(IDENTITIES),
            lease=st.sampled_from(LEASES),
        )
        def claim(
            self,
            which: int,
            decision_id: str,
            request_hash: str,
            owner: str,
            ident: ExecutionIdentity | None,
            lease: int,
        ) -> None:
            now = self.now
            key = ClaimKey(decision_id, request_hash, ident)
            want = _outcome(
                lambda: self.model.apply(
                    decision_id,
                    lambda r: machine.claim(r, key, owner, now, lease),
                )
            )
            got = run(
                _aoutcome(
                    self._ledger(which).claim(
                        decision_id, request_hash, owner, lease_ms=lease, now_ms=now, identity=ident
                    )
                )
            )
            self._check(got, want)

        @rule(
            which=st.integers(0, 1),
            decision_id=st.sampled_from(IDS),
            request_hash=st.sampled_from(HASHES),
            owner=st.sampled_from(OWNERS),
            ident=st.sampled_from(IDENTITIES),
            lease=st.sampled_from(LEASES),
        )
        def renew(
            self,
            which: int,
            decision_id: str,
            request_hash: str,
            owner: str,
            ident: ExecutionIdentity | None,
            lease: int,
        ) -> None:
            now = self.now
            key = ClaimKey(decision_id, request_hash, ident)
            want = _outcome(
                lambda: self.model.apply(
                    decision_id,
                    lambda r: machine.renew(r, key, owner, now, lease),
                )
            )
            got = run(
                _aoutcome(
                    self._ledger(which).renew(
                        decision_id, request_hash, owner, lease_ms=lease, now_ms=now, identity=ident
                    )
                )
            )
            self._check(got, want)

        @rule(
            which=st.integers(0, 1),
            decision_id=st.sampled_from(IDS),
            request_hash=st.sampled_from(HASHES),
            owner=st.sampled_from(OWNERS),
            ident=st.sampled_from(IDENTITIES),
            receipt_kind=st.sampled_from(RECEIPTS),
        )
        def complete(
            self,
            which: int,
            decision_id: str,
            request_hash: str,
            owner: str,
            ident: ExecutionIdentity | None,
            receipt_kind: str,
        ) -> None:
            now = self.now
            receipt: ResultReceipt | None = None
            if receipt_kind.startswith("same"):
                receipt = _receipt(ident or identity("unbound"), int(receipt_kind[-1]))
            elif receipt_kind == "other":
                receipt = _receipt(identity("elsewhere"), 0)

            def model_call() -> bool:
                # The API's argument checks (base.py), then the pure transition.
                if receipt is not None:
                    if ident is None:
                        raise LedgerError("decision result receipt requires an execution identity")
                    if receipt.identity != ident:
                        raise LedgerError(
                            "decision result receipt identity conflicts with its claim"
                        )
                return self.model.apply(
                    decision_id,
                    lambda r: machine.complete(
                        r, ClaimKey(decision_id, request_hash, ident), owner, receipt, now
                    ),
                )

            want = _outcome(model_call)
            got = run(
                _aoutcome(
                    self._ledger(which).complete(
                        decision_id,
                        request_hash,
                        owner,
                        completed_at_ms=now,
                        identity=ident,
                        receipt=receipt,
                    )
                )
            )
            self._check(got, want)

        @rule(
            which=st.integers(0, 1),
            decision_id=st.sampled_from(IDS),
            request_hash=st.sampled_from(HASHES),
            owner=st.sampled_from(("", *OWNERS)),
            ident=st.sampled_from(IDENTITIES),
        )
        def release(
            self,
            which: int,
            decision_id: str,
            request_hash: str,
            owner: str,
            ident: ExecutionIdentity | None,
        ) -> None:
            want = _outcome(
                lambda: self.model.apply(
                    decision_id,
                    lambda r: machine.release(r, ClaimKey(decision_id, request_hash, ident), owner),
                )
            )
            got = run(
                _aoutcome(
                    self._ledger(which).release(decision_id, request_hash, owner, identity=ident)
                )
            )
            self._check(got, want)

        @rule(
            which=st.integers(0, 1),
            decision_id=st.sampled_from(IDS),
            request_hash=st.sampled_from(HASHES),
            ident=st.sampled_from(IDENTITIES),
        )
        def inspect(
            self,
            which: int,
            decision_id: str,
            request_hash: str,
            ident: ExecutionIdentity | None,
        ) -> None:
            want = _outcome(
                lambda: machine.inspect(
                    self.model.records.get(decision_id), ClaimKey(decision_id, request_hash, ident)
                )
            )
            got = run(
                _aoutcome(self._ledger(which).inspect(decision_id, request_hash, identity=ident))
            )
            self._check(got, want)

        @rule(which=st.integers(0, 1), back=st.sampled_from((-30, 0, 1, 30)))
        def prune(self, which: int, back: int) -> None:
            before = max(0, self.now + back)
            doomed = [
                key
                for key, record in self.model.records.items()
                if machine.is_prunable(record, before)
            ]
            for key in doomed:
                del self.model.records[key]
            got = run(_aoutcome(self._ledger(which).prune_completed(before)))
            self._check(got, ("ok", len(doomed)))

        @invariant()
        def same_records(self) -> None:
            ledger = self._ledger(0)
            for decision_id in IDS:
                stored = run(ledger.read_record(decision_id))
                assert stored == self.model.records.get(decision_id), decision_id

    return LedgerMachine


@pytest.mark.parametrize("kind", ["memory", "file", "sqlite", "postgres"])
def test_backend_matches_reference_model(kind: str, request: pytest.FixtureRequest) -> None:
    pg = request.getfixturevalue("pg_url") if kind == "postgres" else None
    root = make_root(f"flowdecision-stateful-{kind}-")
    # SQLite at synchronous=NORMAL: same transactions, no fsync per step.
    options: dict[str, Any] = {"synchronous": "NORMAL"} if kind == "sqlite" else {}
    store = LedgerStore(kind, Path(root), pg_url=pg, **options)
    loop = asyncio.new_event_loop()
    ledgers: list[Ledger] = []
    STATEFUL_EXAMPLES[kind] = 0
    try:
        machine_class = build_machine(kind, store, loop, ledgers)
        run_state_machine_as_test(
            machine_class,
            settings=settings(
                max_examples=EXAMPLES[kind],
                stateful_step_count=STEPS,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=False,
                database=None,
            ),
        )
    finally:
        loop.run_until_complete(store.aclose())
        loop.close()
        remove_root(Path(root))
    print(f"\n[stateful] {kind}: {STATEFUL_EXAMPLES[kind]} examples, {STATEFUL_STEPS[kind]} steps")
    assert STATEFUL_EXAMPLES[kind] >= EXAMPLES[kind]

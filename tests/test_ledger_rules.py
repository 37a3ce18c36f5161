"""The claim state machine's rules and messages (on the memory ledger).

Every backend runs the same rules (see test_conformance); these pin the edge
cases and the exact error messages of the seed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from flowdecision.errors import LedgerError
from flowdecision.ledger import (
    AlreadyCompleted,
    Busy,
    Claimed,
    ClaimKey,
    Completed,
    Conflict,
    MemoryLedger,
    Missing,
    Pending,
    Unavailable,
    machine,
)
from flowdecision.ledger.machine import U32_MAX, U64_MAX, ClaimRecord, ClaimStatus

from .helpers import identity, receipt


async def test_lease_expiry_is_now_plus_at_least_one_and_saturates() -> None:
    ledger = MemoryLedger()
    assert await ledger.claim("zero", "h", "o", lease_ms=0, now_ms=10) == Claimed(1)
    assert await ledger.inspect("zero", "h") == Pending(11, 1)
    await ledger.claim("max", "h", "o", lease_ms=U64_MAX, now_ms=U64_MAX - 5)
    assert await ledger.inspect("max", "h") == Pending(U64_MAX, 1)


def test_attempts_saturate_at_u32_max() -> None:
    record = ClaimRecord("h", ClaimStatus.PENDING, "", 0, U32_MAX)
    transition = machine.claim(record, ClaimKey("a", "h"), "o", 10, 5)
    assert transition.result == Claimed(U32_MAX)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lease_ms": -1}, "`lease_ms` must be an integer in 0..=18446744073709551615, got -1"),
        ({"lease_ms": 5, "now_ms": 1 << 64}, "`now_ms` must be an integer in 0..="),
        ({"lease_ms": True}, "`lease_ms` must be an integer"),
        ({"lease_ms": 1.5}, "`lease_ms` must be an integer"),
    ],
)
async def test_out_of_range_numbers_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(LedgerError, match=message.replace("(", r"\(").replace("*", r"\*")):
        await MemoryLedger().claim("a", "h", "o", **kwargs)  # type: ignore[arg-type]


async def test_negative_prune_cutoff_and_completion_time_are_rejected() -> None:
    ledger = MemoryLedger()
    with pytest.raises(LedgerError, match="`before_ms`"):
        await ledger.prune_completed(-5)
    with pytest.raises(LedgerError, match="`completed_at_ms`"):
        await ledger.complete("a", "h", "o", completed_at_ms=-1)


async def test_same_owner_reclaim_gets_next_attempt_other_owner_is_busy() -> None:
    ledger = MemoryLedger()
    assert await ledger.claim("a", "h", "o", lease_ms=50, now_ms=100) == Claimed(1)
    assert await ledger.claim("a", "h", "o", lease_ms=50, now_ms=110) == Claimed(2)
    assert await ledger.claim("a", "h", "x", lease_ms=50, now_ms=120) == Busy(160)
    assert await ledger.claim("a", "other-hash", "o", lease_ms=50, now_ms=120) == Conflict()


async def test_renew_fails_once_expired_even_for_the_owner() -> None:
    ledger = MemoryLedger()
    await ledger.claim("a", "h", "o", lease_ms=50, now_ms=100)
    assert not await ledger.renew("a", "h", "o", lease_ms=50, now_ms=150)
    assert not await ledger.renew("missing", "h", "o", lease_ms=50, now_ms=100)


async def test_release_clears_owner_and_next_claim_is_a_new_attempt() -> None:
    ledger = MemoryLedger()
    await ledger.claim("a", "h", "o", lease_ms=1000, now_ms=100)
    await ledger.release("a", "h", "not-owner")
    assert await ledger.claim("a", "h", "x", lease_ms=10, now_ms=101) == Busy(1100)
    await ledger.release("a", "h", "o")
    assert await ledger.inspect("a", "h") == Pending(0, 1)
    assert await ledger.claim("a", "h", "x", lease_ms=10, now_ms=101) == Claimed(2)


@pytest.mark.parametrize(
    ("setup", "call", "message"),
    [
        ([], ("a", "h", "o", 10), "decision claim `a` does not exist"),
        (
            [("a", "h", "o")],
            ("a", "h2", "o", 10),
            "decision `a` request hash conflicts with its claim",
        ),
        ([("a", "h", "o")], ("a", "h", "x", 10), "decision `a` is owned by another dispatcher"),
        (
            [("a", "h", "o")],
            ("a", "h", "o", 150),
            "decision `a` claim lease expired before completion",
        ),
    ],
)
async def test_completion_messages(
    setup: list[tuple[str, str, str]], call: tuple[str, str, str, int], message: str
) -> None:
    ledger = MemoryLedger()
    for decision_id, hash_, owner in setup:
        await ledger.claim(decision_id, hash_, owner, lease_ms=50, now_ms=100)
    decision_id, hash_, owner, at = call
    with pytest.raises(LedgerError) as failure:
        await ledger.complete(decision_id, hash_, owner, completed_at_ms=at)
    assert str(failure.value) == message


async def test_released_claim_cannot_be_completed() -> None:
    ledger = MemoryLedger()
    await ledger.claim("a", "h", "o", lease_ms=50, now_ms=100)
    await ledger.release("a", "h", "o")
    with pytest.raises(LedgerError, match="is owned by another dispatcher"):
        await ledger.complete("a", "h", "o", completed_at_ms=110)


async def test_completed_record_accepts_any_caller_and_attaches_receipt_once() -> None:
    ledger = MemoryLedger()
    ident = identity("attach")
    await ledger.claim("a", "h", "o", lease_ms=50, now_ms=100)
    await ledger.complete("a", "h", "o", completed_at_ms=110)
    assert await ledger.completed_receipt("a") is None
    await ledger.complete("a", "h", "someone-else", identity=ident, receipt=receipt(ident))
    assert await ledger.completed_receipt("a") == receipt(ident)
    entry = await ledger.lookup("a")
    assert entry is not None and entry.execution_identity == ident
    other = replace(receipt(ident), result_bytes=7)
    with pytest.raises(LedgerError) as failure:
        await ledger.complete("a", "h", "o", identity=ident, receipt=other)
    assert str(failure.value) == "decision `a` result receipt conflicts with its completion"
    assert await ledger.inspect("a", "h") == Completed(110)


async def test_receipt_needs_an_identity_and_must_be_bound_to_it() -> None:
    ledger = MemoryLedger()
    ident, other = identity("one"), identity("two")
    await ledger.claim("a", "h", "o", lease_ms=50, now_ms=100, identity=ident)
    with pytest.raises(LedgerError, match="requires an execution identity"):
        await ledger.complete("a", "h", "o", completed_at_ms=110, receipt=receipt(ident))
    with pytest.raises(LedgerError) as failure:
        await ledger.complete(
            "a", "h", "o", completed_at_ms=110, identity=ident, receipt=receipt(other)
        )
    assert str(failure.value) == "decision result receipt identity conflicts with its claim"
    with pytest.raises(LedgerError) as failure:
        await ledger.complete("a", "h", "o", completed_at_ms=110, identity=other)
    assert str(failure.value) == "decision `a` execution identity conflicts with its claim"


async def test_invalid_identity_is_rejected_with_its_message() -> None:
    bad = replace(identity("x"), digest="sha256:nothex")
    with pytest.raises(LedgerError) as failure:
        await MemoryLedger().claim("a", "h", "o", lease_ms=5, identity=bad)
    assert str(failure.value) == "execution identity digest is invalid"


async def test_renew_and_release_never_bind_an_identity() -> None:
    ledger = MemoryLedger()
    ident = identity("late")
    await ledger.claim("a", "h", "o", lease_ms=50, now_ms=100)
    assert await ledger.renew("a", "h", "o", lease_ms=50, now_ms=110, identity=ident)
    await ledger.inspect("a", "h", identity=ident)
    entry = await ledger.lookup("a")
    assert entry is not None and entry.execution_identity is None
    await ledger.release("a", "h", "o", identity=ident)
    entry = await ledger.lookup("a")
    assert entry is not None and entry.execution_identity is None
    assert await ledger.claim("a", "h", "o", lease_ms=50, now_ms=111, identity=ident) == Claimed(2)
    entry = await ledger.lookup("a")
    assert entry is not None and entry.execution_identity == ident


async def test_claim_on_completed_legacy_record_binds_identity() -> None:
    ledger = MemoryLedger()
    ident = identity("bind")
    await ledger.claim("a", "h", "o", lease_ms=50, now_ms=100)
    await ledger.complete("a", "h", "o", completed_at_ms=110)
    assert await ledger.claim("a", "h", "x", lease_ms=5, identity=ident) == AlreadyCompleted()
    assert await ledger.claim("a", "h", "x", lease_ms=5, identity=identity("no")) == Conflict()


async def test_inspect_reports_mismatch_and_never_the_owner() -> None:
    ledger = MemoryLedger()
    assert await ledger.inspect("a", "h") == Missing()
    await ledger.claim("a", "h", "secret-owner", lease_ms=50, now_ms=100, identity=identity("i"))
    with pytest.raises(LedgerError, match="request hash conflicts"):
        await ledger.inspect("a", "other")
    with pytest.raises(LedgerError, match="execution identity conflicts"):
        await ledger.inspect("a", "h", identity=identity("j"))
    state = await ledger.inspect("a", "h")
    assert state.is_live_at(149) and not state.is_live_at(150)
    assert "secret-owner" not in repr(state) and "secret-owner" not in str(state.to_dict())
    assert not Missing().is_live_at(0) and not Completed(1).is_live_at(0)
    assert not Unavailable().is_live_at(0)


async def test_prune_removes_only_completions_before_the_cutoff() -> None:
    ledger = MemoryLedger()
    for name, at in (("old", 100), ("edge", 200), ("new", 300)):
        await ledger.claim(name, "h", "o", lease_ms=1000, now_ms=50)
        await ledger.complete(name, "h", "o", completed_at_ms=at)
    await ledger.claim("pending", "h", "o", lease_ms=1, now_ms=1)
    assert await ledger.prune_completed(200) == 1
    assert await ledger.inspect("old", "h") == Missing()
    assert await ledger.inspect("edge", "h") == Completed(200)
    assert await ledger.inspect("pending", "h") == Pending(2, 1)
    assert await ledger.claim("old", "h", "o", lease_ms=5, now_ms=400) == Claimed(1)


async def test_prune_reports_progress_after_each_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flowdecision.ledger import sqlite as sqlite_module

    monkeypatch.setattr(sqlite_module, "_PRUNE_BATCH", 2)
    ledger = await sqlite_module.SqliteLedger.open(tmp_path / "p.db")
    try:
        for n in range(5):
            await ledger.claim(f"d{n}", "h", "o", lease_ms=1000, now_ms=10)
            await ledger.complete(f"d{n}", "h", "o", completed_at_ms=20)
        seen: list[int] = []
        assert await ledger.prune_completed(21, progress=seen.append) == 5
        assert seen == [2, 4, 5]
    finally:
        await ledger.close()
    memory_seen: list[int] = []
    assert await MemoryLedger().prune_completed(5, progress=memory_seen.append) == 0
    assert memory_seen == [0]


@pytest.mark.parametrize("field", ["decision_id", "request_hash", "owner_id"])
async def test_text_that_no_store_can_hold_is_rejected_up_front(field: str) -> None:
    args = {"decision_id": "d", "request_hash": "h", "owner_id": "o"}
    args[field] = "bad\ud800"
    with pytest.raises(LedgerError, match=f"`{field}` is not valid Unicode text"):
        await MemoryLedger().claim(
            args["decision_id"], args["request_hash"], args["owner_id"], lease_ms=5
        )


def test_a_records_json_text_is_what_the_encoder_writes_for_to_dict() -> None:
    """Rows store ``ClaimRecord.json_text`` (written directly): byte for byte the
    encoder's text for ``to_dict``, for every shape a record takes."""
    from flowdecision.core.identity import ResultOutcome, ResultReceipt
    from flowdecision.core.jsonwire import encode_json_text
    from flowdecision.ledger.machine import tombstone_of

    ident = identity("json-text")
    done = receipt(ident)
    failed = ResultReceipt.new(ident, done.evidence_digest, ResultOutcome.FAILED, None, 0)
    pending = ClaimRecord("h" * 64, ClaimStatus.PENDING, 'own\u00e9r-"\\-\u2028', 5, 1, ident)
    completed = replace(
        pending, status=ClaimStatus.COMPLETED, completed_at_ms=U64_MAX, result_receipt=done
    )
    records = [
        pending,
        completed,
        replace(completed, result_receipt=failed, attempts=U32_MAX),
        replace(pending, execution_identity=None),  # legacy
        replace(completed, execution_identity=None, result_receipt=None, completed_at_ms=None),
        tombstone_of(completed),
        replace(completed, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"),  # not stored
    ]
    for record in records:
        assert record.json_text() == encode_json_text(record.to_dict())
    for shown in (done, failed, ident):
        assert shown.json_text() == encode_json_text(shown.to_dict())

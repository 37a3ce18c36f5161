-- flowdecision SQLite ledger, schema version 1.
--
-- One row per decision. `record` is the claim record exactly as the seed's
-- serde form (ClaimRecord.to_dict, compact JSON): the same bytes the JSON file
-- ledger keeps per entry, so records round-trip exactly (u64 times included).
-- `status` and `completed_at_ms` are derived from it for operators and pruning;
-- `completed_at_ms` is set only for completed records that carry a completion
-- time (the ones prune may delete) and is clamped to 2^63-1 (SQLite integers
-- are signed 64-bit); the ledger re-checks clamped rows against `record`.
CREATE TABLE flowdecision_claims (
    decision_id     TEXT    NOT NULL PRIMARY KEY,
    status          TEXT    NOT NULL CHECK (status IN ('pending', 'completed')),
    completed_at_ms INTEGER,
    record          TEXT    NOT NULL
) WITHOUT ROWID;

CREATE INDEX flowdecision_claims_prune
    ON flowdecision_claims (completed_at_ms)
    WHERE completed_at_ms IS NOT NULL;

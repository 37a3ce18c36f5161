-- flowdecision SQLite ledger, schema version 1.
--
-- One row per decision. `record` is the claim record exactly as the seed's
-- serde form (ClaimRecord.to_dict, compact JSON): the same bytes the JSON file
-- ledger keeps per entry, so records round-trip exactly (u64 times included).
-- `status` and `completed_at_ms` are derived from it for operators and pruning;
-- `completed_at_ms` is set only for completed records that carry a completion
-- time (the ones prune may delete) and is clamped to 2^63-1 (SQLite integers
-- are signed 64-bit); the ledger re-checks clamped rows against `record`.
--
-- A rowid table with a unique index on `decision_id` (not a WITHOUT ROWID
-- table keyed by it): new rows append at the end of the table B-tree whatever
-- the decision id looks like, and a lookup or insert by id touches only the
-- small index B-tree (~50 bytes per entry) rather than a B-tree whose leaves
-- hold the whole ~1 KB records. That keeps per-operation cost flat into the
-- millions of retained records.
CREATE TABLE flowdecision_claims (
    decision_id     TEXT    NOT NULL UNIQUE,
    status          TEXT    NOT NULL CHECK (status IN ('pending', 'completed')),
    completed_at_ms INTEGER,
    record          TEXT    NOT NULL
);

CREATE INDEX flowdecision_claims_prune
    ON flowdecision_claims (completed_at_ms)
    WHERE completed_at_ms IS NOT NULL;

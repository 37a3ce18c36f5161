-- flowdecision SQLite ledger, schema version 8: approval holds.
--
-- Two statuses join the claims table: `held` (a decision the approval policy
-- holds: recorded with its request, nothing sent to the sink, until an operator
-- approves or rejects it) and `rejected` (terminal; `completed_at_ms` is when it
-- was rejected). SQLite cannot change a CHECK constraint in place, so the table
-- is rebuilt as schema 3 did, keeping every rowid, and its indexes made again.
-- Held records keep their request in `record` (its JSON: the seed's fields plus
-- `request`, `hold_expires_at_ms`, `reject_closes_run`); records from before
-- this migration are unchanged.
CREATE TABLE flowdecision_claims_v8 (
    decision_id        TEXT    NOT NULL UNIQUE,
    status             TEXT    NOT NULL
        CHECK (status IN ('pending', 'completed', 'tombstone', 'held', 'rejected')),
    completed_at_ms    INTEGER,
    record             TEXT    NOT NULL,
    traceparent        TEXT,
    created_at_ms      INTEGER NOT NULL DEFAULT 0,
    run_id             TEXT,
    causation_event_id TEXT
);

INSERT INTO flowdecision_claims_v8
    (rowid, decision_id, status, completed_at_ms, record, traceparent, created_at_ms, run_id,
     causation_event_id)
    SELECT rowid, decision_id, status, completed_at_ms, record, traceparent, created_at_ms,
        run_id, causation_event_id
    FROM flowdecision_claims;

DROP TABLE flowdecision_claims;

ALTER TABLE flowdecision_claims_v8 RENAME TO flowdecision_claims;

CREATE INDEX flowdecision_claims_prune
    ON flowdecision_claims (status, completed_at_ms, decision_id)
    WHERE completed_at_ms IS NOT NULL;

CREATE INDEX flowdecision_claims_completed
    ON flowdecision_claims (completed_at_ms, decision_id)
    WHERE completed_at_ms IS NOT NULL;

CREATE INDEX flowdecision_claims_created ON flowdecision_claims (created_at_ms, decision_id);

CREATE INDEX flowdecision_claims_state ON flowdecision_claims (status, created_at_ms, decision_id);

CREATE INDEX flowdecision_claims_run
    ON flowdecision_claims (run_id, created_at_ms, decision_id)
    WHERE run_id IS NOT NULL;

CREATE INDEX flowdecision_claims_lease
    ON flowdecision_claims
        ((CASE WHEN json_valid(record) THEN json_extract(record, '$.lease_expires_at_ms') END))
    WHERE status = 'pending';

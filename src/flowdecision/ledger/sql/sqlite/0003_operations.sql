-- flowdecision SQLite ledger, schema version 3: operator queries, tombstones, audit.
--
-- The claims table is rebuilt in place (SQLite cannot change a CHECK
-- constraint otherwise), keeping every rowid, to add:
-- * status `tombstone`: what `prune --keep-tombstones` leaves of a completed
--   record (its request hash, attempts, completion time, receipt digest);
-- * `created_at_ms`: when the decision was first claimed (the order operator
--   queries page in). Rows from before this migration take their completion
--   time, or 0 when pending: that time was never recorded;
-- * `run_id`, `causation_event_id`: the request's run and causing event,
--   given to the first claim (NULL for rows from before this migration).
-- `completed_at_ms` is now kept for tombstones too; the prune index is keyed
-- by status so pruning records and pruning tombstones each read only theirs.
CREATE TABLE flowdecision_claims_v2 (
    decision_id        TEXT    NOT NULL UNIQUE,
    status             TEXT    NOT NULL CHECK (status IN ('pending', 'completed', 'tombstone')),
    completed_at_ms    INTEGER,
    record             TEXT    NOT NULL,
    traceparent        TEXT,
    created_at_ms      INTEGER NOT NULL DEFAULT 0,
    run_id             TEXT,
    causation_event_id TEXT
);

INSERT INTO flowdecision_claims_v2
    (rowid, decision_id, status, completed_at_ms, record, traceparent, created_at_ms)
    SELECT rowid, decision_id, status, completed_at_ms, record, traceparent,
        coalesce(completed_at_ms, 0)
    FROM flowdecision_claims;

DROP TABLE flowdecision_claims;

ALTER TABLE flowdecision_claims_v2 RENAME TO flowdecision_claims;

CREATE INDEX flowdecision_claims_prune
    ON flowdecision_claims (status, completed_at_ms)
    WHERE completed_at_ms IS NOT NULL;

-- Keyset pages: all decisions, by state, by run, each in first-claim order.
CREATE INDEX flowdecision_claims_created ON flowdecision_claims (created_at_ms, decision_id);

CREATE INDEX flowdecision_claims_state ON flowdecision_claims (status, created_at_ms, decision_id);

CREATE INDEX flowdecision_claims_run
    ON flowdecision_claims (run_id, created_at_ms, decision_id)
    WHERE run_id IS NOT NULL;

-- The append-only trail of operator actions, written in the action's transaction.
CREATE TABLE flowdecision_audit (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms        INTEGER NOT NULL,
    action       TEXT    NOT NULL,
    decision_id  TEXT    NOT NULL,
    actor        TEXT    NOT NULL,
    reason       TEXT    NOT NULL,
    state_before TEXT    NOT NULL,
    attempts     INTEGER NOT NULL
);

CREATE INDEX flowdecision_audit_decision ON flowdecision_audit (decision_id, seq);

CREATE TRIGGER flowdecision_audit_no_update BEFORE UPDATE ON flowdecision_audit
BEGIN
    SELECT RAISE(ABORT, 'the flowdecision audit trail is append-only');
END;

CREATE TRIGGER flowdecision_audit_no_delete BEFORE DELETE ON flowdecision_audit
BEGIN
    SELECT RAISE(ABORT, 'the flowdecision audit trail is append-only');
END;

-- flowdecision PostgreSQL ledger, schema version 3: operator queries, tombstones, audit.
--
-- * status `tombstone`: what `prune --keep-tombstones` leaves of a completed
--   record (its request hash, attempts, completion time, receipt digest);
-- * `created_at_ms`: when the decision was first claimed (the order operator
--   queries page in), clamped to 2^63-1. Rows from before this migration take
--   their completion time, or 0 when pending: that time was never recorded;
-- * `run_id`, `causation_event_id`: the request's run and causing event,
--   given to the first claim (NULL for rows from before this migration).
-- `completed_at_ms` is now kept for tombstones too; the prune index is keyed
-- by status so pruning records and pruning tombstones each read only theirs.
ALTER TABLE flowdecision_claims DROP CONSTRAINT flowdecision_claims_status_check;

ALTER TABLE flowdecision_claims ADD CONSTRAINT flowdecision_claims_status_check
    CHECK (status IN ('pending', 'completed', 'tombstone'));

ALTER TABLE flowdecision_claims
    ADD COLUMN created_at_ms bigint NOT NULL DEFAULT 0,
    ADD COLUMN run_id text,
    ADD COLUMN causation_event_id text;

UPDATE flowdecision_claims
    SET created_at_ms = LEAST(completed_at_ms, 9223372036854775807)::bigint
    WHERE completed_at_ms IS NOT NULL;

DROP INDEX flowdecision_claims_prune;

CREATE INDEX flowdecision_claims_prune
    ON flowdecision_claims (status, completed_at_ms)
    WHERE completed_at_ms IS NOT NULL;

-- Keyset pages: all decisions, by state, by run, each in first-claim order,
-- ids in code point order (the "C" collation) as on every other ledger.
CREATE INDEX flowdecision_claims_created
    ON flowdecision_claims (created_at_ms, decision_id COLLATE "C");

CREATE INDEX flowdecision_claims_state
    ON flowdecision_claims (status, created_at_ms, decision_id COLLATE "C");

CREATE INDEX flowdecision_claims_run
    ON flowdecision_claims (run_id, created_at_ms, decision_id COLLATE "C")
    WHERE run_id IS NOT NULL;

-- The append-only trail of operator actions, written in the action's transaction.
CREATE TABLE flowdecision_audit (
    seq          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at_ms        bigint NOT NULL,
    action       text   NOT NULL,
    decision_id  text   NOT NULL,
    actor        text   NOT NULL,
    reason       text   NOT NULL,
    state_before text   NOT NULL,
    attempts     bigint NOT NULL
);

CREATE INDEX flowdecision_audit_decision ON flowdecision_audit (decision_id, seq);

CREATE RULE flowdecision_audit_no_update AS ON UPDATE TO flowdecision_audit DO INSTEAD NOTHING;

CREATE RULE flowdecision_audit_no_delete AS ON DELETE TO flowdecision_audit DO INSTEAD NOTHING;

-- flowdecision SQLite ledger, schema version 4: decisions by completion time.
--
-- Operator queries `by=completed` filter on and page in completion order
-- (`completed_at_ms`, then `decision_id`); only completed and tombstoned rows
-- carry that time, so both indexes are partial and a claim (a pending row)
-- never touches them:
-- * every completed decision, in completion order;
-- * per status (completed or tombstone), in completion order. It replaces the
--   prune index of schema 3 (`status, completed_at_ms`), whose queries it
--   answers as well, so a completion still writes one index entry more than
--   schema 3, not two.
-- Existing stores upgrade in place on open; building the indexes reads the
-- table once.
DROP INDEX flowdecision_claims_prune;

CREATE INDEX flowdecision_claims_prune
    ON flowdecision_claims (status, completed_at_ms, decision_id)
    WHERE completed_at_ms IS NOT NULL;

CREATE INDEX flowdecision_claims_completed
    ON flowdecision_claims (completed_at_ms, decision_id)
    WHERE completed_at_ms IS NOT NULL;

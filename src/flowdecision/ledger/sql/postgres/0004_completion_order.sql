-- flowdecision PostgreSQL ledger, schema version 4: decisions by completion time.
--
-- Operator queries `by=completed` filter on and page in completion order
-- (`completed_at_ms`, then `decision_id` in the "C" collation, as on every
-- other ledger); only completed and tombstoned rows carry that time, so both
-- indexes are partial and a claim (a pending row) never touches them:
-- * every completed decision, in completion order;
-- * per status (completed or tombstone), in completion order. It replaces the
--   prune index of schema 3 (`status, completed_at_ms`), whose queries it
--   answers as well, so a completion still writes one index entry more than
--   schema 3, not two.
-- Applied by `flowdecision migrate` like every schema change; building the
-- indexes reads the table once and blocks writes to it meanwhile.
DROP INDEX flowdecision_claims_prune;

CREATE INDEX flowdecision_claims_prune
    ON flowdecision_claims (status, completed_at_ms, decision_id COLLATE "C")
    WHERE completed_at_ms IS NOT NULL;

CREATE INDEX flowdecision_claims_completed
    ON flowdecision_claims (completed_at_ms, decision_id COLLATE "C")
    WHERE completed_at_ms IS NOT NULL;

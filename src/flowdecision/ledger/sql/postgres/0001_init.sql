-- flowdecision PostgreSQL ledger, schema version 1.
--
-- One row per decision. `record` is the claim record exactly as the seed's
-- serde form (ClaimRecord.to_dict, compact JSON) so it round-trips exactly,
-- u64 times included; query it with `record::jsonb`. `status` and
-- `completed_at_ms` are derived from it: `completed_at_ms` is set only for
-- completed records that carry a completion time (the ones prune may delete).
-- NUMERIC(20, 0) holds every u64 exactly.
CREATE TABLE flowdecision_claims (
    decision_id     TEXT           NOT NULL PRIMARY KEY,
    status          TEXT           NOT NULL CHECK (status IN ('pending', 'completed')),
    completed_at_ms NUMERIC(20, 0) CHECK (completed_at_ms BETWEEN 0 AND 18446744073709551615),
    record          TEXT           NOT NULL
);

CREATE INDEX flowdecision_claims_prune
    ON flowdecision_claims (completed_at_ms)
    WHERE completed_at_ms IS NOT NULL;

-- flowdecision PostgreSQL ledger, schema version 8: approval holds.
--
-- Two statuses join the claims table: `held` (a decision the approval policy
-- holds: recorded with its request, nothing sent to the sink, until an operator
-- approves or rejects it) and `rejected` (terminal; `completed_at_ms` is when it
-- was rejected). Held records keep their request in `record` (its JSON: the
-- seed's fields plus `request`, `hold_expires_at_ms`, `reject_closes_run`);
-- existing rows are unchanged. Applied by `flowdecision migrate`.
ALTER TABLE flowdecision_claims DROP CONSTRAINT flowdecision_claims_status_check;

ALTER TABLE flowdecision_claims ADD CONSTRAINT flowdecision_claims_status_check
    CHECK (status IN ('pending', 'completed', 'tombstone', 'held', 'rejected'));

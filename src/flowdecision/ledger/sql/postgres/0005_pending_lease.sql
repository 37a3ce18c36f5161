-- flowdecision PostgreSQL ledger, schema version 5: pending claims by lease expiry.
--
-- `state=pending_live` asks for the few claims whose lease has not run out;
-- the status index hands over every pending claim, live or long expired, and
-- each one's lease sits in the record's JSON. This partial index keeps, for
-- pending rows only, the lease expiry the query compares (the same
-- expression), so live claims and the counts of live and expired claims are
-- index ranges. A claim adds an entry, its completion removes it.
CREATE INDEX flowdecision_claims_lease
    ON flowdecision_claims (((record::json ->> 'lease_expires_at_ms')::numeric))
    WHERE status = 'pending';

-- The planner's estimates of that expression: without them it guesses a third
-- of pending claims live and walks the status index past every expired claim
-- to find the few live ones. Gathered by ANALYZE (autovacuum's too).
CREATE STATISTICS flowdecision_claims_lease_stats
    ON ((record::json ->> 'lease_expires_at_ms')::numeric) FROM flowdecision_claims;

ANALYZE flowdecision_claims;

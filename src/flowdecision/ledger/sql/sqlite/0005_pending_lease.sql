-- flowdecision SQLite ledger, schema version 5: pending claims by lease expiry.
--
-- `state=pending_live` asks for the few claims whose lease has not run out;
-- the status index hands over every pending claim, live or long expired, and
-- each one's lease sits in the record's JSON. This partial index keeps, for
-- pending rows only, the lease expiry the query compares (the same
-- expression: a record that is not JSON is indexed as NULL, so a damaged row
-- is still written and reported when read), so live claims and the counts of
-- live and expired claims are index ranges. A claim adds an entry, its
-- completion removes it.
CREATE INDEX flowdecision_claims_lease
    ON flowdecision_claims
        ((CASE WHEN json_valid(record) THEN json_extract(record, '$.lease_expires_at_ms') END))
    WHERE status = 'pending';

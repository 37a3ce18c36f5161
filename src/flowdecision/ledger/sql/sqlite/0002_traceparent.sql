-- flowdecision ledger, schema version 2: trace context as side data.
--
-- `traceparent` is the W3C trace context (`00-<trace id>-<span id>-<flags>`)
-- of the dispatch that completed the decision, when tracing was on (see
-- docs/OBSERVABILITY.md). It is side data: never part of `record`, so the
-- record stays byte-identical to the seed's serde form (and the JSON file
-- ledger, which has no room for side data, never holds it). NULL otherwise.
ALTER TABLE flowdecision_claims ADD COLUMN traceparent TEXT;

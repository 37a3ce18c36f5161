-- flowdecision outbox, schema version 3: trace context of each row.
--
-- `traceparent` is the W3C trace context (`00-<trace id>-<span id>-<flags>`)
-- of the dispatch that wrote the row, when tracing was on; a relay or any
-- consumer continues the decision's trace from it (docs/OBSERVABILITY.md).
ALTER TABLE flow_decision_outbox ADD COLUMN traceparent TEXT;

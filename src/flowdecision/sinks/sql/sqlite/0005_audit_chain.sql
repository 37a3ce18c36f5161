-- flowdecision outbox (SQLite), schema version 5: a tamper-evident audit trail.
--
-- Each audit row carries `prev_hash`, the `row_hash` of the row before it (by
-- seq; `sha256:000…` for the first), and its own `row_hash`: SHA-256 over
-- `prev_hash` and the row's content, written in the row's transaction
-- (flowdecision/store/chain.py). `flowdecision outbox audit --verify`
-- recomputes the chain. Rows from before this migration keep NULL hashes: an
-- unchained prefix, reported as such; the chain starts after them.
ALTER TABLE flow_decision_outbox_audit ADD COLUMN prev_hash TEXT;

ALTER TABLE flow_decision_outbox_audit ADD COLUMN row_hash TEXT;

-- flowdecision SQLite ledger, schema version 7: a tamper-evident audit trail.
--
-- Each audit row carries `prev_hash`, the `row_hash` of the row before it (by
-- seq; `sha256:000…` for the first), and its own `row_hash`: SHA-256 over
-- `prev_hash` and the row's content, computed in the action's transaction
-- (flowdecision/store/chain.py). `flowdecision audit --verify` recomputes the
-- chain and names the first row that does not match. Rows from before this
-- migration keep NULL hashes: an unchained prefix, reported as such; the chain
-- starts after them. Adding the columns rewrites nothing.
ALTER TABLE flowdecision_audit ADD COLUMN prev_hash TEXT;

ALTER TABLE flowdecision_audit ADD COLUMN row_hash TEXT;

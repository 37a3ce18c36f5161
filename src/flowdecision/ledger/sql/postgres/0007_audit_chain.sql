-- flowdecision PostgreSQL ledger, schema version 7: a tamper-evident audit trail.
--
-- Each audit row carries `prev_hash`, the `row_hash` of the row before it (by
-- seq; `sha256:000…` for the first), and its own `row_hash`: SHA-256 over
-- `prev_hash` and the row's content, computed in the action's transaction under
-- a transaction-scoped advisory lock, so concurrent actions chain one after the
-- other (flowdecision/store/chain.py). `flowdecision audit --verify` recomputes
-- the chain and names the first row that does not match. Rows from before this
-- migration keep NULL hashes: an unchained prefix, reported as such; the chain
-- starts after them.
ALTER TABLE flowdecision_audit
    ADD COLUMN prev_hash text,
    ADD COLUMN row_hash text;

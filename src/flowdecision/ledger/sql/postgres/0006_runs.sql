-- flowdecision PostgreSQL ledger, schema version 6: run invariants.
--
-- One row per run that has (or had) a terminal decision: the `complete` or
-- `fail` decision reserved when it was first claimed, and, once it completed,
-- the close. Written in the same transaction as that claim and that
-- completion, under a transaction-scoped advisory lock on the run (so a run
-- without a row, which is open, is serialized too; docs/PROTOCOL.md, "Runs").
-- The claim records themselves are untouched (they stay the seed's).
-- Applied by `flowdecision migrate`; the table starts empty, so every run
-- already in the ledger is open until a terminal decision of it is claimed
-- under the new rules.
CREATE TABLE flowdecision_runs (
    run_id                 text   NOT NULL PRIMARY KEY,
    terminal_decision_id   text   NOT NULL,
    terminal_kind          text   NOT NULL,
    terminal_claimed_at_ms bigint NOT NULL,
    closed_at_ms           bigint
);

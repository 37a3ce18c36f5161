-- flowdecision outbox (SQLite), schema version 4: parked rows and their audit trail.
--
-- A row a relay's sink refuses for good (a webhook 4xx, a closed Temporal run, an
-- unknown Restate handler, a content conflict) is *parked*: recorded here with the
-- error, the attempts and the time, so that the relay's cursor can move past it
-- and every other run goes on. The run's later rows are recorded behind it as
-- *held*, which keeps the run's order: a run is delivered from this table, in seq
-- order, until it holds no row. An operator releases a parked row (`retry`: it
-- becomes held, the relay delivers it next) or drops it (`skip`), both are
-- written to flow_decision_outbox_audit in the same transaction.
CREATE TABLE flow_decision_outbox_parked (
    relay         TEXT    NOT NULL,
    seq           INTEGER NOT NULL,
    decision_id   TEXT    NOT NULL,
    run_id        TEXT    NOT NULL,
    state         TEXT    NOT NULL CHECK (state IN ('parked', 'held')),
    error         TEXT,
    attempts      INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    parked_at_ms  INTEGER NOT NULL,
    updated_at_ms INTEGER NOT NULL,
    PRIMARY KEY (relay, seq)
);

CREATE INDEX flow_decision_outbox_parked_run
    ON flow_decision_outbox_parked (relay, run_id, seq);

-- Operator actions on parked rows (`retry`, `skip`), append-only.
CREATE TABLE flow_decision_outbox_audit (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms        INTEGER NOT NULL,
    relay        TEXT    NOT NULL,
    action       TEXT    NOT NULL,
    decision_id  TEXT    NOT NULL,
    actor        TEXT    NOT NULL,
    reason       TEXT    NOT NULL,
    state_before TEXT    NOT NULL,
    attempts     INTEGER NOT NULL
);

CREATE TRIGGER flow_decision_outbox_audit_no_update BEFORE UPDATE ON flow_decision_outbox_audit
BEGIN
    SELECT RAISE(ABORT, 'the outbox audit trail is append-only');
END;

CREATE TRIGGER flow_decision_outbox_audit_no_delete BEFORE DELETE ON flow_decision_outbox_audit
BEGIN
    SELECT RAISE(ABORT, 'the outbox audit trail is append-only');
END;

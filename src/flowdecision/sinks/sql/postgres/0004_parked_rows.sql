-- flowdecision outbox (PostgreSQL), schema version 4: parked rows and their audit trail.
--
-- A row a relay's sink refuses for good (a webhook 4xx, a closed Temporal run, an
-- unknown Restate handler, a content conflict) is *parked*: recorded here with the
-- error, the attempts and the time (database clock), so that the relay's cursor can
-- move past it and every other run goes on. The run's later rows are recorded
-- behind it as *held*, which keeps the run's order: a run is delivered from this
-- table, in seq order, until it holds no row. An operator releases a parked row
-- (`retry`: it becomes held, the relay delivers it next) or drops it (`skip`), both
-- are written to flow_decision_outbox_audit in the same transaction.
CREATE TABLE flow_decision_outbox_parked (
    relay         text   NOT NULL,
    seq           bigint NOT NULL,
    decision_id   text   NOT NULL,
    run_id        text   NOT NULL,
    state         text   NOT NULL CHECK (state IN ('parked', 'held')),
    error         text,
    attempts      bigint NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    parked_at_ms  bigint NOT NULL,
    updated_at_ms bigint NOT NULL,
    PRIMARY KEY (relay, seq)
);

CREATE INDEX flow_decision_outbox_parked_run
    ON flow_decision_outbox_parked (relay, run_id, seq);

-- Operator actions on parked rows (`retry`, `skip`), append-only.
CREATE TABLE flow_decision_outbox_audit (
    seq          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at_ms        bigint NOT NULL,
    relay        text   NOT NULL,
    action       text   NOT NULL,
    decision_id  text   NOT NULL,
    actor        text   NOT NULL,
    reason       text   NOT NULL,
    state_before text   NOT NULL,
    attempts     bigint NOT NULL
);

CREATE RULE flow_decision_outbox_audit_no_update AS ON UPDATE TO flow_decision_outbox_audit
    DO INSTEAD NOTHING;

CREATE RULE flow_decision_outbox_audit_no_delete AS ON DELETE TO flow_decision_outbox_audit
    DO INSTEAD NOTHING;

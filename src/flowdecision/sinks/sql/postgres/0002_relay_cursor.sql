-- flowdecision outbox (PostgreSQL), schema version 2: relay cursors and the wake-up.
--
-- One row per named relay (OutboxRelay, `flowdecision relay --name`). `position`
-- is the seq of the last row the relay's sink accepted: the relay delivers rows
-- with seq > position and advances it only after the sink accepted them.
-- `owner`, `fence` and `lease_expires_at_ms` (database clock) are the lease that
-- keeps two relays with the same name from delivering in parallel: taking over
-- an expired lease raises `fence`, and every advance names the fence it holds,
-- so a stale owner's write changes nothing. `delivered` counts rows delivered
-- through this cursor.
CREATE TABLE flow_decision_outbox_cursor (
    name                TEXT   PRIMARY KEY,
    position            BIGINT NOT NULL DEFAULT 0 CHECK (position >= 0),
    owner               TEXT,
    fence               BIGINT NOT NULL DEFAULT 0 CHECK (fence >= 0),
    lease_expires_at_ms BIGINT NOT NULL DEFAULT 0,
    delivered           BIGINT NOT NULL DEFAULT 0,
    updated_at_ms       BIGINT NOT NULL
);

-- Relays and long-polls LISTEN on `flow_decision_outbox`: one NOTIFY per
-- inserting statement, delivered when its transaction commits (so a waiter never
-- wakes before the rows are visible), from any writer on any host. The body is a
-- quoted string so the migration runner's statement splitter keeps it whole.
CREATE FUNCTION flow_decision_outbox_notify() RETURNS trigger LANGUAGE plpgsql
    AS 'BEGIN PERFORM pg_notify(''flow_decision_outbox'', ''''); RETURN NULL; END';

-- (OR REPLACE: the splitter, SQLite's, would read a plain CREATE TRIGGER up to an END.)
CREATE OR REPLACE TRIGGER flow_decision_outbox_notify
    AFTER INSERT ON flow_decision_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION flow_decision_outbox_notify();

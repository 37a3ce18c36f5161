-- flowdecision outbox (SQLite), schema version 2: relay cursors.
--
-- One row per named relay (OutboxRelay, `flowdecision relay --name`). `position`
-- is the seq of the last row the relay's sink accepted: the relay delivers rows
-- with seq > position and advances it only after the sink accepted them.
-- `owner`, `fence` and `lease_expires_at_ms` are the lease that keeps two relays
-- with the same name from delivering in parallel: taking over an expired lease
-- raises `fence`, and every advance names the fence it holds, so a stale owner's
-- write changes nothing. `delivered` counts rows delivered through this cursor.
CREATE TABLE flow_decision_outbox_cursor (
    name                TEXT    PRIMARY KEY,
    position            INTEGER NOT NULL DEFAULT 0 CHECK (position >= 0),
    owner               TEXT,
    fence               INTEGER NOT NULL DEFAULT 0 CHECK (fence >= 0),
    lease_expires_at_ms INTEGER NOT NULL DEFAULT 0,
    delivered           INTEGER NOT NULL DEFAULT 0,
    updated_at_ms       INTEGER NOT NULL
);

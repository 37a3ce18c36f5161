-- flowdecision outbox (SQLite), schema version 1.
--
-- One row per accepted decision. `seq` is the consumers' cursor: SQLite
-- serializes writers, so seq order is commit order and `after = <last seq>`
-- never skips a row. `request_json` holds the exact wire bytes of
-- DecisionRequest.to_json() (UTF-8 text), `request_hash` their SHA-256.
CREATE TABLE flow_decision_outbox (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    decision_id     TEXT    NOT NULL,
    request_json    TEXT    NOT NULL,
    request_hash    TEXT    NOT NULL,
    first_attempt   INTEGER NOT NULL CHECK (first_attempt >= 0),
    highest_attempt INTEGER NOT NULL CHECK (highest_attempt >= first_attempt),
    accepted_at_ms  INTEGER NOT NULL
);

CREATE UNIQUE INDEX flow_decision_outbox_decision_id
    ON flow_decision_outbox (decision_id);

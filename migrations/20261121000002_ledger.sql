-- Every movement of value is one entry; `entry_id` makes replays harmless.
CREATE TABLE ledger_entries (
    entry_id   TEXT PRIMARY KEY,
    account    BIGINT NOT NULL,
    asset      TEXT NOT NULL,
    amount     BIGINT NOT NULL,
    reason     TEXT NOT NULL,
    ref        JSONB,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX ledger_entries_account ON ledger_entries (account, asset);

-- Balances follow from the entries; kept in step inside the same transaction.
CREATE TABLE balances (
    account    BIGINT NOT NULL,
    asset      TEXT NOT NULL,
    balance    BIGINT NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (account, asset)
);

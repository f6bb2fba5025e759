-- Pools, red packets and activities share one id namespace.
CREATE TABLE pools (
    id         TEXT PRIMARY KEY,
    kind       TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Every `prizepool pool load` stores a new version; codes only ever grow.
CREATE TABLE pool_versions (
    pool_id    TEXT NOT NULL REFERENCES pools (id),
    version    INTEGER NOT NULL,
    config     JSONB NOT NULL,
    codes      JSONB NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (pool_id, version)
);

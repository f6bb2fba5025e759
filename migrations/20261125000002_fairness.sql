-- Provably fair lucky-gift batches (docs/fairness.md): what each batch
-- committed to before it became visible, the seeds revealed once a batch is
-- used up, and every draw's prizes with their positions in the batch order.
-- The three tables are append-only: rows are inserted once (a duplicate
-- insert is skipped) and never changed or removed.

CREATE TABLE fair_batches (
    pool        TEXT NOT NULL,
    generation  BIGINT NOT NULL,
    -- The config version the batch was shuffled under (part of the context).
    version     BIGINT NOT NULL,
    -- SHA-256 of the secret seed, lowercase hex.
    commitment  TEXT NOT NULL CHECK (commitment ~ '^[0-9a-f]{64}$'),
    size        BIGINT NOT NULL,
    -- [{"combo": id, "stock": [[multiplier, count], ...]}, ...] in configuration order.
    composition JSONB NOT NULL,
    recorded_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (pool, generation, version)
);
CREATE INDEX fair_batches_commitment ON fair_batches (commitment);

CREATE TABLE fair_reveals (
    pool        TEXT NOT NULL,
    generation  BIGINT NOT NULL,
    version     BIGINT NOT NULL,
    seed        TEXT NOT NULL CHECK (seed ~ '^[0-9a-f]{64}$'),
    recorded_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (pool, generation)
);

CREATE TABLE fair_draws (
    pool        TEXT NOT NULL,
    -- The pool's draw counter after the draw (the ledger entry's serial).
    serial      BIGINT NOT NULL,
    request_id  TEXT NOT NULL,
    user_id     BIGINT NOT NULL,
    version     BIGINT NOT NULL,
    -- [{"multiplier", "combo"}, ...] in draw order.
    prizes      JSONB NOT NULL,
    -- [{"generation", "position", "count"}, ...]: runs in the order of prizes.
    positions   JSONB NOT NULL,
    -- [{"generation", "position"}, ...]: jackpots parked by this draw.
    held_back   JSONB NOT NULL,
    recorded_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (pool, serial)
);

CREATE FUNCTION fair_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME;
END;
$$;

CREATE TRIGGER fair_batches_append_only BEFORE UPDATE OR DELETE ON fair_batches
    FOR EACH ROW EXECUTE FUNCTION fair_append_only();
CREATE TRIGGER fair_reveals_append_only BEFORE UPDATE OR DELETE ON fair_reveals
    FOR EACH ROW EXECUTE FUNCTION fair_append_only();
CREATE TRIGGER fair_draws_append_only BEFORE UPDATE OR DELETE ON fair_draws
    FOR EACH ROW EXECUTE FUNCTION fair_append_only();
CREATE TRIGGER fair_batches_no_truncate BEFORE TRUNCATE ON fair_batches
    FOR EACH STATEMENT EXECUTE FUNCTION fair_append_only();
CREATE TRIGGER fair_reveals_no_truncate BEFORE TRUNCATE ON fair_reveals
    FOR EACH STATEMENT EXECUTE FUNCTION fair_append_only();
CREATE TRIGGER fair_draws_no_truncate BEFORE TRUNCATE ON fair_draws
    FOR EACH STATEMENT EXECUTE FUNCTION fair_append_only();

-- Provably fair lottery picks (docs/fairness.md, "Lotteries"): the
-- commitment of each activity's seed per period, recorded before any draw
-- uses the seed; the seed, revealed once its period is over; and every
-- `wheel` draw with the value it used and the candidates it was read
-- against. Append-only like the batch tables (20261125000002_fairness.sql).

CREATE TABLE fair_lottery_seeds (
    activity    TEXT NOT NULL,
    -- The period's start, unix seconds (a multiple of period_s).
    period      BIGINT NOT NULL,
    period_s    BIGINT NOT NULL CHECK (period_s BETWEEN 1 AND 86400),
    -- SHA-256 of the secret seed, lowercase hex.
    commitment  TEXT NOT NULL CHECK (commitment ~ '^[0-9a-f]{64}$'),
    recorded_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (activity, period)
);
CREATE INDEX fair_lottery_seeds_commitment ON fair_lottery_seeds (commitment);

CREATE TABLE fair_lottery_reveals (
    activity    TEXT NOT NULL,
    period      BIGINT NOT NULL,
    seed        TEXT NOT NULL CHECK (seed ~ '^[0-9a-f]{64}$'),
    recorded_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (activity, period)
);

CREATE TABLE fair_lottery_draws (
    activity    TEXT NOT NULL,
    -- The activity's award counter after the draw (one per draw; the
    -- ledger entry's serial).
    serial      BIGINT NOT NULL,
    request_id  TEXT NOT NULL,
    user_id     BIGINT NOT NULL,
    -- The seed period the value came from (its start, unix seconds).
    period      BIGINT NOT NULL,
    -- The value the pick used, in [0, 2^52).
    value       BIGINT NOT NULL,
    -- [{"prize", "weight"}, ...]: the candidates in the order the pick walked them.
    weights     JSONB NOT NULL,
    -- The prize the draw was answered with.
    prize       TEXT NOT NULL,
    recorded_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (activity, serial)
);

CREATE TRIGGER fair_lottery_seeds_append_only BEFORE UPDATE OR DELETE ON fair_lottery_seeds
    FOR EACH ROW EXECUTE FUNCTION fair_append_only();
CREATE TRIGGER fair_lottery_reveals_append_only BEFORE UPDATE OR DELETE ON fair_lottery_reveals
    FOR EACH ROW EXECUTE FUNCTION fair_append_only();
CREATE TRIGGER fair_lottery_draws_append_only BEFORE UPDATE OR DELETE ON fair_lottery_draws
    FOR EACH ROW EXECUTE FUNCTION fair_append_only();
CREATE TRIGGER fair_lottery_seeds_no_truncate BEFORE TRUNCATE ON fair_lottery_seeds
    FOR EACH STATEMENT EXECUTE FUNCTION fair_append_only();
CREATE TRIGGER fair_lottery_reveals_no_truncate BEFORE TRUNCATE ON fair_lottery_reveals
    FOR EACH STATEMENT EXECUTE FUNCTION fair_append_only();
CREATE TRIGGER fair_lottery_draws_no_truncate BEFORE TRUNCATE ON fair_lottery_draws
    FOR EACH STATEMENT EXECUTE FUNCTION fair_append_only();

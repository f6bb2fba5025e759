-- A draw's record without a value per prize (docs/fairness.md, "The audit
-- trail"). An ordinary draw takes one run of consecutive positions of one
-- batch and meets no parked jackpot: its row keeps that run (`generation`,
-- `position`, `count`) and `prizes_sha256`, the SHA-256 of the prizes it
-- was answered with (one line `<combo> <multiplier>` LF per prize, in draw
-- order), and leaves `prizes`, `positions` and `held_back` NULL. The
-- prizes follow from the revealed seed and the run; the digest pins what
-- the draw was given. Every other draw (across a batch boundary, a parked
-- or won jackpot, a draw of more than 100 prizes) keeps the full form of
-- the first migration, with the new columns NULL. Rows written before
-- this migration are in the full form too.
--
-- Metadata only: adding nullable columns and dropping NOT NULL rewrite
-- nothing, and the constraint (NOT VALID) checks new rows only: every
-- older row is in the full form.
ALTER TABLE fair_draws
    ALTER COLUMN prizes DROP NOT NULL,
    ALTER COLUMN positions DROP NOT NULL,
    ALTER COLUMN held_back DROP NOT NULL,
    ADD COLUMN generation BIGINT,
    ADD COLUMN position BIGINT,
    ADD COLUMN count BIGINT,
    ADD COLUMN prizes_sha256 BYTEA,
    -- Exactly one of the two forms.
    ADD CONSTRAINT fair_draws_one_form CHECK (
        (prizes IS NOT NULL AND positions IS NOT NULL AND held_back IS NOT NULL
         AND generation IS NULL AND position IS NULL AND count IS NULL AND prizes_sha256 IS NULL)
        OR
        (prizes IS NULL AND positions IS NULL AND held_back IS NULL
         AND generation IS NOT NULL AND position IS NOT NULL AND count > 0
         AND length(prizes_sha256) = 32)
    ) NOT VALID;

-- Records a group of draws in one statement: the seeds they revealed
-- ($1..$4) and the draws ($5..$16), parallel arrays, one element per row.
-- A draw is in one of two forms (migrations/20261126000001_lean_fair_draws.sql):
-- lean ($10..$13 set, $14..$16 NULL) or full ($10..$13 NULL, $14..$16 set).
-- A row already there is kept (redeliveries and replays record once; two
-- copies of one draw in the same group are skipped the same way). A
-- data-modifying WITH runs to completion whether or not it is read, and
-- the statement is atomic: the group is recorded whole or not at all.
WITH reveals AS (
    INSERT INTO fair_reveals (pool, generation, version, seed)
    SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::text[])
    ON CONFLICT DO NOTHING
)
INSERT INTO fair_draws (pool, serial, request_id, user_id, version,
                        generation, position, count, prizes_sha256,
                        prizes, positions, held_back)
SELECT * FROM unnest($5::text[], $6::bigint[], $7::text[], $8::bigint[], $9::bigint[],
                     $10::bigint[], $11::bigint[], $12::bigint[], $13::bytea[],
                     $14::jsonb[], $15::jsonb[], $16::jsonb[])
ON CONFLICT DO NOTHING

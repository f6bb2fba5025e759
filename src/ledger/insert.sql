-- Writes the first entry of each entry_id of a batch unless the id is in the
-- ledger already; returns the 1-based positions of the entries written.
-- $1..$6 are parallel arrays, one element per entry. `ON CONFLICT DO NOTHING`
-- waits for a concurrent transaction that holds the same id, so each id is
-- written by exactly one batch; whether a skipped entry repeats the stored
-- one or contradicts it is checked afterwards (compare.sql), when the stored
-- row is visible.
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[], $5::text[], $6::jsonb[])
        WITH ORDINALITY AS t(entry_id, account, asset, amount, reason, ref, n)
), first AS (
    SELECT DISTINCT ON (entry_id) * FROM input ORDER BY entry_id, n
), inserted AS (
    INSERT INTO ledger_entries (entry_id, account, asset, amount, reason, ref)
    SELECT entry_id, account, asset, amount, reason, ref FROM first ORDER BY n
    ON CONFLICT (entry_id) DO NOTHING
    RETURNING entry_id
)
SELECT first.n FROM first JOIN inserted USING (entry_id)

-- Writes the first entry of each entry_id of a batch unless the id is in the
-- ledger already, then locks the balance of each (account, asset) pair those
-- entries touch and moves it by their sum: one round trip for both. $1..$6
-- are parallel arrays, one element per entry.
--
-- `ON CONFLICT DO NOTHING` waits for a concurrent transaction that holds the
-- same id, so each id is written by exactly one batch; whether a skipped
-- entry repeats the stored one or contradicts it is checked afterwards
-- (compare.sql), when the stored row is visible.
--
-- The balances are locked after every entry is written (the grouping of
-- `moved` reads all of `inserted` first), in one fixed order so that
-- concurrent batches cannot deadlock on each other, and created when
-- missing. `DO UPDATE` rather than `SELECT … FOR UPDATE`: it also locks a
-- row another batch created after this statement's snapshot. Each balance
-- moves by the sum of its new entries at once (the ledger then judges the
-- entries one by one from the balance before, and puts right the few
-- balances a refusal leaves elsewhere): in the common case, where every
-- entry lands, a balance is written once per batch. A sum that would take
-- a balance out of the 64-bit range is not applied: the row is locked all
-- the same, but not returned (the caller reads it).
--
-- Rows: `(n, NULL, NULL, NULL, NULL, NULL)` for each entry written (its
-- 1-based position), and `(NULL, account, asset, balance, created, moved)`
-- for each balance locked and moved (`balance`: after the move; `moved`:
-- the sum it moved by; `created`: this statement made the row).
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[], $5::text[], $6::jsonb[])
        WITH ORDINALITY AS t(entry_id, account, asset, amount, reason, ref, n)
), first AS (
    SELECT DISTINCT ON (entry_id) * FROM input ORDER BY entry_id, n
), inserted AS (
    INSERT INTO ledger_entries (entry_id, account, asset, amount, reason, ref)
    SELECT entry_id, account, asset, amount, reason, ref FROM first ORDER BY n
    ON CONFLICT (entry_id) DO NOTHING
    RETURNING entry_id, account, asset, amount
), moved AS (
    SELECT account, asset, sum(amount) AS delta FROM inserted GROUP BY account, asset
), locked AS (
    INSERT INTO balances AS b (account, asset, balance)
    SELECT account, asset, delta::bigint FROM moved ORDER BY account, asset
    ON CONFLICT (account, asset) DO UPDATE
        SET balance = b.balance + excluded.balance, updated_at = now()
        WHERE b.balance::numeric + excluded.balance
              BETWEEN -9223372036854775808 AND 9223372036854775807
    RETURNING account, asset, balance, (xmax = 0) AS created
)
SELECT first.n, NULL::bigint AS account, NULL::text AS asset, NULL::bigint AS balance,
       NULL::boolean AS created, NULL::bigint AS moved
FROM first JOIN inserted USING (entry_id)
UNION ALL
SELECT NULL, account, asset, balance, created, delta::bigint FROM locked JOIN moved USING (account, asset)

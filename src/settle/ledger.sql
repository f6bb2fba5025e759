-- Applies a batch of ledger entries; an entry_id seen before is skipped.
-- $1..$7 are parallel arrays, one element per entry. Balances move by the
-- entries actually inserted, so a replayed batch changes nothing.
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[], $5::text[], $6::jsonb[])
        AS t(entry_id, account, asset, amount, reason, ref)
), inserted AS (
    INSERT INTO ledger_entries (entry_id, account, asset, amount, reason, ref)
    SELECT DISTINCT ON (entry_id) entry_id, account, asset, amount, reason, ref FROM input
    ON CONFLICT (entry_id) DO NOTHING
    RETURNING account, asset, amount
), moved AS (
    SELECT account, asset, sum(amount)::bigint AS amount FROM inserted GROUP BY account, asset
), applied AS (
    INSERT INTO balances AS b (account, asset, balance)
    SELECT account, asset, amount FROM moved
    ON CONFLICT (account, asset) DO UPDATE SET balance = b.balance + EXCLUDED.balance, updated_at = now()
    RETURNING 1
)
SELECT (SELECT count(*) FROM inserted) AS inserted, (SELECT count(*) FROM applied) AS accounts

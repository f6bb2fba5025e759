-- Locks the balance of each (account, asset) pair, creating it at zero when
-- missing, in one fixed order so that concurrent batches cannot deadlock on
-- each other. Returns each balance and whether this call created its row.
INSERT INTO balances AS b (account, asset, balance)
SELECT DISTINCT account, asset, 0::bigint FROM unnest($1::bigint[], $2::text[]) AS t(account, asset)
ORDER BY account, asset
ON CONFLICT (account, asset) DO UPDATE SET balance = b.balance
RETURNING account, asset, balance, (xmax = 0) AS created

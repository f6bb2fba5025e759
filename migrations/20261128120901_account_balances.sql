-- `account_balances`: every account's balance per asset, for services that
-- read balances without the prizepool binary (docs/upstream.md). It is the
-- interface to read; the `balances` table behind it may change.
--
-- One row per account and asset that ever moved; an account without a row
-- holds 0. `balance` is an integer in the asset's smallest unit, in step
-- with the ledger's entries (both are written in one transaction), and
-- `updated_at` is when it last moved.
--
-- Read-only by construction: a view with GROUP BY cannot be written
-- through, whoever asks. Grouping by the table's primary key changes no
-- row and keeps a lookup of one account on the key's index. Grant readers
-- SELECT on this view only.
CREATE VIEW account_balances AS
SELECT account, asset, balance, updated_at
FROM balances
GROUP BY account, asset;

-- For each entry of a batch whose entry_id is in the ledger: whether the
-- stored entry has the same content. Content is account, asset, amount and
-- reason; `ref` is context (a red-packet grab retried under another
-- request_id carries another ref for the same credit).
SELECT t.n, (e.account = t.account AND e.asset = t.asset AND e.amount = t.amount
             AND e.reason = t.reason) AS same
FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[], $5::text[])
    WITH ORDINALITY AS t(entry_id, account, asset, amount, reason, n)
JOIN ledger_entries e USING (entry_id)

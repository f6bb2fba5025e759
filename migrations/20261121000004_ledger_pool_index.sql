-- Per-pool totals (`settle::pool_total`: the demo, the bench's settlement
-- lag, operators reconciling a pool) read entries by the pool in `ref`.
CREATE INDEX ledger_entries_pool ON ledger_entries ((ref->>'pool'), asset);

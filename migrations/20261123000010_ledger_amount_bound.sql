-- Every new entry moves a non-zero amount of at most 2^53 - 1 either way
-- (`ledger::MAX_AMOUNT`), so every figure stays exact in any JSON reader.
-- The ledger checks this before writing; the constraint is the last line of
-- defence. NOT VALID: entries written before the bound are not re-checked.
ALTER TABLE ledger_entries
    ADD CONSTRAINT ledger_entries_amount_bound
    CHECK (amount <> 0 AND amount BETWEEN -9007199254740991 AND 9007199254740991) NOT VALID;

-- A red packet commits to its split when it is created: SHA-256 over its id,
-- a random salt and its shares in order (docs/fairness.md, "Red packets").
-- The salt is revealed with the shares when the packet closes. Packets
-- created before keep NULL: they have no commitment to check.
ALTER TABLE red_packets ADD COLUMN salt TEXT, ADD COLUMN commitment TEXT;

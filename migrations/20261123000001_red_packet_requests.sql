-- What a `redpacket.create` asked for, beyond the columns that already hold
-- it (sender, asset, total, share_count): a repeated create is compared with
-- these and refused if it asks for something else. NULL on packets created
-- before this migration, which are compared on the other columns only.
ALTER TABLE red_packets
    ADD COLUMN min_asked    BIGINT,
    ADD COLUMN expires_in_s BIGINT;

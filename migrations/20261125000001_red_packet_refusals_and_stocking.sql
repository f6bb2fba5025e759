-- A packet is stocked in Redis once, never again: `stocked_at` is set once
-- its first stocking succeeded, so a create sent again after Redis lost the
-- packet cannot stock its shares (grabbed and paid ones included) a second
-- time. Packets created before this migration were stocked by their create.
ALTER TABLE red_packets ADD COLUMN stocked_at TIMESTAMPTZ;
UPDATE red_packets SET stocked_at = created_at;

-- A `redpacket.create` refused `insufficient_funds` is remembered with what
-- it asked: the same create again replays the refusal (even once the sender
-- holds enough), other content under its id is refused as bad input. The id
-- is not taken as a pool (no row in `pools`): nothing was created.
CREATE TABLE red_packet_refusals (
    id           TEXT PRIMARY KEY,
    sender       BIGINT NOT NULL,
    asset        TEXT NOT NULL,
    total        BIGINT NOT NULL,
    share_count  BIGINT NOT NULL,
    min_asked    BIGINT NOT NULL,
    expires_in_s BIGINT NOT NULL,
    -- The balance the refusal reported.
    balance      BIGINT NOT NULL,
    refused_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);

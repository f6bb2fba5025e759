CREATE TABLE red_packets (
    id          TEXT PRIMARY KEY REFERENCES pools (id),
    sender      BIGINT NOT NULL,
    asset       TEXT NOT NULL,
    total       BIGINT NOT NULL,
    share_count INTEGER NOT NULL,
    min_share   BIGINT NOT NULL,
    expires_at  TIMESTAMPTZ NOT NULL,
    closed_at   TIMESTAMPTZ,
    refunded    BIGINT,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE red_packet_shares (
    packet_id TEXT NOT NULL REFERENCES red_packets (id),
    share_no  INTEGER NOT NULL,
    amount    BIGINT NOT NULL,
    PRIMARY KEY (packet_id, share_no)
);

-- Lottery activities: one row per `prizepool activity load`.
CREATE TABLE activity_versions (
    activity_id TEXT NOT NULL REFERENCES pools (id),
    version     INTEGER NOT NULL,
    config      JSONB NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (activity_id, version)
);

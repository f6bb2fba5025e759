//! Red packets: packets of one share per simulated user, grabbed one share
//! at a time, consecutive grabs crowding one packet as in a red-packet rain.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use futures_util::{future::BoxFuture, FutureExt};
use prizepool::{
    kinds::red_packet::{self, split::MAX_SHARES},
    messages::{RedPacketCreate, SettleRequest},
};

use super::{Load, Services, Target, Workload};

/// Red packets.
pub(super) struct RedPacket;

impl Workload for RedPacket {
    fn name(&self) -> &'static str {
        "red-packet"
    }

    fn label(&self) -> &'static str {
        "RedPacket"
    }

    fn ceiling<'a>(
        &'a self,
        svc: &'a Services<'a>,
        args: &'a Load,
    ) -> BoxFuture<'a, anyhow::Result<Target>> {
        async move {
            let shares = packet_shares(args.users);
            let grabs = (40 * args.ceiling_pass_ms).max(1);
            let id = crate::bench::services::unique("bench-ceiling");
            let packets = create(svc, &id, shares, grabs.div_ceil(shares)).await?;
            let count = packets.len();
            Ok(Target {
                pools: Arc::new(packets),
                pick: Arc::new(move |n| grab_of(n, shares, count)),
                count: 1,
                endless: false,
            })
        }
        .boxed()
    }

    fn fleet<'a>(
        &'a self,
        svc: &'a Services<'a>,
        args: &'a Load,
        id: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Target>> {
        async move {
            // Enough shares for the warm-up and the full-speed phase at up to
            // 40k grabs/s; the half-rate phase needs a quarter of that again.
            let shares = packet_shares(args.users);
            let grabs = 40_000 * (1 + args.duration * 3 / 2);
            let packets = create(svc, id, shares, grabs.div_ceil(shares)).await?;
            let count = packets.len();
            // Phases number their draws from 0 each; grabs are numbered
            // across them.
            let grabbed = AtomicU64::new(0);
            Ok(Target {
                pools: Arc::new(packets),
                pick: Arc::new(move |_| {
                    grab_of(grabbed.fetch_add(1, Ordering::Relaxed), shares, count)
                }),
                count: 1,
                endless: false,
            })
        }
        .boxed()
    }
}

/// Shares of each red packet a run grabs: one per simulated user, within
/// the largest packet allowed.
fn packet_shares(users: u64) -> u64 {
    users.clamp(1, u64::from(MAX_SHARES))
}

/// The packet (index among `packets`) and the user of the `n`th grab from
/// packets of `shares` shares: packet `n / shares` for user `n % shares`,
/// so consecutive grabs crowd one packet, as in a red-packet rain, and no
/// user grabs a packet twice.
fn grab_of(n: u64, shares: u64, packets: usize) -> (usize, i64) {
    (((n / shares) as usize) % packets, 1 + (n % shares) as i64)
}

/// Creates `count` red packets `<id>-<n>` of `shares` shares each, all
/// funded by one top-up, and returns their ids.
async fn create(
    svc: &Services<'_>,
    id: &str,
    shares: u64,
    count: u64,
) -> anyhow::Result<Vec<String>> {
    let packets: Vec<String> = (0..count).map(|n| format!("{id}-{n}")).collect();
    // Shares of 1 to about 200 coins, like small packets in a chat group.
    let total = shares as i64 * 100;
    let sender = 990_000_001;
    let topup = SettleRequest::new(
        format!("topup:{id}"),
        sender,
        "coin",
        total * count as i64,
        "topup",
        serde_json::json!({ "pool": id }),
    );
    prizepool::settle::apply(&svc.db, std::slice::from_ref(&topup)).await?;
    let mut conn = svc.redis.clone();
    for packet in &packets {
        let create = RedPacketCreate {
            packet_id: packet.clone(),
            sender,
            total,
            count: shares as i64,
            min: 1,
            expires_in_s: 3600,
            asset: "coin".into(),
        };
        red_packet::create(&svc.db, &mut conn, &svc.config.redis_prefix, &create).await?;
    }
    Ok(packets)
}

//! Seals on the ledger entries the fleet itself publishes.
//!
//! The settle queue takes messages from upstream services (top-ups, debits)
//! and from the workers (a draw's reward, a red packet's share or refund, a
//! lottery prize). Both arrive the same way, so the workers' entries carry a
//! seal: HMAC-SHA256 over the entry's id, account, asset, amount and reason,
//! keyed with a secret upstreams never see. The settle worker applies an
//! entry with an internal reason ([`INTERNAL_REASONS`]) only when its seal
//! matches, and refuses any unsealed entry whose id lies in an internal
//! namespace ([`INTERNAL_ID_PREFIXES`]), so an upstream can neither forge a
//! reward nor squat the id a real reward will use.
//!
//! The key is `LEDGER_SEAL_KEY` when set (production: from a secret store,
//! the same value for every worker), otherwise a random key the first
//! worker stores in Redis under `<prefix>:ledger-seal-key`, which every
//! worker of the fleet reads at start. The Redis key must survive as long as
//! sealed entries wait in the settle queue (see the durability notes in
//! `docs/operations.md`).

use hmac::{Hmac, Mac};
use rand::RngCore;
use redis::aio::ConnectionLike;
use sha2::Sha256;

use crate::messages::{Invalid, SettleRequest};

/// Reasons only the fleet may publish: entries with them must be sealed.
pub const INTERNAL_REASONS: &[&str] = &[
    "lucky_gift",
    "red_packet",
    "red_packet_refund",
    "red_packet_escrow",
    "lottery",
];

/// Entry-id namespaces of the fleet's own entries (`draw:<request_id>`,
/// `redpacket:<packet>:…`, `lottery:<request_id>`).
pub const INTERNAL_ID_PREFIXES: &[&str] = &["draw:", "redpacket:", "lottery:"];

/// Seals and checks entries with the fleet's key.
#[derive(Clone)]
pub struct Sealer {
    key: Vec<u8>,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer(..)")
    }
}

impl Sealer {
    /// A sealer with `key`.
    pub fn new(key: impl Into<Vec<u8>>) -> Self {
        Self { key: key.into() }
    }

    /// The fleet's sealer: `key` (`LEDGER_SEAL_KEY`), or the key kept in
    /// Redis under `prefix` (created by the first worker that asks).
    pub async fn load<C: ConnectionLike + Send>(
        conn: &mut C,
        prefix: &str,
        key: Option<&str>,
    ) -> Result<Self, redis::RedisError> {
        if let Some(key) = key.filter(|k| !k.is_empty()) {
            return Ok(Self::new(key));
        }
        let mut fresh = [0u8; 32];
        rand::rng().fill_bytes(&mut fresh);
        let fresh: String = fresh.iter().map(|b| format!("{b:02x}")).collect();
        let key_name = format!("{prefix}:ledger-seal-key");
        let previous: Option<String> = redis::cmd("SET")
            .arg(&key_name)
            .arg(&fresh)
            .arg("NX")
            .arg("GET")
            .query_async(conn)
            .await?;
        Ok(Self::new(previous.unwrap_or(fresh)))
    }

    fn mac(&self, entry: &SettleRequest) -> Hmac<Sha256> {
        // Any key length is accepted by HMAC.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        for field in [
            entry.entry_id.as_bytes(),
            entry.account.to_string().as_bytes(),
            entry.asset.as_bytes(),
            entry.amount.to_string().as_bytes(),
            entry.reason.as_bytes(),
        ] {
            mac.update(field);
            mac.update(b"\n");
        }
        mac
    }

    /// `entry` with its seal set.
    pub fn seal(&self, mut entry: SettleRequest) -> SettleRequest {
        let tag = self.mac(&entry).finalize().into_bytes();
        entry.seal = Some(tag.iter().map(|b| format!("{b:02x}")).collect());
        entry
    }

    /// Refuses an entry an upstream may not publish: an internal reason or
    /// id namespace without a matching seal.
    pub fn check(&self, entry: &SettleRequest) -> Result<(), Invalid> {
        let internal = INTERNAL_REASONS.contains(&entry.reason.as_str())
            || INTERNAL_ID_PREFIXES
                .iter()
                .any(|p| entry.entry_id.starts_with(p));
        if !internal {
            return Ok(());
        }
        let sealed = entry.seal.as_deref().and_then(|seal| {
            let bytes: Option<Vec<u8>> = (0..seal.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(seal.get(i..i + 2)?, 16).ok())
                .collect();
            bytes
        });
        match sealed {
            Some(tag) if self.mac(entry).verify_slice(&tag).is_ok() => Ok(()),
            _ => Err(Invalid::new(format!(
                "entry {:?} (reason {:?}) is the fleet's own kind of entry and carries no valid seal; upstreams publish {}",
                entry.entry_id,
                entry.reason,
                "top-ups and debits under ids of their own"
            ))),
        }
    }
}

/// The fleet's [`Sealer`], loaded on first use and kept.
#[derive(Debug, Default)]
pub struct FleetSealer {
    cell: tokio::sync::OnceCell<Sealer>,
}

impl FleetSealer {
    /// The sealer, loading it through `conn` on first use.
    pub async fn get<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        config: &crate::config::Config,
    ) -> Result<&Sealer, redis::RedisError> {
        let key = config.ledger_seal_key.as_ref().map(|k| k.0.as_str());
        self.cell
            .get_or_try_init(|| Sealer::load(conn, &config.redis_prefix, key))
            .await
    }

    /// `entries` sealed.
    pub async fn seal_all<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        config: &crate::config::Config,
        entries: Vec<SettleRequest>,
    ) -> Result<Vec<SettleRequest>, redis::RedisError> {
        if entries.is_empty() {
            return Ok(entries);
        }
        let sealer = self.get(conn, config).await?;
        Ok(entries.into_iter().map(|e| sealer.seal(e)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, reason: &str, amount: i64) -> SettleRequest {
        SettleRequest::new(id, 7, "coin", amount, reason, serde_json::json!({}))
    }

    #[test]
    fn only_sealed_entries_may_be_internal() {
        let sealer = Sealer::new("k");
        // Upstream top-ups and debits need no seal.
        assert!(sealer.check(&entry("topup-1", "topup", 5)).is_ok());
        assert!(sealer.check(&entry("buy-1", "purchase", -5)).is_ok());
        // Internal reasons or ids need the fleet's seal.
        for e in [
            entry("draw:r1", "lucky_gift", 600),
            entry("x", "red_packet_refund", 600),
            entry("draw:r1", "topup", 600),
            entry("redpacket:p:grab:1", "topup", 1),
        ] {
            assert!(sealer.check(&e).is_err(), "{e:?}");
            assert!(sealer.check(&sealer.seal(e.clone())).is_ok(), "{e:?}");
            // Another key's seal, or any change of content, fails.
            assert!(Sealer::new("other").check(&sealer.seal(e.clone())).is_err());
            let mut changed = sealer.seal(e.clone());
            changed.amount += 1;
            assert!(sealer.check(&changed).is_err());
            let mut changed = sealer.seal(e);
            changed.account += 1;
            assert!(sealer.check(&changed).is_err());
        }
        let mut junk = entry("draw:r1", "lucky_gift", 600);
        junk.seal = Some("zz".into());
        assert!(sealer.check(&junk).is_err());
        junk.seal = Some("abc".into());
        assert!(sealer.check(&junk).is_err());
    }
}

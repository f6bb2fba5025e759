//! Seals on the ledger entries the fleet itself publishes.
//!
//! The settle queue takes messages from upstream services (top-ups, debits)
//! and from the workers (a draw's reward, a red packet's share or refund, a
//! lottery prize). Both arrive the same way, so the workers' entries carry a
//! seal: HMAC-SHA256 over the entry's id, account, asset, amount and reason,
//! keyed with a secret upstreams never see. The settle worker applies an
//! entry with a sealed reason ([`super::reasons`]) only when its seal
//! matches, and refuses any unsealed entry whose id lies in an internal
//! namespace ([`INTERNAL_ID_PREFIXES`]), so an upstream can neither forge a
//! reward nor squat the id a real reward will use.
//!
//! The same key seals the fleet's `draw.completed` records
//! ([`Sealer::seal_record`]): HMAC-SHA256 over a domain tag and the record's
//! canonical bytes, so the audit trail can tell a draw the fleet made from
//! one somebody published on the events exchange without asking Redis
//! (`docs/fairness.md`, "The audit trail"). The tag keeps the two kinds of
//! seal apart: a ledger seal's message has five raw newlines and a decimal
//! account where a record's has JSON, which never holds a raw newline.
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

/// Entry-id namespaces of the fleet's own entries (`draw:<request_id>`,
/// `redpacket:<packet>:…`, `lottery:<request_id>`).
pub const INTERNAL_ID_PREFIXES: &[&str] = &["draw:", "redpacket:", "lottery:"];

/// What a draw record's seal covers before the record's bytes: names the
/// message, so a record seal can never pass as a ledger seal or the other
/// way round.
const RECORD_TAG: &[u8] = b"prizepool/draw.completed/v1\n";

/// Seals and checks entries with the fleet's key.
#[derive(Clone)]
pub struct Sealer {
    /// HMAC-SHA256 already keyed: cloning it skips hashing the key's pads
    /// again for every seal made or checked (two of the four SHA-256 blocks
    /// a short message costs).
    keyed: Hmac<Sha256>,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer(..)")
    }
}

impl Sealer {
    /// A sealer with `key`.
    pub fn new(key: impl AsRef<[u8]>) -> Self {
        // Any key length is accepted by HMAC.
        let keyed = <Hmac<Sha256> as Mac>::new_from_slice(key.as_ref())
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        Self { keyed }
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

    fn keyed(&self) -> Hmac<Sha256> {
        self.keyed.clone()
    }

    fn mac(&self, entry: &SettleRequest) -> Hmac<Sha256> {
        let mut mac = self.keyed();
        // The numbers in decimal, written into a buffer on the stack: the
        // settle worker checks every entry it takes.
        let mut account = Decimal::default();
        let mut amount = Decimal::default();
        for field in [
            entry.entry_id.as_bytes(),
            account.of(entry.account),
            entry.asset.as_bytes(),
            amount.of(entry.amount),
            entry.reason.as_bytes(),
        ] {
            mac.update(field);
            mac.update(b"\n");
        }
        mac
    }

    /// `entry` with its seal set.
    pub fn seal(&self, mut entry: SettleRequest) -> SettleRequest {
        entry.seal = Some(to_hex(&self.mac(&entry).finalize().into_bytes()));
        entry
    }

    fn record_mac(&self, record: &[u8]) -> Hmac<Sha256> {
        let mut mac = self.keyed();
        mac.update(RECORD_TAG);
        mac.update(record);
        mac
    }

    /// The seal of a draw record whose canonical bytes are `record` (the
    /// `DrawResult` as `serde_json::to_vec` writes it): 64 hex digits.
    pub fn seal_record(&self, record: &[u8]) -> String {
        to_hex(&self.record_mac(record).finalize().into_bytes())
    }

    /// Whether `seal` is this key's seal of `record` (compared in constant
    /// time).
    pub fn check_record(&self, record: &[u8], seal: &str) -> bool {
        from_hex(seal).is_some_and(|tag| self.record_mac(record).verify_slice(&tag).is_ok())
    }

    /// Refuses an entry an upstream may not publish: an internal reason or
    /// id namespace without a matching seal.
    pub fn check(&self, entry: &SettleRequest) -> Result<(), Invalid> {
        let internal = super::reasons::is_sealed(&entry.reason)
            || INTERNAL_ID_PREFIXES
                .iter()
                .any(|p| entry.entry_id.starts_with(p));
        if !internal {
            return Ok(());
        }
        match entry.seal.as_deref().and_then(from_hex) {
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

/// A stack buffer for an `i64` in decimal (at most 20 bytes: `-` and 19
/// digits), the same text `to_string` writes.
#[derive(Default)]
struct Decimal([u8; 20]);

impl Decimal {
    fn of(&mut self, n: i64) -> &[u8] {
        let mut at = self.0.len();
        let mut rest = n.unsigned_abs();
        loop {
            at -= 1;
            // `rest % 10` is a digit.
            self.0[at] = b'0' + (rest % 10) as u8;
            rest /= 10;
            if rest == 0 {
                break;
            }
        }
        if n < 0 {
            at -= 1;
            self.0[at] = b'-';
        }
        &self.0[at..]
    }
}

/// Lowercase hex of `bytes`.
fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

/// The bytes of hex text (either case); `None` for anything else.
fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            let pair = text.get(i..i + 2)?;
            // `from_str_radix` takes a leading sign; a seal never has one.
            if !pair.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            u8::from_str_radix(pair, 16).ok()
        })
        .collect()
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

    /// The sealer without waiting, for code that cannot await (building a
    /// draw's `draw.completed` event): the one loaded already, else the one
    /// `LEDGER_SEAL_KEY` names, else the key kept in Redis, read once per
    /// process on a thread of its own (see [`load_blocking`]). `None` only
    /// when Redis could not give the key; the caller's message then goes
    /// unsealed, and the audit refuses it.
    pub fn ready(&self, config: &crate::config::Config) -> Option<&Sealer> {
        if let Some(sealer) = self.cell.get() {
            return Some(sealer);
        }
        let loaded = match config.ledger_seal_key.as_ref().filter(|k| !k.0.is_empty()) {
            Some(key) => Sealer::new(key.0.as_str()),
            None => match load_blocking(config) {
                Ok(sealer) => sealer,
                Err(e) => {
                    tracing::error!(
                        error = format!("{e:#}"),
                        "the seal key could not be read from Redis; this message goes unsealed"
                    );
                    return None;
                }
            },
        };
        // Another caller may have set it meanwhile: the same key either way.
        let _ = self.cell.set(loaded);
        self.cell.get()
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

/// Reads the fleet's key kept in Redis from synchronous code, once per
/// process: on a thread of its own with its own runtime and connection, so
/// it neither needs nor blocks on the caller's runtime (which may be a
/// current-thread one, whose connections a nested `block_on` would starve).
/// The caller's thread waits for one Redis round trip (at most the
/// connection's 5 s timeouts).
fn load_blocking(config: &crate::config::Config) -> anyhow::Result<Sealer> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(async {
                    let mut conn = crate::redis_conn::connect(&config.redis_url).await?;
                    anyhow::Ok(Sealer::load(&mut conn, &config.redis_prefix, None).await?)
                })
            })
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("reading the seal key panicked")))
    })
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

    #[test]
    fn record_seals_cover_every_byte_and_only_this_key() {
        let sealer = Sealer::new("k");
        let record = br#"{"request_id":"r1","status":"ok","serial":7}"#;
        let seal = sealer.seal_record(record);
        assert_eq!(seal.len(), 64);
        assert!(sealer.check_record(record, &seal));
        assert!(sealer.check_record(record, &seal.to_uppercase()));
        assert!(!Sealer::new("other").check_record(record, &seal));
        assert!(!sealer.check_record(br#"{"request_id":"r1","status":"ok","serial":8}"#, &seal));
        for junk in [
            "",
            "zz",
            &seal[..62],
            &format!("{seal}00"),
            &format!("+{}", &seal[1..]),
        ] {
            assert!(!sealer.check_record(record, junk), "{junk:?}");
        }
        // A ledger seal is no record seal, even over the same text.
        let entry = sealer.seal(entry("draw:r1", "lucky_gift", 600));
        let fields = b"draw:r1\n7\ncoin\n600\nlucky_gift\n";
        assert!(!sealer.check_record(fields, entry.seal.as_deref().unwrap_or_default()));
        assert_eq!(to_hex(&[0, 0x0f, 0xa5, 0xff]), "000fa5ff");
        for n in [0, 7, -7, 10, 600, -1_000_000, i64::MAX, i64::MIN] {
            assert_eq!(Decimal::default().of(n), n.to_string().as_bytes());
        }
        assert_eq!(from_hex("000fA5ff"), Some(vec![0, 0x0f, 0xa5, 0xff]));
    }
}

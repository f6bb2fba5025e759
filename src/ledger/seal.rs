//! Seals on the ledger entries the fleet itself publishes.
//!
//! The settle queue takes messages from upstream services (top-ups, debits)
//! and from the workers (a draw's reward, a red packet's share or refund, a
//! lottery prize). Both arrive the same way, so the workers' entries carry a
//! seal: HMAC-SHA256 over the entry's id, account, asset, amount and reason,
//! keyed with a secret upstreams never see. The settle worker applies an
//! entry with a sealed reason ([`super::reasons`]) only when its seal
//! matches, and refuses any unsealed entry whose id lies in an internal
//! namespace ([`is_internal_id`]), so an upstream can neither forge a
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

/// Whether `entry_id` lies in the namespace of an entry a prize kind books
/// (`draw:…`, `redpacket:…`, `lottery:…`): each kind declares the namespace
/// with its reasons (`kinds/<kind>/reasons.rs`), so a new kind's ids are
/// sealed by being declared.
pub fn is_internal_id(entry_id: &str) -> bool {
    super::reasons::reasons().any(|r| r.names(entry_id))
}

/// What a draw record's seal covers before the record's bytes: names the
/// message, so a record seal can never pass as a ledger seal or the other
/// way round.
const RECORD_TAG: &[u8] = b"prizepool/draw.completed/v1\n";

/// What a batch record's seal (`pool.refilled`) covers before the record's
/// bytes: a batch seal passes neither as a draw seal nor as a ledger seal.
const BATCH_TAG: &[u8] = b"prizepool/pool.refilled/v1\n";

/// Seals and checks entries with the fleet's key.
#[derive(Clone)]
pub struct Sealer {
    /// HMAC-SHA256 already keyed: cloning it skips hashing the key's pads
    /// again for every seal made or checked (two of the four SHA-256 blocks
    /// a short message costs).
    keyed: Hmac<Sha256>,
    /// The key itself, to put it back in Redis if Redis lost it.
    key: Vec<u8>,
    /// The fleet's earlier keys ([`KEY_RING`]): what they sealed still
    /// checks, so entries sealed just before the key changed, and their
    /// dead letters, are not forgeries. Seals are made with `keyed` only.
    earlier: Vec<Hmac<Sha256>>,
}

/// The suffix of the Redis set of every key the fleet has sealed with
/// (`<prefix>:ledger-seal-key:ring`), next to the current key
/// (`<prefix>:ledger-seal-key`).
pub const KEY_RING: &str = ":ring";

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer(..)")
    }
}

impl Sealer {
    /// A sealer with `key`.
    pub fn new(key: impl AsRef<[u8]>) -> Self {
        Self {
            keyed: hmac_of(key.as_ref()),
            key: key.as_ref().to_vec(),
            earlier: Vec::new(),
        }
    }

    /// The fleet's sealer: `key` (`LEDGER_SEAL_KEY`), or the key kept in
    /// Redis under `prefix` (created by the first worker that asks).
    pub async fn load<C: ConnectionLike + Send>(
        conn: &mut C,
        prefix: &str,
        key: Option<&str>,
    ) -> Result<Self, redis::RedisError> {
        match key.filter(|k| !k.is_empty()) {
            Some(key) => Ok(Self::new(key)),
            None => Self::kept(conn, prefix, None).await,
        }
    }

    /// The key kept in Redis under `prefix`, with the fleet's earlier keys.
    /// When Redis holds none (the first worker, or a Redis that lost it),
    /// `keep` is put there (the key this process sealed with until now,
    /// so the fleet goes on with it), else a fresh random key. `keep` is
    /// added to the ring of earlier keys in any case: if another process
    /// put a key of its own first, what this process sealed still checks.
    pub(super) async fn kept<C: ConnectionLike + Send>(
        conn: &mut C,
        prefix: &str,
        keep: Option<&[u8]>,
    ) -> Result<Self, redis::RedisError> {
        let candidate = match keep {
            Some(key) => key.to_vec(),
            None => {
                let mut fresh = [0u8; 32];
                rand::rng().fill_bytes(&mut fresh);
                to_hex(&fresh).into_bytes()
            }
        };
        let key_name = format!("{prefix}:ledger-seal-key");
        let previous: Option<Vec<u8>> = redis::cmd("SET")
            .arg(&key_name)
            .arg(&candidate)
            .arg("NX")
            .arg("GET")
            .query_async(conn)
            .await?;
        let current = previous.unwrap_or_else(|| candidate.clone());
        let ring = format!("{key_name}{KEY_RING}");
        let mut add = redis::cmd("SADD");
        add.arg(&ring).arg(&current);
        if let Some(keep) = keep {
            add.arg(keep);
        }
        add.query_async::<()>(conn).await?;
        let all: Vec<Vec<u8>> = redis::cmd("SMEMBERS").arg(&ring).query_async(conn).await?;
        let mut sealer = Self::new(&current);
        sealer.earlier = all
            .iter()
            .filter(|k| **k != current)
            .map(|k| hmac_of(k))
            .collect();
        Ok(sealer)
    }

    /// The key this sealer seals with.
    pub(super) fn key(&self) -> &[u8] {
        &self.key
    }

    /// Whether this sealer seals with the same key as `other`.
    pub fn same_key(&self, other: &Sealer) -> bool {
        self.key == other.key
    }

    fn keyed(&self) -> Hmac<Sha256> {
        self.keyed.clone()
    }

    /// Whether `seal` (hex) is the tag `mac` computes with the current key
    /// or one of the earlier ones.
    fn verifies(&self, seal: &str, mac: impl Fn(Hmac<Sha256>) -> Hmac<Sha256>) -> bool {
        let Some(tag) = from_hex(seal) else {
            return false;
        };
        std::iter::once(&self.keyed)
            .chain(&self.earlier)
            .any(|keyed| mac(keyed.clone()).verify_slice(&tag).is_ok())
    }

    fn mac(&self, entry: &SettleRequest) -> Hmac<Sha256> {
        entry_mac(self.keyed(), entry)
    }
}

/// HMAC-SHA256 keyed with `key`.
fn hmac_of(key: &[u8]) -> Hmac<Sha256> {
    // Any key length is accepted by HMAC.
    <Hmac<Sha256> as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"))
}

/// `mac` over a ledger entry's sealed fields.
fn entry_mac(mut mac: Hmac<Sha256>, entry: &SettleRequest) -> Hmac<Sha256> {
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

impl Sealer {
    /// `entry` with its seal set.
    pub fn seal(&self, mut entry: SettleRequest) -> SettleRequest {
        entry.seal = Some(to_hex(&self.mac(&entry).finalize().into_bytes()));
        entry
    }

    fn record_mac(&self, record: &[u8]) -> Hmac<Sha256> {
        self.tagged_mac(RECORD_TAG, record)
    }

    fn tagged_mac(&self, tag: &[u8], record: &[u8]) -> Hmac<Sha256> {
        tagged(self.keyed(), tag, record)
    }

    /// The seal of a batch record (a `pool.refilled` event) whose canonical
    /// bytes are `record` (its `PoolRefilled`, as `serde_json::to_vec`
    /// writes it): 64 hex digits.
    pub fn seal_batch(&self, record: &[u8]) -> String {
        to_hex(&self.tagged_mac(BATCH_TAG, record).finalize().into_bytes())
    }

    /// Whether `seal` is this key's seal of the batch record `record`.
    pub fn check_batch(&self, record: &[u8], seal: &str) -> bool {
        self.verifies(seal, |keyed| tagged(keyed, BATCH_TAG, record))
    }

    /// The seal of a draw record whose canonical bytes are `record` (the
    /// `DrawResult` as `serde_json::to_vec` writes it): 64 hex digits.
    pub fn seal_record(&self, record: &[u8]) -> String {
        to_hex(&self.record_mac(record).finalize().into_bytes())
    }

    /// Whether `seal` is this key's seal of `record` (compared in constant
    /// time).
    pub fn check_record(&self, record: &[u8], seal: &str) -> bool {
        self.verifies(seal, |keyed| tagged(keyed, RECORD_TAG, record))
    }

    /// Refuses an entry an upstream may not publish: an internal reason or
    /// id namespace without a matching seal.
    pub fn check(&self, entry: &SettleRequest) -> Result<(), Invalid> {
        let internal = super::reasons::is_sealed(&entry.reason) || is_internal_id(&entry.entry_id);
        if !internal {
            return Ok(());
        }
        match entry.seal.as_deref() {
            Some(seal) if self.verifies(seal, |keyed| entry_mac(keyed, entry)) => Ok(()),
            _ => Err(Invalid::new(format!(
                "entry {:?} (reason {:?}) is the fleet's own kind of entry and carries no valid seal; upstreams publish {}",
                entry.entry_id,
                entry.reason,
                "top-ups and debits under ids of their own"
            ))),
        }
    }
}

/// `mac` over a tagged record.
fn tagged(mut mac: Hmac<Sha256>, tag: &[u8], record: &[u8]) -> Hmac<Sha256> {
    mac.update(tag);
    mac.update(record);
    mac
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

    /// The namespaces come from the kinds' declared reasons: every
    /// registered kind books under one, each is sealed for every reason
    /// (an unsealed top-up cannot take such an id first), and ids merely
    /// starting with the same letters are an upstream's.
    #[test]
    fn every_kinds_entry_ids_are_sealed_whatever_the_reason() {
        let sealer = Sealer::new("k");
        let kinds: Vec<&str> = crate::kinds::KINDS.iter().map(|k| k.label()).collect();
        let mut namespaces = Vec::new();
        for reason in super::super::reasons::reasons() {
            match reason.owner {
                crate::ledger::reasons::Owner::Upstream => {
                    assert_eq!(reason.id_namespace, "", "{reason:?}")
                }
                crate::ledger::reasons::Owner::Kind(kind) => {
                    assert!(kinds.contains(&kind), "{reason:?}");
                    let ns = reason.id_namespace;
                    assert!(!ns.is_empty() && !ns.contains(':'), "{reason:?}");
                    namespaces.push(ns);
                }
            }
        }
        for kind in &kinds {
            assert!(
                super::super::reasons::of_kind(kind).all(|r| !r.id_namespace.is_empty()),
                "{kind} books entries under no namespace"
            );
        }
        namespaces.dedup();
        assert_eq!(namespaces, ["draw", "redpacket", "lottery"]);
        for ns in namespaces {
            for id in [
                format!("{ns}:p:r1:1"),
                format!("{ns}:"),
                format!("{ns}:{{}}:x"),
            ] {
                assert!(is_internal_id(&id), "{id}");
                for reason in ["topup", "withdrawal", "purchase"] {
                    let amount = if reason == "topup" { 5 } else { -5 };
                    assert!(
                        sealer.check(&entry(&id, reason, amount)).is_err(),
                        "{id} {reason}"
                    );
                }
            }
            for id in [ns.to_string(), format!("{ns}-1:x"), format!("my{ns}:x")] {
                assert!(!is_internal_id(&id), "{id}");
                assert!(sealer.check(&entry(&id, "topup", 5)).is_ok(), "{id}");
            }
        }
        // The ids the kinds build lie in their namespaces.
        assert!(is_internal_id(&crate::kinds::answer::entry_id(
            crate::kinds::lucky_gift::reasons::ENTRY_IDS,
            "gift-1",
            "r",
            7
        )));
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
        // A draw seal is no batch seal, and the other way round.
        assert!(!sealer.check_batch(record, &seal));
        let batch = sealer.seal_batch(record);
        assert!(sealer.check_batch(record, &batch));
        assert!(!sealer.check_record(record, &batch));
        assert!(!Sealer::new("other").check_batch(record, &batch));
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

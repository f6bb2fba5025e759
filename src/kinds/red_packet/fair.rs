//! Provably fair red packets: a packet commits to its split when it is
//! created and reveals it when it closes, so anyone can check that the
//! shares users were paid are the ones fixed before the first grab.
//!
//! At creation a fresh 16-byte salt is drawn from the thread's CSPRNG and
//! the packet stores, and its create answers,
//!
//! ```text
//! commitment = hex(SHA-256("prizepool-redpacket-v1\n" ‖ packet_id ‖ "\n" ‖ hex(salt) ‖ "\n" ‖ shares))
//! ```
//!
//! where `shares` is the split in share order, decimal amounts joined by
//! `,`. The salt keeps the split unguessable from the commitment (a packet
//! of few shares has few possible splits). The `redpacket.closed` event
//! reveals `salt` and `shares`; [`verify`] recomputes the commitment and
//! checks every grab the ledger paid against the share it names, and the
//! refund against what no grab took (`docs/fairness.md`).

use sha2::{Digest, Sha256};
use sqlx::PgPool;

/// The commitment of `packet_id` to `shares` under `salt` (hex).
pub fn commitment(packet_id: &str, salt: &str, shares: &[i64]) -> String {
    let list: Vec<String> = shares.iter().map(i64::to_string).collect();
    let mut hash = Sha256::new();
    hash.update(b"prizepool-redpacket-v1\n");
    hash.update(packet_id.as_bytes());
    hash.update(b"\n");
    hash.update(salt.as_bytes());
    hash.update(b"\n");
    hash.update(list.join(",").as_bytes());
    hex(&hash.finalize())
}

/// A fresh salt: 16 bytes of the thread's CSPRNG, in hex.
pub fn new_salt() -> String {
    let bytes: [u8; 16] = rand::Rng::random(&mut rand::rng());
    hex(&bytes)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What a closed packet reveals.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reveal {
    pub salt: String,
    pub shares: Vec<i64>,
}

/// The reveal of packet `packet_id`: its salt and shares, once it is
/// closed; `None` while it is open or if it has no commitment.
pub async fn reveal(db: &PgPool, packet_id: &str) -> Result<Option<Reveal>, sqlx::Error> {
    let salt: Option<(Option<String>,)> =
        sqlx::query_as("SELECT salt FROM red_packets WHERE id = $1 AND closed_at IS NOT NULL")
            .bind(packet_id)
            .fetch_optional(db)
            .await?;
    let Some((Some(salt),)) = salt else {
        return Ok(None);
    };
    Ok(Some(Reveal {
        salt,
        shares: shares(db, packet_id).await?,
    }))
}

async fn shares(db: &PgPool, packet_id: &str) -> Result<Vec<i64>, sqlx::Error> {
    let rows: Vec<(i64,)> = sqlx::query_as(
        "SELECT amount FROM red_packet_shares WHERE packet_id = $1 ORDER BY share_no",
    )
    .bind(packet_id)
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(|(a,)| a).collect())
}

/// The verdict on one packet.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Verdict {
    pub packet_id: String,
    /// Every check held.
    pub ok: bool,
    pub commitment: Option<String>,
    /// Grabs the ledger paid, checked against their shares.
    pub grabs: usize,
    /// The first check that failed, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mismatch: Option<String>,
}

/// Checks a closed packet: its revealed split hashes to its commitment and
/// sums to its total; every grab entry in the ledger pays exactly the
/// share it names, no share twice; the refund is what no grab took.
pub async fn verify(db: &PgPool, packet_id: &str) -> Result<Verdict, sqlx::Error> {
    type Row = (i64, Option<String>, Option<String>, Option<i64>, bool);
    let row: Option<Row> = sqlx::query_as(
        "SELECT total, salt, commitment, refunded, closed_at IS NOT NULL FROM red_packets WHERE id = $1",
    )
    .bind(packet_id)
    .fetch_optional(db)
    .await?;
    let mut verdict = Verdict {
        packet_id: packet_id.to_owned(),
        ok: false,
        commitment: None,
        grabs: 0,
        mismatch: None,
    };
    let fail = |mut v: Verdict, why: String| {
        v.mismatch = Some(why);
        Ok(v)
    };
    let Some((total, salt, committed, refunded, closed)) = row else {
        return fail(verdict, format!("no red packet named {packet_id}"));
    };
    verdict.commitment = committed.clone();
    let (Some(salt), Some(committed)) = (salt, committed) else {
        return fail(
            verdict,
            "the packet was created before packets committed to their split".into(),
        );
    };
    if !closed {
        return fail(
            verdict,
            "the packet is open: its split is revealed when it closes".into(),
        );
    }
    let shares = shares(db, packet_id).await?;
    if commitment(packet_id, &salt, &shares) != committed {
        return fail(
            verdict,
            "the stored split does not hash to the commitment".into(),
        );
    }
    if shares.iter().sum::<i64>() != total {
        return fail(
            verdict,
            format!("the shares do not sum to the total {total}"),
        );
    }
    // Only the fleet's sealed entries carry the reason `red_packet`.
    let grabs: Vec<(String, i64, Option<i64>)> = sqlx::query_as(
        "SELECT entry_id, amount, (ref->>'share')::bigint FROM ledger_entries WHERE ref->>'pool' = $1 AND reason = 'red_packet' ORDER BY entry_id",
    )
    .bind(packet_id)
    .fetch_all(db)
    .await?;
    let paid = match paid_by(&shares, &grabs) {
        Ok(paid) => paid,
        Err(why) => return fail(verdict, why),
    };
    verdict.grabs = grabs.len();
    if refunded != Some(total - paid) {
        return fail(
            verdict,
            format!(
                "the refund {refunded:?} is not the {} no grab took",
                total - paid
            ),
        );
    }
    verdict.ok = true;
    Ok(verdict)
}

/// What the grab entries `grabs` (entry id, amount, share number) paid in
/// all, each paying exactly the share of `shares` it names and no share
/// paid twice; or the first grab that does not, in words.
fn paid_by(shares: &[i64], grabs: &[(String, i64, Option<i64>)]) -> Result<i64, String> {
    let mut taken = vec![false; shares.len()];
    let mut paid = 0i64;
    for (entry_id, amount, share) in grabs {
        let Some(no) = share
            .and_then(|s| usize::try_from(s).ok())
            .filter(|s| *s >= 1)
        else {
            return Err(format!("grab {entry_id} names no share"));
        };
        match shares.get(no - 1) {
            Some(want) if want == amount => {}
            Some(want) => {
                return Err(format!(
                    "grab {entry_id} paid {amount} for share {no} of {want}"
                ))
            }
            None => {
                return Err(format!(
                    "grab {entry_id} names share {no}, which the split has not"
                ))
            }
        }
        if std::mem::replace(&mut taken[no - 1], true) {
            return Err(format!("share {no} was paid twice (again by {entry_id})"));
        }
        paid += amount;
    }
    Ok(paid)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test vector of docs/fairness.md.
    #[test]
    fn the_documented_test_vector_holds() {
        assert_eq!(
            commitment("rp-1", "000102030405060708090a0b0c0d0e0f", &[120, 380, 500]),
            "f74a019abd784d5c06fe04a70d495968b141815290aa1049026c8e721cbe3a9a"
        );
    }

    #[test]
    fn salts_are_fresh_and_sixteen_bytes() {
        let (a, b) = (new_salt(), new_salt());
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
    }
}

//! Provably fair red packets (docs/fairness.md, "Red packets"): a packet
//! commits to its split when it is created, the close reveals the split and
//! its salt, and anyone can check the shares paid against the commitment.
//! The checks here are written from the documented scheme, not from the
//! code: the commitment is recomputed with SHA-256 directly.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{draw, TestEnv};
use futures_util::StreamExt;
use prizepool::kinds::red_packet;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const T: Duration = Duration::from_secs(30);

/// The commitment as docs/fairness.md defines it.
fn documented_commitment(packet: &str, salt: &str, shares: &[i64]) -> String {
    let list: Vec<String> = shares.iter().map(ToString::to_string).collect();
    let text = format!(
        "prizepool-redpacket-v1\n{packet}\n{salt}\n{}",
        list.join(",")
    );
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn verdict(env: &TestEnv, packet: &str) -> red_packet::fair::Verdict {
    red_packet::fair::verify(&env.db, packet).await.unwrap()
}

#[tokio::test]
async fn a_packet_commits_to_its_split_and_its_close_reveals_what_was_paid() {
    let mut env = TestEnv::new(&[]).await;
    env.start_fleet().await;
    let (_conn, mut closes) = env.listen(red_packet::CLOSED_EVENT).await;
    let client = env.client().await;
    env.fund(3, 50_000).await;
    let created = client
        .call(
            "refill",
            &json!({"type": "redpacket.create", "packet_id": "rp-fair", "sender": 3,
                    "total": 20_000, "count": 8, "min": 100, "expires_in_s": 2}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(created["status"], "ok", "{created}");
    let commitment = created["commitment"].as_str().unwrap().to_owned();
    assert_eq!(commitment.len(), 64);
    // The create sent again answers the same commitment.
    let again = client
        .call(
            "refill",
            &json!({"type": "redpacket.create", "packet_id": "rp-fair", "sender": 3,
                    "total": 20_000, "count": 8, "min": 100, "expires_in_s": 2}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(again["commitment"], created["commitment"]);
    // Before the close nothing is revealed, and the verifier says so.
    let open = verdict(&env, "rp-fair").await;
    assert!(!open.ok && open.mismatch.unwrap().contains("open"));

    let mut paid = Vec::new();
    for user in 100..105 {
        let r = client
            .call("draw", &draw("rp-fair", user, 1), T)
            .await
            .unwrap();
        assert_eq!(r["status"], "ok", "{r}");
        paid.push(r["reward"].as_i64().unwrap());
    }
    let delivery = tokio::time::timeout(T, closes.next())
        .await
        .expect("no redpacket.closed event")
        .unwrap()
        .unwrap();
    let closed: Value = serde_json::from_slice(&delivery.data).unwrap();
    assert_eq!(closed["packet_id"], "rp-fair");
    let salt = closed["salt"].as_str().unwrap();
    let shares: Vec<i64> = closed["shares"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_i64().unwrap())
        .collect();
    // What was committed before the first grab is what the close reveals.
    assert_eq!(documented_commitment("rp-fair", salt, &shares), commitment);
    assert_eq!(shares.len(), 8);
    assert_eq!(shares.iter().sum::<i64>(), 20_000);
    // Every grab was paid one of the committed shares, none twice.
    let mut left = shares.clone();
    for amount in &paid {
        let at = left.iter().position(|s| s == amount).unwrap();
        left.remove(at);
    }
    assert_eq!(
        closed["refunded"].as_i64().unwrap(),
        left.iter().sum::<i64>()
    );

    // The verifier agrees once the ledger holds the grabs.
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let v = verdict(&env, "rp-fair").await;
        if v.ok {
            assert_eq!(v.grabs, 5);
            assert_eq!(v.commitment.as_deref(), Some(commitment.as_str()));
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{v:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Tampering is caught: two shares swapped in the stored split ...
    sqlx::query(
        "UPDATE red_packet_shares SET amount = CASE share_no WHEN 1 THEN $2 ELSE $1 END WHERE packet_id = 'rp-fair' AND share_no IN (1, 2)",
    )
    .bind(shares[0])
    .bind(shares[1])
    .execute(&env.db)
    .await
    .unwrap();
    if shares[0] != shares[1] {
        let v = verdict(&env, "rp-fair").await;
        assert!(!v.ok);
        assert!(v.mismatch.unwrap().contains("commitment"));
    }
    sqlx::query(
        "UPDATE red_packet_shares SET amount = CASE share_no WHEN 1 THEN $1 ELSE $2 END WHERE packet_id = 'rp-fair' AND share_no IN (1, 2)",
    )
    .bind(shares[0])
    .bind(shares[1])
    .execute(&env.db)
    .await
    .unwrap();
    assert!(verdict(&env, "rp-fair").await.ok);
    // ... and a grab paid more than its share.
    sqlx::query(
        "UPDATE ledger_entries SET amount = amount + 1 WHERE entry_id = 'redpacket:rp-fair:grab:100'",
    )
    .execute(&env.db)
    .await
    .unwrap();
    let v = verdict(&env, "rp-fair").await;
    assert!(!v.ok);
    let why = v.mismatch.unwrap();
    assert!(why.contains("redpacket:rp-fair:grab:100"), "{why}");
    env.stop_workers().await;
}

#[tokio::test]
async fn the_verifier_refuses_what_it_cannot_check() {
    let env = TestEnv::new(&[]).await;
    let v = verdict(&env, "no-such-packet").await;
    assert!(!v.ok);
    assert!(v.mismatch.unwrap().contains("no red packet"));
}

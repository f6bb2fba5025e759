//! What docs/upstream.md promises an upstream team: a balance read with
//! plain SQL through the `account_balances` view, which nobody can write
//! through, and replies shown on the page that fit their published schemas.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{raw::Raw, TestEnv};
use prizepool::messages::schema;
use serde_json::{json, Value};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The balances of `account` as another language reads them: plain SQL on
/// the view, by account and asset.
async fn view(env: &TestEnv, account: i64) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT asset, balance FROM account_balances WHERE account = $1 ORDER BY asset")
        .bind(account)
        .fetch_all(&env.db)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_balance_reads_through_the_account_balances_view_which_nobody_can_write() {
    let mut env = TestEnv::new(&[]).await;
    env.start_settle_worker().await;
    env.start_refill_worker().await;
    let raw = Raw::new(&env).await;
    // A top-up over the wire, then a red packet that escrows part of it.
    let topup = json!({"type": "settle", "entry_id": "topup:77:1", "account": 77,
        "asset": "coin", "amount": 5_000, "reason": "topup"});
    raw.publish(
        "settle",
        &serde_json::to_vec(&topup).unwrap(),
        raw.props("t"),
    )
    .await;
    assert_eq!(raw.reply("t").await["status"], "ok");
    let gem = json!({"type": "settle", "entry_id": "topup:77:2", "account": 77,
        "asset": "gem", "amount": 3, "reason": "topup"});
    raw.publish("settle", &serde_json::to_vec(&gem).unwrap(), raw.props("g"))
        .await;
    assert_eq!(raw.reply("g").await["status"], "ok");
    let create = json!({"type": "redpacket.create", "packet_id": "rp-77", "sender": 77,
        "total": 1_200, "count": 3, "expires_in_s": 3600});
    raw.publish(
        "refill",
        &serde_json::to_vec(&create).unwrap(),
        raw.props("c"),
    )
    .await;
    assert_eq!(raw.reply("c").await["status"], "ok");
    let want = vec![("coin".to_owned(), 3_800), ("gem".to_owned(), 3)];
    assert_eq!(view(&env, 77).await, want);
    // The same as the ledger's own reading, which `prizepool balance` shows.
    let ledger: Vec<(String, i64)> = prizepool::settle::balances(&env.db, 77)
        .await
        .unwrap()
        .into_iter()
        .map(|b| (b.asset, b.balance))
        .collect();
    assert_eq!(ledger, want);
    // An account that never moved has no row: it holds nothing.
    assert!(view(&env, 78).await.is_empty());
    // Nothing writes through the view, not even a superuser.
    for write in [
        "INSERT INTO account_balances (account, asset, balance) VALUES (77, 'coin', 1)",
        "UPDATE account_balances SET balance = 1 WHERE account = 77",
        "DELETE FROM account_balances WHERE account = 77",
    ] {
        let e = sqlx::query(write).execute(&env.db).await.unwrap_err();
        assert!(e.to_string().contains("view"), "{write}: {e}");
    }
    assert_eq!(view(&env, 77).await, want);
    raw.close().await;
    env.stop_workers().await;
}

/// Every JSON line of the page's code blocks that has a `type`.
fn page_messages(page: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(format!("{ROOT}/{page}")).unwrap();
    let mut out = Vec::new();
    let mut in_json = false;
    for line in text.lines() {
        match line.trim() {
            "```json" => in_json = true,
            "```" => in_json = false,
            l if in_json && l.starts_with('{') => {
                let v: Value = serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("{page}: not one JSON object a line: {l}: {e}"));
                out.push(v);
            }
            _ => {}
        }
    }
    out
}

#[test]
fn the_messages_on_the_upstream_page_fit_their_schemas() {
    let replies: Vec<&str> = schema::messages()
        .into_iter()
        .filter(|m| m.role == schema::Role::Reply)
        .map(|m| m.name)
        .collect();
    // The requests on the page include bad input; its replies must all fit.
    let messages: Vec<Value> = page_messages("docs/upstream.md")
        .into_iter()
        .filter(|m| replies.contains(&m["type"].as_str().unwrap_or_default()))
        .collect();
    assert!(messages.len() >= 25, "{} replies", messages.len());
    let mut problems = Vec::new();
    for m in &messages {
        for v in crate::reply_schemas::violations(m) {
            problems.push(format!("{v}\n  {m}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

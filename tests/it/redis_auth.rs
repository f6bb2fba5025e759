//! The fleet against a Redis of the test's own that knows one ACL user and
//! refuses everyone else: the credentials in `REDIS_URL` are all the
//! workers need, and the draw is answered and paid.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::{Duration, Instant};

use common::{draw, free_port, pool_toml, redis_server, tempdir, TestEnv};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_works_as_an_acl_user_of_a_redis_that_refuses_everyone_else() {
    let dir = tempdir("acl");
    let port = free_port();
    let acl = [
        "--user",
        "prizepool",
        "on",
        ">s3cret-acl",
        "~*",
        "&*",
        "+@all",
        "--user",
        "default",
        "off",
    ];
    let _server = redis_server(port, &dir, &acl);
    let url = format!("redis://prizepool:s3cret-acl@127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let client = redis::Client::open(url.as_str()).unwrap();
        if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
            let pong: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
            assert_eq!(pong, "PONG");
            break;
        }
        assert!(Instant::now() < deadline, "private redis did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Without the user's credentials the server refuses.
    let anonymous = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let mut conn = anonymous.get_multiplexed_async_connection().await;
    let refused = match &mut conn {
        Ok(conn) => redis::cmd("PING")
            .query_async::<String>(conn)
            .await
            .is_err(),
        Err(_) => true,
    };
    assert!(refused, "the default user is off");

    let mut env = TestEnv::new(&[("REDIS_URL", &url)]).await;
    env.load(&pool_toml("acl", "", &[("a", &[(2, 100)])])).await;
    env.start_fleet().await;
    let client = env.client().await;
    let reply = client
        .call("draw", &draw("acl", 7, 3), Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    let reward = reply["reward"].as_i64().unwrap();
    assert!(reward > 0, "{reply}");
    assert_eq!(env.wait_ledger("acl", reward).await, reward);
    env.stop_workers().await;
    let _ = std::fs::remove_dir_all(&dir);
}

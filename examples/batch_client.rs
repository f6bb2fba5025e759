//! A plain tokio program that draws through the batching client: N
//! concurrent draws, merged into `draw.batch` messages by the client.
//!
//! ```text
//! cargo run --example batch_client -- [POOL] [DRAWS] [BATCH_SIZE] [LINGER_MS]
//! AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f cargo run --example batch_client -- gift-1001 1000 50 2
//! ```
//!
//! It needs a running fleet and a loaded pool (`prizepool pool load
//! examples/pools.toml`, then the workers).

use std::time::{Duration, Instant};

use prizepool::client::{draw_request, Client, ClientConfig};
use prizepool::messages::Status;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let pool = args.next().unwrap_or_else(|| "gift-1001".into());
    let draws: u64 = args.next().map_or(Ok(1000), |a| a.parse())?;
    let batch_size: usize = args.next().map_or(Ok(50), |a| a.parse())?;
    let linger_ms: u64 = args.next().map_or(Ok(2), |a| a.parse())?;
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());

    let client = Client::connect(
        ClientConfig::new(url)
            .connection_name("batch-client-example")
            .batch_size(batch_size)
            .linger(Duration::from_millis(linger_ms)),
    )
    .await?;

    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..draws {
        // Each task is one caller: it sees its own draw only.
        let (client, pool) = (client.clone(), pool.clone());
        tasks.spawn(async move {
            client
                .draw(draw_request(pool, 1 + (i % 1000) as i64, 1))
                .await
        });
    }
    let (mut ok, mut rejected, mut failed, mut reward) = (0u64, 0u64, 0u64, 0i64);
    while let Some(joined) = tasks.join_next().await {
        match joined? {
            Ok(result) if result.status == Status::Ok => {
                ok += 1;
                reward += result.reward.unwrap_or(0);
            }
            Ok(result) => {
                rejected += 1;
                if rejected == 1 {
                    println!("first refusal: {:?}", result.error);
                }
            }
            Err(error) => {
                failed += 1;
                if failed == 1 {
                    println!("first error: {error}");
                }
            }
        }
    }
    let elapsed = started.elapsed();
    let (messages, entries, retries, _) = client.stats().snapshot();
    println!(
        "{draws} draws in {elapsed:.2?} ({:.0}/s): {ok} ok (reward {reward}), {rejected} rejected, {failed} failed; \
         {messages} messages, {:.1} draws each, {retries} retries",
        draws as f64 / elapsed.as_secs_f64(),
        entries as f64 / messages.max(1) as f64
    );
    client.close().await;
    Ok(())
}

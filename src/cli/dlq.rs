//! `prizepool dlq`: list, export, replay and drop dead letters. Every
//! subcommand is one pass over the DLQ that leaves the messages it does not
//! take in their order ([`crate::amqp::dlq`]).

use std::{io::Write, time::Duration};

use anyhow::Context;
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::{
    amqp::{
        self,
        dlq::{self, Action, DeadLetter, Filter},
        Route,
    },
    config::Config,
};

#[derive(Debug, Subcommand)]
pub(super) enum DlqCommand {
    /// Show dead letters and why they are there, in queue order. Leaves the
    /// queue's order and content as they were.
    List {
        #[command(flatten)]
        select: Select,
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// One JSON object: the queue, the counts and the letters.
        #[arg(long)]
        json: bool,
    },
    /// Write the selected dead letters whole (body, properties, headers) as
    /// JSON lines, to stdout or a file. Moves nothing.
    Export {
        #[command(flatten)]
        select: Select,
        #[arg(long, default_value_t = usize::MAX)]
        limit: usize,
        /// Write here instead of stdout.
        #[arg(long)]
        output: Option<std::path::PathBuf>,
    },
    /// Move the selected dead letters back to their work queue (straight
    /// to the queue, through the default exchange), in queue order: at most
    /// the messages the DLQ holds when the replay starts, so messages that
    /// fail again are not replayed twice in one run.
    Replay {
        #[command(flatten)]
        select: Select,
        #[arg(long, default_value_t = usize::MAX)]
        limit: usize,
        /// Show what would move, and move nothing.
        #[arg(long)]
        dry_run: bool,
        #[arg(long)]
        json: bool,
    },
    /// Remove the selected dead letters for good (export them first if
    /// they may be wanted). Needs a filter, or `--all`.
    Drop {
        #[command(flatten)]
        select: Select,
        #[arg(long, default_value_t = usize::MAX)]
        limit: usize,
        /// Drop every dead letter of the queue (no filter needed).
        #[arg(long)]
        all: bool,
        /// Show what would be dropped, and drop nothing.
        #[arg(long)]
        dry_run: bool,
        #[arg(long)]
        json: bool,
    },
}

/// The queue and which of its dead letters a subcommand concerns.
#[derive(Debug, Args)]
pub(super) struct Select {
    /// A queue that dead-letters (`prizepool.draw`, `prizepool.refill`,
    /// `prizepool.settle`, `prizepool.audit`) or its DLQ.
    queue: String,
    /// Only messages whose error code or reason contains this text
    /// (`invalid_request`, `internal`, `delivery_limit`, …).
    #[arg(long)]
    reason: Option<String>,
    /// Only messages of this `type` (`draw`, `settle`, `draw.batch`, …).
    #[arg(long = "type")]
    message_type: Option<String>,
    /// Only messages that name this pool, packet or activity.
    #[arg(long)]
    pool: Option<String>,
    /// Only messages dead-lettered at least this long ago (`90s`, `10m`,
    /// `2h`, `3d`).
    #[arg(long, value_parser = parse_age)]
    older_than: Option<Duration>,
    /// Only messages dead-lettered less than this long ago.
    #[arg(long, value_parser = parse_age)]
    newer_than: Option<Duration>,
    /// Only the message with this id (as `dlq list` shows it); repeat for more.
    #[arg(long = "id")]
    ids: Vec<String>,
}

impl Select {
    fn filter(&self) -> Filter {
        Filter {
            reason: self.reason.clone(),
            message_type: self.message_type.clone(),
            pool: self.pool.clone(),
            older_than: self.older_than,
            newer_than: self.newer_than,
            ids: self.ids.clone(),
        }
    }
}

/// A duration as `<number><unit>`, the unit one of `s`, `m`, `h`, `d`.
fn parse_age(text: &str) -> Result<Duration, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not an age such as 90s, 10m, 2h or 3d"))?;
    let seconds = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => return Err(format!("{text:?}: the unit must be s, m, h or d")),
    };
    Ok(Duration::from_secs(n.saturating_mul(seconds)))
}

/// The route of a queue that dead-letters, or of its DLQ.
fn route(name: &str) -> anyhow::Result<Route> {
    amqp::ROUTES
        .into_iter()
        .chain([crate::audit::ROUTE])
        .find(|r| r.queue == name || r.dlq == name)
        .with_context(|| {
            format!(
                "unknown queue {name}; expected prizepool.draw, prizepool.refill, \
                 prizepool.settle or prizepool.audit"
            )
        })
}

/// What `--json` prints: the queue, what was found and what was done.
#[derive(Debug, Serialize)]
struct JsonReport<'a> {
    dlq: &'a str,
    queue: &'a str,
    action: &'a str,
    dry_run: bool,
    #[serde(flatten)]
    report: &'a dlq::Report,
}

pub(super) async fn run(config: &Config, command: DlqCommand) -> anyhow::Result<()> {
    let conn = amqp::connect(&config.amqp_url, "prizepool-dlq").await?;
    let result = dispatch(&conn, command).await;
    let _ = conn.close(200, "bye".into()).await;
    result
}

async fn dispatch(conn: &lapin::Connection, command: DlqCommand) -> anyhow::Result<()> {
    let (select, limit, action, label, dry_run, json) = match command {
        DlqCommand::List {
            select,
            limit,
            json,
        } => (select, limit, Action::List, "list", false, json),
        DlqCommand::Export {
            select,
            limit,
            output,
        } => return export(conn, &select, limit, output).await,
        DlqCommand::Replay {
            select,
            limit,
            dry_run,
            json,
        } => (select, limit, Action::Replay, "replay", dry_run, json),
        DlqCommand::Drop {
            select,
            limit,
            all,
            dry_run,
            json,
        } => {
            if !all && select.filter().is_empty() {
                anyhow::bail!(
                    "dlq drop removes dead letters for good: choose them with --reason, \
                     --type, --pool, --older-than, --newer-than or --id, or pass --all"
                );
            }
            (select, limit, Action::Drop, "drop", dry_run, json)
        }
    };
    let route = route(&select.queue)?;
    let effective = if dry_run { Action::List } else { action };
    let report = dlq::run(conn, route, effective, &select.filter(), limit).await?;
    if json {
        let out = JsonReport {
            dlq: route.dlq,
            queue: route.queue,
            action: label,
            dry_run,
            report: &report,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let n = report.messages.len();
    let found = report.found;
    let (dlq_name, queue) = (route.dlq, route.queue);
    match (action, dry_run) {
        (Action::List, _) => println!(
            "{} of {found} dead letters in {dlq_name} selected{}",
            report.matched,
            if n < report.matched {
                format!(", the first {n} shown")
            } else {
                String::new()
            }
        ),
        (Action::Replay, true) => {
            println!("would move {n} of the {found} messages in {dlq_name} to {queue}")
        }
        (Action::Replay, false) => println!(
            "moved {} of the {found} messages in {dlq_name} to {queue}{}",
            report.moved,
            if report.split > 0 {
                format!(
                    " ({} of them too big for {queue}, replayed as {} messages that fit)",
                    report.split, report.parts
                )
            } else {
                String::new()
            }
        ),
        (Action::Drop, true) => println!("would drop {n} of the {found} messages in {dlq_name}"),
        (Action::Drop, false) => println!(
            "dropped {} of the {found} messages in {dlq_name}",
            report.dropped
        ),
    }
    for l in &report.messages {
        print_letter(l);
    }
    Ok(())
}

fn print_letter(l: &DeadLetter) {
    let age = l.dead_at.map_or("age unknown".to_owned(), |at| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        format!("{}s ago", now.saturating_sub(at))
    });
    let pools = if l.pools.is_empty() {
        String::new()
    } else {
        format!(" pool {}", l.pools.join(","))
    };
    println!(
        "#{} {} [{}] {}{pools} ({age}): {}\n    {}",
        l.position,
        l.id,
        l.code.as_deref().unwrap_or("-"),
        l.message_type.as_deref().unwrap_or("?"),
        l.reason,
        l.body
    );
}

async fn export(
    conn: &lapin::Connection,
    select: &Select,
    limit: usize,
    output: Option<std::path::PathBuf>,
) -> anyhow::Result<()> {
    let route = route(&select.queue)?;
    let letters = dlq::export(conn, route, &select.filter(), limit).await?;
    let mut text = Vec::new();
    for letter in &letters {
        serde_json::to_writer(&mut text, letter)?;
        text.push(b'\n');
    }
    match output {
        Some(path) => {
            std::fs::write(&path, &text).with_context(|| format!("writing {}", path.display()))?
        }
        None => std::io::stdout().write_all(&text)?,
    }
    eprintln!("exported {} dead letters of {}", letters.len(), route.dlq);
    Ok(())
}

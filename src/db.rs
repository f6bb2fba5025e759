//! Postgres connection and migrations.

use anyhow::Context;
use sqlx::{
    migrate::MigrateDatabase,
    postgres::{PgPool, PgPoolOptions},
    Postgres,
};

/// The migrations in `migrations/`, compiled in.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Opens a connection pool. Connections are re-established on demand after
/// an outage.
pub async fn connect(url: &str) -> anyhow::Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(std::time::Duration::from_secs(5))
        .connect(url)
        .await
        .with_context(|| format!("connecting to Postgres at {}", redact(url)))
}

/// Creates the database if it is missing, then applies pending migrations.
pub async fn migrate(url: &str) -> anyhow::Result<PgPool> {
    if !Postgres::database_exists(url)
        .await
        .with_context(|| format!("reaching Postgres at {}", redact(url)))?
    {
        Postgres::create_database(url)
            .await
            .context("creating the database")?;
    }
    let pool = connect(url).await?;
    MIGRATOR.run(&pool).await.context("applying migrations")?;
    Ok(pool)
}

/// A URL with its password replaced, for logs and errors. Works on text
/// that does not parse as a URL too (a Redis Cluster's comma-separated list,
/// a typo): whatever lies between `://` and the `@` that ends the user
/// information is hidden.
pub fn redact(url: &str) -> String {
    redact_text(url)
}

/// `text` with the credentials of every URL in it hidden: `scheme://user:***@host`
/// (`scheme://***@host` when there is no user name), and every
/// `password=…` parameter masked. Meant for whole log messages and error
/// chains, where a driver may have quoted a URL.
pub fn redact_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        // The authority runs to the end of this URL: whitespace, a quote or
        // bracket, or the comma that starts the next URL of a list. Within
        // it, the last `@` ends the user information (a password may hold
        // an unencoded `@` or `/`, so the first `/` is no boundary).
        let end = url_end(tail);
        let url = &tail[..end];
        match url.rfind('@') {
            Some(at) => {
                let userinfo = &url[..at];
                match userinfo.split_once(':') {
                    Some((user, _)) if !user.is_empty() => {
                        out.push_str(user);
                        out.push_str(":***");
                    }
                    _ => out.push_str("***"),
                }
                out.push_str(&url[at..]);
            }
            None => out.push_str(url),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    mask_password_params(&out)
}

fn url_end(tail: &str) -> usize {
    let bytes = tail.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b.is_ascii_whitespace() || matches!(b, b'"' | b'\'' | b'<' | b'>' | b'`') {
            return i;
        }
        if b == b',' && starts_url(&tail[i + 1..]) {
            return i;
        }
    }
    tail.len()
}

/// Whether `s` opens with `scheme://`.
fn starts_url(s: &str) -> bool {
    let scheme_len = s
        .bytes()
        .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
        .count();
    scheme_len > 0 && s[scheme_len..].starts_with("://")
}

fn mask_password_params(text: &str) -> String {
    const KEY: &str = "password=";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.to_ascii_lowercase().find(KEY) {
        out.push_str(&rest[..i + KEY.len()]);
        let tail = &rest[i + KEY.len()..];
        let end = tail
            .find(|c: char| c == '&' || c == '"' || c.is_whitespace())
            .unwrap_or(tail.len());
        if end > 0 {
            out.push_str("***");
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::{redact, redact_text};

    #[test]
    fn every_kind_of_url_loses_its_password() {
        for (url, want) in [
            (
                "amqp://app:s3cret@10.0.0.1:5672/%2f",
                "amqp://app:***@10.0.0.1:5672/%2f",
            ),
            (
                "redis://:s3cret@127.0.0.1:6379",
                "redis://***@127.0.0.1:6379",
            ),
            (
                "rediss://user:s3cret@h:6380/0",
                "rediss://user:***@h:6380/0",
            ),
            (
                "postgres://ledger:s3cret@db/prizepool?sslmode=require",
                "postgres://ledger:***@db/prizepool?sslmode=require",
            ),
            // Unparseable: a cluster list, a password with `@` and `/`.
            (
                "redis://:s3cret@a:7000,rediss://u:s3cret@b:7001",
                "redis://***@a:7000,rediss://u:***@b:7001",
            ),
            (
                "postgres://u:s3/c@r@et@db:5432/x",
                "postgres://u:***@db:5432/x",
            ),
            ("amqp://s3cret@host:bad-port", "amqp://***@host:bad-port"),
            (
                "postgres://db/x?user=u&password=s3cret",
                "postgres://db/x?user=u&password=***",
            ),
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
        ] {
            assert_eq!(redact(url), want, "{url}");
            assert!(!redact(url).contains("s3cret"));
        }
    }

    #[test]
    fn urls_inside_messages_are_found() {
        let msg = "connecting to \"amqp://app:s3cret@h/v\": refused; also postgres://x:s3cret@db";
        let out = redact_text(msg);
        assert!(!out.contains("s3cret"), "{out}");
        assert!(
            out.starts_with("connecting to \"amqp://app:***@h/v\""),
            "{out}"
        );
    }
}

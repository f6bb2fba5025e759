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

/// A URL with its password replaced, for logs and errors.
pub fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        _ => url.to_owned(),
    }
}

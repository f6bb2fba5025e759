//! One seal key for the whole fleet, even when Redis loses it.
//!
//! With `LEDGER_SEAL_KEY` set, every process seals with that key and
//! nothing here changes it. Unset, the key is kept in Redis
//! (`<prefix>:ledger-seal-key`), and a process that read it once and kept it
//! for life would, after Redis lost it, seal with a key nobody else holds:
//! a worker started after the loss makes a fresh one, and each side then
//! refuses the other's rewards as forgeries.
//!
//! So a [`FleetSealer`] reads the key again every [`KEY_REFRESH`]. If Redis
//! holds none, it puts back the key it sealed with (the first process to
//! look restores the fleet's key, `SET NX`); if Redis holds another one
//! (a process put a fresh key there first), it switches to it. Every key
//! the fleet sealed with goes into a ring next to the key
//! (`<prefix>:ledger-seal-key:ring`), and checks accept a seal of any key in
//! the ring ([`Sealer`]): entries sealed just before a switch, and their
//! dead letters when they were refused meanwhile, check again and can be
//! replayed. Only the fleet writes these keys; upstreams still forge
//! nothing.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, RwLock,
    },
    time::{Duration, Instant},
};

use redis::aio::ConnectionLike;

use super::{seal::Sealer, SettleRequest};

/// How often a process reads the fleet's key kept in Redis again.
pub const KEY_REFRESH: Duration = Duration::from_secs(5);

/// The fleet's [`Sealer`]: loaded on first use, and read again from Redis
/// every [`KEY_REFRESH`] (never, with `LEDGER_SEAL_KEY` set).
#[derive(Debug)]
pub struct FleetSealer {
    loaded: RwLock<Option<Loaded>>,
    refresh: Duration,
    /// A reload is under way: others go on with the key they have.
    reloading: AtomicBool,
}

#[derive(Clone, Debug)]
struct Loaded {
    sealer: Arc<Sealer>,
    at: Instant,
    /// `LEDGER_SEAL_KEY` (or a key given by a caller): never reloaded.
    fixed: bool,
}

impl Default for FleetSealer {
    fn default() -> Self {
        Self::with_refresh(KEY_REFRESH)
    }
}

impl FleetSealer {
    /// A sealer that reads the key again every `refresh`.
    pub fn with_refresh(refresh: Duration) -> Self {
        Self {
            loaded: RwLock::new(None),
            refresh,
            reloading: AtomicBool::new(false),
        }
    }

    /// A sealer that seals and checks with `sealer` for ever.
    pub fn fixed(sealer: Sealer) -> Self {
        let fleet = Self::default();
        fleet.store(Arc::new(sealer), true);
        fleet
    }

    fn cached(&self) -> Option<Loaded> {
        self.loaded
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn store(&self, sealer: Arc<Sealer>, fixed: bool) {
        *self.loaded.write().unwrap_or_else(|e| e.into_inner()) = Some(Loaded {
            sealer,
            at: Instant::now(),
            fixed,
        });
    }

    /// The sealer, loading it through `conn` on first use and reading the
    /// key kept in Redis again once it is older than the refresh period.
    pub async fn get<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        config: &crate::config::Config,
    ) -> Result<Arc<Sealer>, redis::RedisError> {
        let key = config.ledger_seal_key.as_ref().map(|k| k.0.as_str());
        self.get_with(conn, &config.redis_prefix, key, self.refresh)
            .await
    }

    /// The sealer as [`FleetSealer::get`] gives it, under `prefix` with
    /// `key` (`LEDGER_SEAL_KEY`), read again if older than `max_age`: a
    /// caller that met a seal it cannot check asks for a fresh one.
    pub async fn get_with<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        prefix: &str,
        key: Option<&str>,
        max_age: Duration,
    ) -> Result<Arc<Sealer>, redis::RedisError> {
        let cached = self.cached();
        if let Some(loaded) = &cached {
            let fresh = loaded.fixed || loaded.at.elapsed() < max_age;
            // One reload at a time; the others seal with the key they have.
            if fresh || self.reloading.swap(true, Ordering::AcqRel) {
                return Ok(loaded.sealer.clone());
            }
        } else {
            self.reloading.store(true, Ordering::Release);
        }
        let reloaded = self.reload(conn, prefix, key, cached.as_ref()).await;
        self.reloading.store(false, Ordering::Release);
        let (sealer, fixed) = reloaded?;
        let sealer = Arc::new(sealer);
        self.store(sealer.clone(), fixed);
        Ok(sealer)
    }

    async fn reload<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        prefix: &str,
        key: Option<&str>,
        before: Option<&Loaded>,
    ) -> Result<(Sealer, bool), redis::RedisError> {
        if let Some(key) = key.filter(|k| !k.is_empty()) {
            return Ok((Sealer::new(key), true));
        }
        let sealer = Sealer::kept(conn, prefix, before.map(|l| l.sealer.key())).await?;
        if let Some(before) = before {
            if !before.sealer.same_key(&sealer) {
                tracing::warn!(
                    "the fleet's seal key in Redis changed (Redis lost it and another process made a new one); sealing with the new key, and the old one still checks"
                );
            }
        }
        Ok((sealer, false))
    }

    /// The sealer without waiting, for code that cannot await (building a
    /// draw's `draw.completed` event): the one loaded already (the async
    /// [`FleetSealer::get`] of the same worker keeps it fresh), else the
    /// one `LEDGER_SEAL_KEY` names, else the key kept in Redis, read on a
    /// thread of its own (see [`load_blocking`]). `None` only when Redis
    /// could not give the key; the caller's message then goes unsealed,
    /// and the audit refuses it.
    pub fn ready(&self, config: &crate::config::Config) -> Option<Arc<Sealer>> {
        if let Some(loaded) = self.cached() {
            return Some(loaded.sealer);
        }
        let (loaded, fixed) = match config.ledger_seal_key.as_ref().filter(|k| !k.0.is_empty()) {
            Some(key) => (Sealer::new(key.0.as_str()), true),
            None => match load_blocking(config) {
                Ok(sealer) => (sealer, false),
                Err(e) => {
                    tracing::error!(
                        error = format!("{e:#}"),
                        "the seal key could not be read from Redis; this message goes unsealed"
                    );
                    return None;
                }
            },
        };
        let loaded = Arc::new(loaded);
        self.store(loaded.clone(), fixed);
        Some(loaded)
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

/// Reads the fleet's key kept in Redis from synchronous code: on a thread
/// of its own with its own runtime and connection, so it neither needs nor
/// blocks on the caller's runtime (which may be a current-thread one,
/// whose connections a nested `block_on` would starve). The caller's thread
/// waits for a few Redis round trips (at most the connection's 5 s
/// timeouts). Once per process: later reads go through
/// [`FleetSealer::get`].
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

//! The prize kinds, and the one seam between them and the workers.
//!
//! A draw request enters here once, through [`Kinds::open`] (its id bound
//! to its content, its pool routed), and comes back once as a [`Step`] of
//! its prepared draw ([`Kinds::step_all`]): the kind either awards (the
//! result, its ledger entry and the refill it asks for), refuses (a code of
//! the wire contract and what the user already holds) or is short (the
//! caller waits for a refill, steps again, and ends with
//! [`Kinds::exhausted`]). That way is written once for every kind, in
//! `request.rs`. This module is the only reader of a pool's kind
//! ([`Kinds::resolve`]); each kind keeps its whole rule — its Lua calls,
//! its Redis layout, its ledger entry-id scheme — in its own folder.
//!
//! # Idempotency, written once
//!
//! Every request id is bound to what it first asked ([`fingerprint`]): the
//! seam claims the id before the pool step ([`claim`]), and every
//! answering script stores the fingerprint with the answer
//! (`lua/lib/answer.lua`). The same id with the same content replays the
//! first answer; with other content it is refused and moves nothing. Every
//! final answer is stored, refusals included, so a request once told "no"
//! never draws, spends a chance or pays later.
//!
//! # Races and ordering
//!
//! - **The kind cache.** [`Kinds`] remembers each pool's kind and sub-pool
//!   count without ever re-reading them: an id never changes kind (the
//!   registry in Postgres is one namespace) and a pool never changes its
//!   shards (`pool load` refuses it), so a cached entry cannot go stale.
//! - **Several asks at once** ([`Kinds::draw_all`], a batch of draws). The
//!   asks of one pool are applied in their order, one after another; asks
//!   of different pools run side by side and do not wait for each other.
//!   Each ask gets its own step, as if it had come alone.
//! - **The id claim comes first.** The draw worker claims a request's id
//!   ([`claim`]) before it resolves the kind and runs the step, so an id
//!   reused for other content is refused before any pool is touched; the
//!   kinds' own races are explained in each kind's module.
//!
//! # The registry
//!
//! The kinds are listed once, in [`registry::KINDS`]: each is a value of
//! its folder implementing [`PrizeKind`] (its label,
//! how a pool's meta hash resolves into its [`Draw`], its lifecycle
//! messages on the refill queue). This module resolves a pool once into a
//! [`Kind`] (a `&'static dyn Draw`, cached with the pool) and each draw
//! step is one virtual call into it; the refill worker reads the same
//! list. Adding a kind is a folder here (its `reasons.rs` with its `KIND`
//! and ledger reasons, its `kind.rs`, its draw and lifecycle steps, its
//! `scripts.rs`), its `pub mod` line below, its line in
//! [`registry::KINDS`] and its line in the ledger's `KIND_REASONS`:
//! `docs/design.md`, "Adding a prize kind", lists each line, and a test
//! checks that list against the code.

pub mod answer;
pub mod lottery;
pub mod lucky_gift;
pub mod red_packet;
pub mod registry;
mod request;

use std::{any::Any, collections::HashMap};

use tokio::sync::RwLock;

pub use answer::{claim, fingerprint, remember, Claim, Fingerprint, Refusal, ScriptReply, Tokens};
pub use registry::{At, Draw, Meta, PrizeKind, KINDS};
pub use request::{Opened, Prepared};

use crate::{
    amqp::HandleError,
    messages::{DrawResult, RefillRequest, SettleRequest},
    redis_conn::RedisConn,
    scripts::{PoolKeys, Scripts},
};
/// Sub-pools are named as lucky gift names them, the one kind whose pools
/// may be sharded ([`Draw::routes_sub_pools`]).
use lucky_gift::config as sub_pools;

/// What one draw request asks of a kind.
#[derive(Clone, Copy, Debug)]
pub struct Ask<'a> {
    pub request_id: &'a str,
    pub pool: &'a str,
    pub user: i64,
    pub count: u32,
    /// The request's answer token ([`Tokens::answer`]): where its answer
    /// lives in the pool's answer store and the [`fingerprint`] stored with it.
    pub token: &'a [u8],
    /// How long the answer is kept for replays.
    pub result_ttl_s: u64,
}

/// How a kind answered one step of a draw.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Prizes were awarded (now, or before for this same request).
    Awarded(Box<Award>),
    /// A final refusal, stored with the request.
    Refused(Refusal),
    /// Fewer prizes than asked are drawable; nothing changed. The caller
    /// asks for batch `generation + 1` and tries again.
    Short { in_pool: u64, generation: u64 },
}

/// An award: the reply's result, the ledger entry that pays exactly what the
/// result promises, and the refill the draw triggered.
#[derive(Clone, Debug, PartialEq)]
pub struct Award {
    pub result: DrawResult,
    pub entry: Option<SettleRequest>,
    pub refill: Option<RefillRequest>,
    /// Whether this is the replay of an earlier answer.
    pub replayed: bool,
    /// Prizes taken from the pool by this step (0 for a replay).
    pub prizes_drawn: u64,
}

/// Every prize kind, by the label its pools carry (`meta.kind` in Redis,
/// `pools.kind` in Postgres, the owner of its ledger reasons), in the order
/// of [`registry::KINDS`].
pub fn labels() -> impl Iterator<Item = &'static str> {
    KINDS.iter().map(|k| k.label())
}

/// The kind of a pool, resolved once: how its draws run ([`Draw`]: for a
/// lucky gift its storage, for a lottery its strategy, which `pool load` and
/// `activity load` refuse to change, so the value cannot go stale).
#[derive(Clone, Copy, Debug)]
pub struct Kind {
    draw: &'static dyn Draw,
    /// The kind's place in [`KINDS`], where a dispatch keeps its state.
    slot: usize,
}

impl Kind {
    /// The label stored in `meta.kind` and the pool registry.
    pub fn label(self) -> &'static str {
        self.draw.label()
    }

    /// What a short draw of this kind asks the refill worker for
    /// ([`registry::Draw::short_message`]).
    pub fn short_message(self) -> &'static str {
        self.draw.short_message()
    }
}

/// Most pool ids whose kind a worker remembers; past it the memory starts
/// over (a kind is one Redis read away).
const MAX_CACHED_KINDS: usize = 100_000;

/// The fields of a pool's meta hash the seam reads itself, before those the
/// kinds ask for ([`PrizeKind::meta_fields`]).
const META_FIELDS: [&str; 3] = ["kind", "shards", "r.e"];

/// What [`Kinds`] remembers of a pool id.
#[derive(Clone, Copy, Debug)]
struct Resolved {
    kind: Kind,
    shards: u32,
    /// For a sharded pool whose own answer store holds answers (refusals
    /// stored before the pool was loaded with its shards, an
    /// `unknown_pool`, which its requests' retries must still find,
    /// [`Kinds::answered_before`]): until when those answers can exist,
    /// unix seconds; 0 when there are none.
    answered_until: u64,
}

/// The dispatch: resolves a pool's kind and runs its draw step.
#[derive(Debug)]
pub struct Kinds {
    redis: RedisConn,
    scripts: Scripts,
    prefix: String,
    /// Until when the answer stores' earlier layout is read too
    /// ([`answer::start_layout`]); always, until set.
    earlier_until: std::sync::atomic::AtomicU64,
    /// Kind and sub-pool count of each pool id seen. An id never changes
    /// kind (the registry in Postgres enforces one namespace) and a pool
    /// never changes its shards (`pool load` refuses it), so entries never
    /// go stale.
    kinds: RwLock<HashMap<String, Resolved>>,
    /// The meta fields read to resolve a pool: [`META_FIELDS`], then every
    /// kind's own.
    meta_fields: Vec<&'static str>,
    /// Each kind's state in this dispatch ([`PrizeKind::open`]), in the
    /// order of [`KINDS`].
    states: Vec<Box<dyn Any + Send + Sync>>,
}

impl Kinds {
    /// Reads the answer stores' earlier layout until `until` only
    /// ([`answer::start_layout`]).
    pub fn read_earlier_layout_until(&self, until: u64) {
        self.earlier_until
            .store(until, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether this dispatch's tokens ask to read the earlier layout too.
    pub(crate) fn reads_earlier_layout(&self) -> bool {
        answer::reads_earlier_layout(
            self.earlier_until
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// The dispatch over `redis`, with keys under `prefix`.
    pub fn new(redis: RedisConn, prefix: &str) -> Self {
        let scripts = Scripts::new();
        let mut meta_fields = META_FIELDS.to_vec();
        for field in KINDS.iter().flat_map(|k| k.meta_fields()) {
            if !meta_fields.contains(field) {
                meta_fields.push(field);
            }
        }
        Self {
            redis,
            states: KINDS.iter().map(|k| k.open()).collect(),
            scripts,
            prefix: prefix.to_owned(),
            earlier_until: std::sync::atomic::AtomicU64::new(u64::MAX),
            kinds: RwLock::new(HashMap::new()),
            meta_fields,
        }
    }

    /// The Redis keys of pool `id`.
    pub fn keys(&self, id: &str) -> PoolKeys {
        PoolKeys::new(&self.prefix, id)
    }

    /// A connection to the pool state.
    pub fn redis(&self) -> RedisConn {
        self.redis.clone()
    }

    /// The scripts every kind shares (the claim and the answer store).
    pub fn scripts(&self) -> &Scripts {
        &self.scripts
    }

    /// The kind of pool `id`, from the cache or Redis; `None` if unknown.
    /// A sub-pool of a sharded pool resolves as the kind it holds.
    pub async fn resolve(&self, id: &str) -> Result<Option<Kind>, HandleError> {
        Ok(self.resolve_sharded(id).await?.map(|r| r.kind))
    }

    /// Whether pool `pool` routes its draws to sub-pools while its own
    /// answer store holds answers from before it was loaded (see
    /// [`Kinds::open`]).
    pub(crate) async fn answered_before(&self, pool: &str) -> Result<bool, HandleError> {
        // Compared with this host's clock: a margin of the store's own
        // clock skew, so a clock behind Redis's still looks while an
        // answer may be kept.
        let now = chrono::Utc::now().timestamp().max(0).unsigned_abs();
        Ok(self
            .resolve_sharded(pool)
            .await?
            .is_some_and(|r| now < r.answered_until.saturating_add(answer::CLOCK_SKEW_S)))
    }

    /// Where a draw of `user` from pool `pool` runs: the pool's kind and the
    /// pool whose keys hold the draw — the pool itself, or for a pool
    /// stocked as K sub-pools (`shards = K`), sub-pool `user mod K`, so one
    /// user's draws (and the retries of each) always reach the same
    /// sub-pool. A sub-pool named directly is no pool of its own: `None`,
    /// like an unknown pool.
    pub async fn route(
        &self,
        pool: &str,
        user: i64,
    ) -> Result<Option<(Kind, String)>, HandleError> {
        let Some(Resolved { kind, shards, .. }) = self.resolve_sharded(pool).await? else {
            return Ok(None);
        };
        if kind.draw.routes_sub_pools() && sub_pools::split_sub_pool(pool).1.is_some() {
            return Ok(None);
        }
        if shards <= 1 {
            return Ok(Some((kind, pool.to_owned())));
        }
        let shard = u32::try_from(user.rem_euclid(i64::from(shards))).unwrap_or(0);
        Ok(Some((kind, sub_pools::sub_pool_id(pool, shard))))
    }

    async fn resolve_sharded(&self, id: &str) -> Result<Option<Resolved>, HandleError> {
        if let Some(resolved) = self.kinds.read().await.get(id) {
            return Ok(Some(*resolved));
        }
        let mut conn = self.redis.clone();
        // `r.e`: the epochs of the pool's own answer store in the layout
        // before this one, there once an answer was stored under the
        // pool's id (lua/lib/answer.lua); `ep` (binary) below.
        let values: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(self.keys(id).meta())
            .arg(&self.meta_fields)
            .query_async(&mut conn)
            .await?;
        let meta = Meta {
            names: &self.meta_fields,
            values: &values,
        };
        let Some(label) = meta.get("kind") else {
            return Ok(None);
        };
        let Some((slot, kind)) = registry::find(label) else {
            return Err(HandleError::internal(format!(
                "pool {id} has an unknown kind {label:?}"
            )));
        };
        let kind = Kind {
            draw: kind.resolve(id, &meta)?,
            slot,
        };
        let shards = match meta.get("shards").map(str::parse::<u32>) {
            None => 1,
            Some(Ok(k @ 1..=sub_pools::MAX_SHARDS)) => k,
            Some(k) => {
                return Err(HandleError::internal(format!(
                    "pool {id} has {k:?} shards, past the most a pool may have"
                )))
            }
        };
        let answered_until = if shards > 1 {
            let epochs: Option<Vec<u8>> = redis::cmd("HGET")
                .arg(self.keys(id).meta())
                .arg("ep")
                .query_async(&mut conn)
                .await?;
            answer::store_end(epochs.as_deref(), meta.get("r.e"))
        } else {
            0
        };
        let mut kinds = self.kinds.write().await;
        if kinds.len() >= MAX_CACHED_KINDS {
            kinds.clear();
        }
        let resolved = Resolved {
            kind,
            shards,
            answered_until,
        };
        kinds.insert(id.to_owned(), resolved);
        Ok(Some(resolved))
    }

    /// One draw step of `kind` for `ask`.
    pub async fn draw(&self, kind: Kind, ask: &Ask<'_>) -> Result<Step, HandleError> {
        self.draw_all(kind, std::slice::from_ref(ask))
            .await
            .pop()
            .unwrap_or_else(|| Err(HandleError::internal("a draw step answered nothing")))
    }

    /// Draw steps of `kind` for `asks`, applied in order per pool; their
    /// steps in the same order as `asks`. The asks of one pool (a sub-pool
    /// for a sharded pool) run one after another; pools side by side.
    pub async fn draw_all(&self, kind: Kind, asks: &[Ask<'_>]) -> Vec<Result<Step, HandleError>> {
        let mut pools: Vec<(&str, Vec<usize>)> = Vec::new();
        for (i, ask) in asks.iter().enumerate() {
            match pools.iter_mut().find(|(pool, _)| *pool == ask.pool) {
                Some((_, places)) => places.push(i),
                None => pools.push((ask.pool, vec![i])),
            }
        }
        if pools.len() <= 1 {
            return self.draw_pool(kind, asks).await;
        }
        let runs = pools.iter().map(|(_, places)| async move {
            let of_pool: Vec<Ask<'_>> = places.iter().map(|&i| asks[i]).collect();
            self.draw_pool(kind, &of_pool).await
        });
        let mut steps: Vec<Option<Result<Step, HandleError>>> = asks.iter().map(|_| None).collect();
        for ((_, places), run) in pools.iter().zip(futures_util::future::join_all(runs).await) {
            for (&i, step) in places.iter().zip(run) {
                steps[i] = Some(step);
            }
        }
        steps
            .into_iter()
            .map(|step| {
                step.unwrap_or_else(|| Err(HandleError::internal("a draw step answered nothing")))
            })
            .collect()
    }

    /// The Lua call one draw step of `kind` makes for `ask`, with the same
    /// keys and arguments, but nothing around it: no reply read, no
    /// coalescing (what the step reads first, a lottery's seed, is read
    /// before). What the step's bare round trip costs (`prizepool bench`);
    /// a draw goes through [`Kinds::draw`].
    pub async fn script_call(
        &self,
        kind: Kind,
        ask: &Ask<'_>,
    ) -> Result<crate::scripts::ScriptInvocation<'static>, HandleError> {
        let keys = self.keys(ask.pool);
        kind.draw.prepared_call(&self.redis, &keys, ask).await
    }

    /// Draw steps of `kind` for `asks`, all of one pool, applied in order;
    /// their steps in the same order: one virtual call into the kind
    /// ([`Draw::draw_pool`]), with this dispatch's state of the kind.
    async fn draw_pool(&self, kind: Kind, asks: &[Ask<'_>]) -> Vec<Result<Step, HandleError>> {
        let Some(first) = asks.first() else {
            return Vec::new();
        };
        let keys = self.keys(first.pool);
        let Some(state) = self.states.get(kind.slot) else {
            return asks
                .iter()
                .map(|_| Err(HandleError::internal("a kind outside the registry")))
                .collect();
        };
        let at = At {
            redis: &self.redis,
            scripts: &self.scripts,
            keys: &keys,
            state: state.as_ref(),
        };
        kind.draw.draw_pool(at, asks).await
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::{labels, KINDS};
    use crate::ledger::reasons::Owner;

    /// The repository's root.
    fn root() -> &'static Path {
        Path::new(env!("CARGO_MANIFEST_DIR"))
    }

    fn read(path: &str) -> String {
        std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// `lucky_gift` as its `Kind` variant is named: `LuckyGift`.
    fn variant(label: &str) -> String {
        label
            .split('_')
            .map(|w| {
                let mut chars = w.chars();
                chars.next().map_or(String::new(), |c| {
                    c.to_ascii_uppercase().to_string() + chars.as_str()
                })
            })
            .collect()
    }

    #[test]
    fn every_kind_has_its_folder_and_every_folder_is_a_kind() {
        // Each label is the `KIND` of a module (`LABELS` names them), and
        // the module is the folder of that name.
        for label in labels() {
            assert!(
                root().join(format!("src/kinds/{label}/mod.rs")).is_file(),
                "kind {label:?} has no folder src/kinds/{label}/"
            );
        }
        let folders = std::fs::read_dir(root().join("src/kinds")).unwrap();
        for entry in folders {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_dir() {
                let name = entry.file_name().into_string().unwrap();
                assert!(
                    labels().any(|label| label == name),
                    "src/kinds/{name}/ is a folder of no registered kind"
                );
            }
        }
    }

    #[test]
    fn every_kind_owns_its_ledger_reasons_and_no_reason_names_another() {
        // The ledger lists the kinds' reasons itself (`KIND_REASONS`, read
        // without the registry): each registered kind has its reasons
        // there, and every sealed reason there is a registered kind's.
        for kind in KINDS {
            let label = kind.label();
            assert!(
                crate::ledger::reasons::of_kind(label).next().is_some(),
                "kind {label} books no ledger reason (is it in KIND_REASONS?)"
            );
        }
        for reason in crate::ledger::reasons::reasons().filter(|r| r.sealed()) {
            assert!(
                matches!(reason.owner, Owner::Kind(label) if labels().any(|l| l == label)),
                "reason {} is owned by no registered kind ({:?})",
                reason.name,
                reason.owner
            );
        }
        let mut all: Vec<&str> = labels().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), KINDS.len(), "two kinds share a label");
    }

    #[test]
    fn every_lifecycle_message_has_one_kind() {
        let messages: Vec<&str> = KINDS
            .iter()
            .flat_map(|k| k.lifecycle())
            .map(|l| l.message)
            .collect();
        for (i, m) in messages.iter().enumerate() {
            assert!(!messages[i + 1..].contains(m), "{m} is handled twice");
        }
    }

    /// Every row of the registration table in `docs/design.md` ("Adding a
    /// prize kind"), written for `scratch_card`, holds in its file for
    /// every registered kind.
    #[test]
    fn the_recipe_matches_the_code() {
        let design = read("docs/design.md");
        let recipe = design
            .split("### Adding a prize kind")
            .nth(1)
            .and_then(|rest| rest.split("\n### ").next())
            .expect("docs/design.md has a section \"Adding a prize kind\"");
        let rows: Vec<(&str, &str)> = recipe
            .lines()
            .filter_map(|line| {
                let cells: Vec<&str> = line.split('|').map(str::trim).collect();
                let file = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
                let shape = cells.get(2)?.strip_prefix('`')?;
                Some((file, shape.split('`').next()?))
            })
            .collect();
        // The registration lines a new kind needs: at least its module
        // and its line in the registry, and at most three.
        assert!(
            (2..=3).contains(&rows.len()),
            "the recipe's table has {} rows",
            rows.len()
        );
        for (file, shape) in rows {
            let code = read(file);
            for label in labels() {
                let line = shape
                    .replace("scratch_card", label)
                    .replace("SCRATCH_CARD", &label.to_uppercase())
                    .replace("ScratchCard", &variant(label));
                assert!(
                    code.contains(&line),
                    "{file} has no `{line}`: the recipe's row `{shape}` does not hold for {label}"
                );
            }
        }
    }
}

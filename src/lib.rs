//! prizepool: a worker fleet that hands out prizes under very high
//! concurrency — lucky-gift multiplier draws, red packets and lottery
//! activities — over RabbitMQ, Redis and Postgres.
//!
//! # Layout
//!
//! | module | what lives there |
//! |--------|------------------|
//! | [`config`], [`telemetry`], [`shutdown`], [`ops`] | start-up plumbing: environment, logs and traces (OTLP, trace context in AMQP headers), signals, `/metrics` + health |
//! | [`amqp`] | topology, publishing with confirms, the shared consume loop, coalesced acks, grouped messages (the groups are declared by the workers), dead letters |
//! | [`messages`] | the wire contract: every request, reply and event as a serde type, validation, error codes |
//! | [`scripts`] | how a Lua script of `lua/` runs (a Redis function), the scripts all kinds share, and the Redis key names; each kind's own scripts are in its folder |
//! | [`kinds`] | the seam: one dispatch and one vocabulary (award, refuse, short) for every prize kind, each kind in its own folder; request fingerprints and stored answers |
//! | [`ledger`] | the Postgres ledger: apply entries, balances, totals, the seals on the fleet's own entries, and the group they are published in |
//! | [`draw`], [`refill`], [`settle`] | the three workers |
//! | [`fairness`] | the committed, reproducible shuffle of provably fair batches |
//! | [`audit`] | the audit trail of committed batches and draws in Postgres, its consumer, and the verifier |
//! | [`pools`], [`db`] | the pool registry and the Postgres connection |
//! | [`client`] | the batching draw client for upstream services: `Client::draw` merges concurrent calls into `draw.batch` messages |
//! | [`cli`] | the `prizepool` subcommands, including `demo` |
//! | `bench/` (outside the library) | `prizepool bench`: ceilings, fleet runs, reports; a module of the `prizepool` binary alone, drawing through [`kinds::Kinds`] like the draw worker |
//!
//! The binaries in `src/bin/` only wire these together. The bench is no
//! part of the library (the workers never link it) and sees only what the
//! library makes public; it is neither a workspace member (its binary would
//! leave this package, and with it `CARGO_BIN_EXE_prizepool` for the tests)
//! nor a feature (it would stay in this crate). See `docs/design.md`.

pub mod amqp;
pub mod audit;
pub mod cli;
pub mod client;
pub mod config;
pub mod db;
pub mod draw;
pub mod fairness;
pub mod kinds;
pub mod ledger;
pub mod messages;
pub mod ops;
pub mod pools;
pub mod redis_conn;
pub mod refill;
pub mod scripts;
pub mod settle;
pub mod shutdown;
pub mod telemetry;

//! The integration tests, one module per subject, in one test binary: one
//! link of the crate instead of one per file, and one process whose test
//! threads overlap the tests' waits on the servers. A test that needs a
//! process of its own (process-wide state: `tests/tls.rs` installs TLS files
//! for every later connection of its process) is a binary of its own at the
//! top of `tests/`.
//!
//! Every test talks to the real services (RabbitMQ, Redis, Postgres) through
//! `tests/common`, which sets up what they must offer (plugins, vhosts, a
//! migrated template database) by itself.
#![allow(clippy::unwrap_used)]

#[path = "../common/mod.rs"]
mod common;

mod alerts;
mod answer_store;
mod attacks;
mod batch;
mod bench;
mod big_draws;
mod broker_addresses;
mod broker_cluster;
mod cli;
mod cli_truth;
mod client;
mod cluster;
mod cluster_changes;
mod cluster_failover;
mod contract;
mod dead_letters;
mod deploy;
mod digests;
mod draw_shards;
mod economics;
mod fair_outages;
mod fair_vectors;
mod fairness;
mod faults;
mod fleet;
mod fleet_view;
mod graceful;
mod graceful_burst;
mod hand_back;
mod hostile;
mod hot_pools;
mod jackpot_records;
mod lottery;
mod lottery_fairness;
mod lua_properties;
mod lucky_gift_rules;
mod observability;
mod ops;
mod poison;
mod red_packet_fairness;
mod red_packets;
mod redis_auth;
mod redis_commands;
mod reply_schemas;
mod review_attacks;
mod seal_key;
mod settle;
mod short_pools;
mod tls;
mod traces;
mod upstream;
mod wire_limits;

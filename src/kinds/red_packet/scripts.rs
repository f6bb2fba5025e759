//! The red-packet scripts (`lua/`), built once per process: each is
//! loaded into Redis by its digest when a call first finds it missing.

use std::sync::LazyLock;

use crate::scripts::{answering, plain, Script};

/// Stocks a packet's shares, once.
pub static STOCK: LazyLock<Script> = LazyLock::new(|| plain!("stock_red_packet.lua"));
/// A grab: the kind's draw step.
pub static GRAB: LazyLock<Script> = LazyLock::new(|| answering!("grab_red_packet.lua"));
/// Closes a packet at its expiry, the shares left refunded.
pub static CLOSE: LazyLock<Script> = LazyLock::new(|| answering!("close_red_packet.lua"));
/// A packet's counters.
pub static STATUS: LazyLock<Script> = LazyLock::new(|| plain!("red_packet_status.lua"));
/// The packet's one pending expiry.
pub static EXPIRY: LazyLock<Script> = LazyLock::new(|| plain!("red_packet_expiry.lua"));

//! The prize kinds. Each keeps its Redis layout, Lua wrappers and pure logic
//! in its own module; the workers dispatch to them by a pool's `kind`.

pub mod lottery;
pub mod lucky_gift;
pub mod red_packet;

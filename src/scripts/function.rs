//! A Lua script run as a Redis function (`FCALL`), with the calling
//! interface of `redis::Script`.
//!
//! Redis has no `require`: a script's shared rules (`lua/lib/*.lua`) travel
//! in front of it. Sent with `EVALSHA`, that prelude would run on every call
//! and build its fifty-odd closures again each time (about 5 µs of Redis CPU
//! per draw). As a function library it runs once, when the library is
//! loaded: the prelude's functions are made once, and each call runs only
//! the script's body.
//!
//! A library is named after a digest of its code (`pp_<16 hex>`), and holds
//! one function of the same name. Two builds of the fleet with different
//! scripts (a rolling deploy) each call their own. A call that finds its
//! function missing (a Redis restarted without persistence, a new cluster
//! master, a `FUNCTION FLUSH`) loads the library, on every master of a
//! cluster, and calls again, as `EVALSHA` falls back after `NOSCRIPT`.
//!
//! The library wraps the body as a function of `KEYS` and `ARGV`, which are
//! locals of the library that each call sets first, so the prelude and the
//! body read them as they would in `EVAL`. State the prelude keeps between
//! the steps of one call (`OPEN` in `lua/lib/answer.lua`) is reset at the
//! start of each call: a function library's locals outlive the call.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use redis::{aio::ConnectionLike, FromRedisValue, RedisResult, ToRedisArgs};
use sha2::{Digest, Sha256};

/// A script loaded as a Redis function library.
#[derive(Clone, Debug)]
pub struct Script {
    name: Arc<str>,
    library: Arc<str>,
    loads: Arc<Loads>,
}

/// One load at a time per script: when many calls find the library missing
/// at once (a worker with hundreds of draws in flight after a Redis
/// restart), the first loads it and the others call again, instead of each
/// compiling the library while Redis waits.
#[derive(Debug, Default)]
struct Loads {
    lock: tokio::sync::Mutex<()>,
    /// Loads this process has made of the library.
    done: AtomicU64,
}

impl Script {
    /// A script without a prelude: `body` as an `EVAL` script would read.
    pub fn new(body: &str) -> Self {
        Self::with_prelude("", body)
    }

    /// A script whose `prelude` (shared local functions and constants) runs
    /// once at load, and whose `body` runs on each call. Each call starts by
    /// emptying the prelude's per-call table `OPEN` when the prelude has one.
    pub fn with_prelude(prelude: &str, body: &str) -> Self {
        let digest = Sha256::new()
            .chain_update(prelude.as_bytes())
            .chain_update([0])
            .chain_update(body.as_bytes())
            .finalize();
        let name: String = format!(
            "pp_{}",
            digest[..8]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        );
        let reset = if declares_local(prelude, "OPEN") {
            "OPEN = {}\n"
        } else {
            ""
        };
        let library = format!(
            "#!lua name={name}\n\
             local KEYS, ARGV\n\
             {prelude}\n\
             local function body()\n{body}\nend\n\
             redis.register_function('{name}', function(keys, args)\n\
             KEYS, ARGV = keys, args\n\
             {reset}\
             return body()\n\
             end)\n"
        );
        Self {
            name: name.into(),
            library: library.into(),
            loads: Arc::default(),
        }
    }

    /// The function's name (also its library's).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The library's code, as `FUNCTION LOAD` takes it.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// A call of the script, to which keys and arguments are added.
    pub fn prepare_invoke(&self) -> ScriptInvocation<'_> {
        ScriptInvocation {
            script: self,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }

    /// A call of the script with a first key.
    pub fn key<T: ToRedisArgs>(&self, key: T) -> ScriptInvocation<'_> {
        let mut call = self.prepare_invoke();
        call.key(key);
        call
    }

    /// A call of the script with a first argument.
    pub fn arg<T: ToRedisArgs>(&self, arg: T) -> ScriptInvocation<'_> {
        let mut call = self.prepare_invoke();
        call.arg(arg);
        call
    }

    /// Loads the library (replacing one of the same name), on every master
    /// of a cluster.
    pub async fn load<C: ConnectionLike + Send>(&self, conn: &mut C) -> RedisResult<()> {
        redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(&*self.library)
            .query_async::<redis::Value>(conn)
            .await?;
        Ok(())
    }
}

/// Whether `code` declares a top-level `local <name>`.
fn declares_local(code: &str, name: &str) -> bool {
    code.lines().any(|l| {
        l.strip_prefix("local ")
            .and_then(|rest| rest.strip_prefix(name))
            .is_some_and(|rest| rest.starts_with([' ', '=']))
    })
}

/// One call of a [`Script`]: its keys and arguments.
#[derive(Debug)]
pub struct ScriptInvocation<'a> {
    script: &'a Script,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl ScriptInvocation<'_> {
    /// Adds a key (`KEYS[n]`).
    pub fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    /// Adds an argument (`ARGV[n]`).
    pub fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    /// Calls the function, loading its library first if Redis does not
    /// have it.
    pub async fn invoke_async<T: FromRedisValue>(
        &self,
        conn: &mut (impl ConnectionLike + Send),
    ) -> RedisResult<T> {
        let mut call = redis::cmd("FCALL");
        call.arg(self.script.name())
            .arg(self.keys.len())
            .arg(&self.keys[..])
            .arg(&self.args[..]);
        let loads = &self.script.loads;
        let before = loads.done.load(Ordering::Acquire);
        match call.query_async(conn).await {
            Err(e) if missing(&e) => {
                {
                    let _one = loads.lock.lock().await;
                    // Loaded by another call since this one failed: call again.
                    if loads.done.load(Ordering::Acquire) == before {
                        self.script.load(conn).await?;
                        loads.done.fetch_add(1, Ordering::Release);
                    }
                }
                call.query_async(conn).await
            }
            other => other,
        }
    }
}

/// Whether Redis answered that the function is not loaded.
fn missing(e: &redis::RedisError) -> bool {
    e.detail()
        .is_some_and(|d| d.starts_with("Function not found"))
        || e.to_string().contains("Function not found")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_code() {
        let a = Script::with_prelude("local X = 1", "return X");
        let b = Script::with_prelude("local X = 2", "return X");
        assert_ne!(a.name(), b.name());
        assert_eq!(
            a.name(),
            Script::with_prelude("local X = 1", "return X").name()
        );
        assert!(a
            .library()
            .starts_with(&format!("#!lua name={}\n", a.name())));
    }

    #[test]
    fn a_prelude_with_per_call_state_is_reset_each_call() {
        assert!(Script::with_prelude("local OPEN = {}", "return 1")
            .library()
            .contains("OPEN = {}\nreturn body()"));
        assert!(!Script::with_prelude("local OPENED = {}", "return 1")
            .library()
            .contains("OPEN = {}\nreturn body()"));
        assert!(!Script::new("return 1").library().contains("OPEN = {}"));
    }
}

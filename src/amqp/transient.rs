//! Why a request could not be handled ([`HandleError`]), and which
//! failures are worth another try. A lost connection is transient wherever
//! it surfaces.
//!
//! Redis and sqlx errors are classified where they enter a handler
//! (`From<redis::RedisError>` and `From<sqlx::Error>` for [`HandleError`]).
//! Some reach the handler inside an `anyhow::Error` instead (a helper that
//! reads a pool's config and decodes it, a connection opened on the way), and
//! a broken pipe wrapped like that was once dead-lettered as `internal`.
//! [`HandleError::classify`] looks through the whole chain of causes for a
//! connection, pool or server failure, and [`settled`] applies the same test
//! to every internal failure before the consume loop dead-letters it: a
//! failure whose cause is a lost or refused connection to Redis, Postgres or
//! RabbitMQ is retried, never dead-lettered.

use std::io;

use crate::messages::Invalid;

/// Why a request could not be handled.
#[derive(Debug, thiserror::Error)]
pub enum HandleError {
    /// Bad input: dead-letter it, never retry.
    #[error("invalid request: {0}")]
    Invalid(#[from] Invalid),
    /// A dependency failed: retry with backoff, then requeue.
    #[error("transient failure: {0:#}")]
    Transient(#[from] anyhow::Error),
    /// A failure that can never succeed however often it is retried (a
    /// stored value that does not parse, a script reply nobody expects, an
    /// overflow, a panic): dead-letter with the reason and answer `internal`
    /// at once.
    #[error("internal failure: {0:#}")]
    Internal(anyhow::Error),
}

impl HandleError {
    /// An internal (permanent) failure described by `message`.
    pub fn internal(message: impl std::fmt::Display) -> Self {
        Self::Internal(anyhow::anyhow!("{message}"))
    }
}

/// Redis errors are classified where they enter the handler: a server that
/// is away, busy or moving slots is transient; anything the same request
/// would hit again (a script's `error()`, a reply of an unexpected shape, a
/// command Redis refuses) is internal.
impl From<redis::RedisError> for HandleError {
    fn from(e: redis::RedisError) -> Self {
        if redis_is_transient(&e) {
            Self::Transient(e.into())
        } else {
            Self::Internal(e.into())
        }
    }
}

/// Whether retrying later may succeed: the connection (refused, reset,
/// timed out, any I/O), the cluster (slots moving, a failover, a node down)
/// or the server's state (loading a dump, busy with a slow script, out of
/// memory, unable to persist) is at fault, not the request.
pub(super) fn redis_is_transient(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    if e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_cluster_error()
    {
        return true;
    }
    match e.kind() {
        ErrorKind::Io
        | ErrorKind::ClusterConnectionNotFound
        // Credentials being rotated: a property of the connection, and
        // dead-lettering every request until they work would empty the
        // queue into its DLQ.
        | ErrorKind::AuthenticationFailed
        | ErrorKind::MasterNameNotFoundBySentinel
        | ErrorKind::NoValidReplicasFoundBySentinel => true,
        ErrorKind::Server(kind) => matches!(
            kind,
            ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::ReadOnly
        ),
        // Codes redis-rs has no kind for.
        ErrorKind::Extension => matches!(
            e.code(),
            Some("BUSY" | "LOADING" | "OOM" | "MISCONF" | "NOREPLICAS" | "UNBLOCKED")
        ),
        _ => false,
    }
}

/// sqlx errors are classified like Redis errors: the connection, the pool
/// and the server's state are transient, the statement is internal.
impl From<sqlx::Error> for HandleError {
    fn from(e: sqlx::Error) -> Self {
        if sqlx_is_transient(&e) {
            Self::Transient(e.into())
        } else {
            Self::Internal(e.into())
        }
    }
}

/// Whether retrying later may succeed (see [`From<sqlx::Error>`]).
pub(super) fn sqlx_is_transient(e: &sqlx::Error) -> bool {
    match e {
        // The connection broke or could not be made, or the pool had none
        // to give (all busy, or closing for a shutdown). A protocol error
        // means the connection lost its footing; the pool replaces it.
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| sqlstate_is_transient(&code)),
        _ => false,
    }
}

/// Whether a Postgres SQLSTATE names a condition that passes: connection
/// exceptions (class 08), serialization failures and deadlocks (40001,
/// 40P01), insufficient resources (class 53), an administrator's shutdown or
/// a server still starting (57P01–57P03), a statement timeout (57014), a
/// lock not available (55P03), a read-only server after a failover (25006).
fn sqlstate_is_transient(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("53")
        || matches!(
            code,
            "40001" | "40P01" | "57P01" | "57P02" | "57P03" | "57014" | "55P03" | "25006"
        )
}

impl From<super::publish::PublishError> for HandleError {
    fn from(e: super::publish::PublishError) -> Self {
        Self::Transient(e.into())
    }
}

impl HandleError {
    /// `error` as a transient failure when any of its causes is a server
    /// that is away (a connection lost, reset, refused or timed out, a pool
    /// with no connection to give, a broker error), else as an internal one.
    pub fn classify(error: anyhow::Error) -> Self {
        if is_transient(&error) {
            Self::Transient(error)
        } else {
            Self::Internal(error)
        }
    }
}

/// `result` with an internal failure whose cause is a server that is away
/// turned into a transient one: the last check before a delivery is
/// dead-lettered.
pub(super) fn settled<T>(result: Result<T, HandleError>) -> Result<T, HandleError> {
    match result {
        Err(HandleError::Internal(error)) if is_transient(&error) => {
            Err(HandleError::Transient(error))
        }
        other => other,
    }
}

/// Whether any cause in `error`'s chain says a server is away.
pub(crate) fn is_transient(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        if let Some(e) = cause.downcast_ref::<redis::RedisError>() {
            redis_is_transient(e)
        } else if let Some(e) = cause.downcast_ref::<sqlx::Error>() {
            sqlx_is_transient(e)
        } else if let Some(e) = cause.downcast_ref::<io::Error>() {
            io_is_transient(e)
        } else {
            // Every broker error is the broker's or the connection's state,
            // never the request's.
            cause.downcast_ref::<lapin::Error>().is_some()
                || cause
                    .downcast_ref::<super::publish::PublishError>()
                    .is_some()
        }
    })
}

/// Whether an I/O error is a connection that broke, was refused or timed
/// out (not, say, a file that is missing).
fn io_is_transient(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        BrokenPipe
            | ConnectionReset
            | ConnectionAborted
            | ConnectionRefused
            | NotConnected
            | UnexpectedEof
            | TimedOut
            | WouldBlock
            | Interrupted
            | AddrNotAvailable
            | HostUnreachable
            | NetworkUnreachable
            | NetworkDown
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    fn is_retried(result: Result<(), HandleError>) -> bool {
        matches!(settled(result), Err(HandleError::Transient(_)))
    }

    #[test]
    fn a_lost_connection_under_any_wrapping_is_transient() {
        for kind in [
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::ConnectionRefused,
            io::ErrorKind::UnexpectedEof,
        ] {
            let redis: redis::RedisError = io::Error::new(kind, "test").into();
            let wrapped = anyhow::Error::from(redis).context("reading the pool's config");
            assert!(matches!(
                HandleError::classify(wrapped),
                HandleError::Transient(_)
            ));
            let sqlx = sqlx::Error::Io(io::Error::new(kind, "test"));
            let wrapped = Err::<(), _>(sqlx).context("loading the pool");
            assert!(matches!(
                HandleError::classify(wrapped.unwrap_err()),
                HandleError::Transient(_)
            ));
            let bare = anyhow::Error::from(io::Error::new(kind, "test")).context("connecting");
            assert!(is_retried(Err(HandleError::Internal(bare))), "{kind:?}");
        }
        assert!(is_retried(Err(HandleError::Internal(anyhow::Error::from(
            sqlx::Error::PoolTimedOut
        )))));
        assert!(is_retried(Err(HandleError::Internal(anyhow::Error::from(
            lapin::Error::from(lapin::ErrorKind::ChannelsLimitReached)
        )))));
    }

    #[test]
    fn what_the_request_would_hit_again_stays_internal() {
        let script = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "test",
        ));
        for error in [
            anyhow::anyhow!("malformed draw answer"),
            anyhow::Error::from(script).context("drawing"),
            anyhow::Error::from(io::Error::new(io::ErrorKind::NotFound, "no such file")),
            anyhow::Error::from(sqlx::Error::RowNotFound),
        ] {
            assert!(!is_retried(Err(HandleError::Internal(error))));
        }
        // Bad input stays bad input.
        let invalid = HandleError::Invalid(crate::messages::Invalid::new("bad"));
        assert!(matches!(
            settled::<()>(Err(invalid)),
            Err(HandleError::Invalid(_))
        ));
    }

    use std::{borrow::Cow, io};

    fn transient(e: impl Into<HandleError>) -> bool {
        match e.into() {
            HandleError::Transient(_) => true,
            HandleError::Internal(_) => false,
            HandleError::Invalid(i) => panic!("a server error is never bad input: {i}"),
        }
    }

    fn io_error(kind: io::ErrorKind) -> redis::RedisError {
        io::Error::new(kind, "test").into()
    }

    #[test]
    fn redis_connection_and_cluster_errors_are_transient() {
        for kind in [
            io::ErrorKind::ConnectionRefused,
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::TimedOut,
            io::ErrorKind::UnexpectedEof,
            io::ErrorKind::Other,
        ] {
            assert!(transient(io_error(kind)), "{kind:?}");
        }
        for kind in [
            redis::ServerErrorKind::Moved,
            redis::ServerErrorKind::Ask,
            redis::ServerErrorKind::TryAgain,
            redis::ServerErrorKind::ClusterDown,
            redis::ServerErrorKind::MasterDown,
            redis::ServerErrorKind::BusyLoading,
            redis::ServerErrorKind::ReadOnly,
        ] {
            let e = redis::RedisError::from((redis::ErrorKind::Server(kind), "test"));
            assert!(transient(e), "{kind:?}");
        }
        assert!(transient(redis::RedisError::from((
            redis::ErrorKind::ClusterConnectionNotFound,
            "test"
        ))));
        for code in ["BUSY", "LOADING", "OOM", "MISCONF"] {
            let e = redis::make_extension_error(code.into(), Some("test".into()));
            assert!(transient(e), "{code}");
        }
    }

    #[test]
    fn redis_script_type_and_parse_errors_are_internal() {
        for kind in [
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            redis::ErrorKind::Server(redis::ServerErrorKind::ExecAbort),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoScript),
            redis::ErrorKind::Server(redis::ServerErrorKind::CrossSlot),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm),
            redis::ErrorKind::UnexpectedReturnType,
            redis::ErrorKind::Parse,
            redis::ErrorKind::Client,
            redis::ErrorKind::InvalidClientConfig,
        ] {
            let e = redis::RedisError::from((kind, "test"));
            assert!(!transient(e), "{kind:?}");
        }
        // A script's `redis.error_reply("…")` with a code of its own.
        let e = redis::make_extension_error("BADPOOL".into(), Some("corrupt".into()));
        assert!(!transient(e));
    }

    /// A Postgres error with only a SQLSTATE, as the driver would report it.
    #[derive(Debug)]
    struct Sqlstate(&'static str);

    impl std::fmt::Display for Sqlstate {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "SQLSTATE {}", self.0)
        }
    }

    impl std::error::Error for Sqlstate {}

    impl sqlx::error::DatabaseError for Sqlstate {
        fn message(&self) -> &str {
            "test"
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.0))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn database(code: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Sqlstate(code)))
    }

    #[test]
    fn sqlx_connection_pool_and_passing_server_states_are_transient() {
        for e in [
            sqlx::Error::Io(io::Error::new(io::ErrorKind::ConnectionReset, "test")),
            sqlx::Error::Tls("handshake".into()),
            sqlx::Error::Protocol("unexpected message".into()),
            sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed,
            sqlx::Error::WorkerCrashed,
        ] {
            let text = e.to_string();
            assert!(transient(e), "{text}");
        }
        for code in [
            "08000", "08003", "08006", "08001", "08004", "40001", "40P01", "53000", "53100",
            "53200", "53300", "57P01", "57P02", "57P03", "57014", "55P03", "25006",
        ] {
            assert!(transient(database(code)), "{code}");
        }
    }

    #[test]
    fn sqlx_statement_and_decoding_errors_are_internal() {
        for e in [
            sqlx::Error::RowNotFound,
            sqlx::Error::ColumnNotFound("x".into()),
            sqlx::Error::Decode("bad".into()),
            sqlx::Error::Configuration("bad".into()),
        ] {
            let text = e.to_string();
            assert!(!transient(e), "{text}");
        }
        for code in [
            "23505", "23503", "22012", "22003", "42P01", "42703", "P0001", "XX000", "40002",
        ] {
            assert!(!transient(database(code)), "{code}");
        }
    }
}

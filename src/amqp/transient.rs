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
}

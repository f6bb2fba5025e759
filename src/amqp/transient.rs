//! A lost connection is transient wherever it surfaces.
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

use super::consumer::{redis_is_transient, sqlx_is_transient, HandleError};

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

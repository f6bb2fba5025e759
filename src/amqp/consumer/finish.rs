//! Finishing: what a handled delivery leaves behind. Its effects and
//! grouped bodies are published and confirmed, then its reply; bad input
//! and permanent failures are dead-lettered with their reason and answered
//! `rejected`; a delivery whose dependency stays away is handed back
//! through its queue's retry queue ([`hand_back`]). Each says how the
//! delivery is settled.

use lapin::{
    message::Delivery,
    types::{AMQPValue, FieldTable},
    BasicProperties,
};

use super::{
    shared::{Ended, Groupers, Shared},
    HandleError, Handler, Outcome, Outgoing, Publisher, Route, Settle,
};
use crate::{
    amqp::{
        publish::{with_header, without_expiration},
        reply::{Replier, Sent},
        DLX, ERROR_CODE_HEADER, ERROR_HEADER, FAILING_SINCE_HEADER, RETRIES_HEADER,
    },
    messages::{self, ErrorCode, Invalid},
};

/// A handler's outcome: published and answered, unless it names a group
/// the handler does not declare (a bug of the handler, the same on every
/// redelivery: dead-lettered as `internal`).
pub(super) async fn succeeded<H: Handler>(
    shared: &Shared<H>,
    delivery: &Delivery,
    outcome: Outcome,
) -> Ended {
    if let Some(group) = outcome.undeclared(shared.handler.groups()) {
        let reason = Invalid::new(format!(
            "the handler produced a {group} body but declares no such group"
        ));
        tracing::error!(%reason, "permanent failure; dead-lettering");
        let (label, how) = dead_letter(shared, delivery, ErrorCode::Internal, &reason).await;
        return (label, how, None);
    }
    finish(&shared.publisher, &shared.groupers, delivery, outcome).await
}

/// A failed delivery: bad input and permanent failures are dead-lettered
/// (`invalid_request`, `internal`); a transient one is handed back.
pub(super) async fn failed<H: Handler>(
    shared: &Shared<H>,
    delivery: &Delivery,
    error: HandleError,
) -> Ended {
    let (code, reason) = match error {
        HandleError::Invalid(invalid) => (ErrorCode::InvalidRequest, invalid),
        HandleError::Internal(error) => {
            tracing::error!(
                error = format!("{error:#}"),
                "permanent failure; dead-lettering"
            );
            (ErrorCode::Internal, Invalid::new(format!("{error:#}")))
        }
        HandleError::Transient(error) => {
            return hand_back(shared, delivery, &format!("{error:#}")).await
        }
    };
    let (label, how) = dead_letter(shared, delivery, code, &reason).await;
    (label, how, None)
}

/// Publishes the outcome: first its effects and grouped bodies, and only
/// once the broker has confirmed them all, the reply. The delivery may
/// be acked once the reply is confirmed too.
///
/// The order makes the reply the last thing a request causes: if anything
/// before it fails, nothing was answered, the delivery is requeued and its
/// redelivery (being idempotent) republishes the same outcome and answers
/// once. A reply sent alongside effects that then failed would be sent again
/// by that redelivery: two replies to one request.
async fn finish(
    publisher: &Publisher,
    groupers: &Groupers,
    delivery: &Delivery,
    outcome: Outcome,
) -> Ended {
    // Each body to its group's publisher (every group is declared: see
    // `succeeded`), moved, not copied.
    let mut bodies: Vec<Vec<Vec<u8>>> = groupers.grouped.iter().map(|_| Vec::new()).collect();
    for (group, body) in outcome.grouped {
        if let Some(i) = groupers
            .grouped
            .iter()
            .position(|(declared, _)| declared.batch_type == group.batch_type)
        {
            bodies[i].push(body);
        }
    }
    let grouped = futures_util::future::join_all(
        groupers
            .grouped
            .iter()
            .zip(bodies)
            .filter(|(_, bodies)| !bodies.is_empty())
            .map(|((_, grouper), bodies)| grouper.publish(bodies)),
    );
    let (published, grouped) = tokio::join!(publisher.publish_all(outcome.effects), grouped);
    let result = published
        .map_err(anyhow::Error::from)
        .and_then(|()| grouped.into_iter().collect::<anyhow::Result<()>>());
    if let Err(error) = result {
        // Nothing is acked: the request is redelivered and, being
        // idempotent, replays its first result and republishes.
        tracing::error!(
            error = format!("{error:#}"),
            "publishing the outcome failed; requeueing"
        );
        return ("requeued", Settle::Requeue, None);
    }
    let (Some(reply), Some(reply_to)) = (outcome.reply, delivery.properties.reply_to()) else {
        return ("acked", Settle::Ack, None);
    };
    let gate = groupers.closed.clone().read_owned().await;
    if *gate {
        // The session is closing and this ack might not reach the broker:
        // the redelivery answers instead.
        return ("requeued", Settle::Requeue, None);
    }
    let reply = Outgoing::reply(
        reply_to.as_str(),
        delivery.properties.correlation_id().as_ref(),
        reply,
    );
    if groupers.replier.send(vec![reply]).await == Sent::GivenUp {
        // Everything the request caused is confirmed and its answer is
        // stored: a requester still waiting sends the same id again and gets
        // it replayed.
        tracing::warn!("the reply could not be delivered; its requester is gone");
    }
    ("acked", Settle::Ack, Some(gate))
}

/// Moves a bad message to its dead-letter queue with the reason in headers
/// and answers the requester, in that order; the original may then be acked.
async fn dead_letter<H: Handler>(
    shared: &Shared<H>,
    delivery: &Delivery,
    code: ErrorCode,
    invalid: &Invalid,
) -> (&'static str, Settle) {
    let (publisher, replier) = (&shared.publisher, &shared.groupers.replier);
    let route = shared.handler.route();
    tracing::warn!(reason = %invalid, %code, "dead-lettering");
    let copy = dead_letter_message(delivery, delivery.data.clone(), route, code, invalid);
    let (label, how) = match publisher.publish(copy).await {
        Ok(()) => ("dead_lettered", Settle::Ack),
        Err(error) => {
            // Let the broker dead-letter it natively instead (no reason header).
            tracing::error!(%error, "could not publish the dead letter; rejecting");
            ("rejected", Settle::Reject)
        }
    };
    // Either way the request is never delivered again (acked, or moved to
    // the DLQ by the broker), so this is its one answer.
    let Some(reply) = rejected_reply_message(delivery, code, invalid) else {
        return (label, how);
    };
    if replier.send(vec![reply]).await == Sent::GivenUp {
        // Requeueing would dead-letter a second copy and fail the same way.
        tracing::warn!("the rejected reply could not be delivered; its requester is gone");
    }
    (label, how)
}

/// The `rejected` reply to `delivery`, when it asked for one.
fn rejected_reply_message(
    delivery: &Delivery,
    code: ErrorCode,
    invalid: &Invalid,
) -> Option<Outgoing> {
    let reply_to = delivery.properties.reply_to().as_ref()?;
    let reply = messages::rejected_reply_to(&delivery.data, code, &invalid.message);
    Some(Outgoing::reply(
        reply_to.as_str(),
        delivery.properties.correlation_id().as_ref(),
        serde_json::to_vec(&reply).unwrap_or_default(),
    ))
}

/// The copy of `delivery` that goes to its dead-letter queue: same body and
/// properties, plus the reason headers, but no `expiration`: a dead letter
/// stays until someone looks at it, whatever TTL its publisher gave it.
fn dead_letter_message(
    delivery: &Delivery,
    body: Vec<u8>,
    route: Route,
    code: ErrorCode,
    invalid: &Invalid,
) -> Outgoing {
    let properties: BasicProperties = crate::amqp::publish::with_dead_letter_time(with_header(
        with_header(
            without_expiration(&delivery.properties),
            ERROR_CODE_HEADER,
            code.as_str(),
        ),
        ERROR_HEADER,
        &invalid.message,
    ));
    Outgoing {
        exchange: DLX.into(),
        routing_key: route.queue.into(),
        body,
        properties,
        mandatory: true,
    }
}

/// Publishes `delivery` to its dead-letter queue with the reason headers and
/// waits for the confirm; the caller acks the original afterwards. Replies
/// `rejected` when the request asked for a reply.
pub async fn publish_dead_letter(
    publisher: &Publisher,
    replier: &Replier,
    delivery: &Delivery,
    route: Route,
    invalid: &Invalid,
) -> Result<(), crate::amqp::publish::PublishError> {
    publish_dead_letter_as(
        publisher,
        replier,
        delivery,
        route,
        ErrorCode::InvalidRequest,
        invalid,
    )
    .await
}

/// [`publish_dead_letter`] with the error `code` of the headers and reply
/// (`internal` for a permanent failure).
///
/// The dead letter is confirmed before the reply is published, so a request
/// is never answered while its dead letter may still be lost; the reply
/// carries the request's id whenever the body had a usable one.
pub async fn publish_dead_letter_as(
    publisher: &Publisher,
    replier: &Replier,
    delivery: &Delivery,
    route: Route,
    code: ErrorCode,
    invalid: &Invalid,
) -> Result<(), crate::amqp::publish::PublishError> {
    publisher
        .publish(dead_letter_message(
            delivery,
            delivery.data.clone(),
            route,
            code,
            invalid,
        ))
        .await?;
    if let Some(reply) = rejected_reply_message(delivery, code, invalid) {
        if replier.send(vec![reply]).await == Sent::GivenUp {
            tracing::warn!("the rejected reply could not be delivered; its requester is gone");
        }
    }
    Ok(())
}

/// Dead-letters one part of `delivery` (an entry of a batch) as a message of
/// its own, with `delivery`'s properties and the reason headers. No reply:
/// the rest of the delivery still succeeds.
pub async fn publish_dead_letter_part(
    publisher: &Publisher,
    delivery: &Delivery,
    body: Vec<u8>,
    route: Route,
    invalid: &Invalid,
) -> Result<(), crate::amqp::publish::PublishError> {
    let mut message =
        dead_letter_message(delivery, body, route, ErrorCode::InvalidRequest, invalid);
    message.properties = message
        .properties
        .with_reply_to("".into())
        .with_correlation_id("".into());
    publisher.publish(message).await
}

/// Hands `delivery` back to the broker: a copy goes to its queue's retry
/// queue, and the original is acked once the copy is confirmed. Requeued
/// instead when the session no longer answers (the ack might be lost in
/// the close, and the copy would be a second request) or the copy could
/// not be published.
pub(super) async fn hand_back<H: Handler>(
    shared: &Shared<H>,
    delivery: &Delivery,
    why: &str,
) -> Ended {
    let route = shared.handler.route();
    let (retries, since) = handed_back(delivery);
    let failing = std::time::Duration::from_millis(unix_ms().saturating_sub(since));
    if failing < shared.config.transient_retry {
        tracing::warn!(
            error = why,
            retries,
            "a dependency is failing; handing the delivery back"
        );
    } else {
        tracing::error!(
            error = why,
            retries,
            ?failing,
            "a dependency is still failing; handing the delivery back"
        );
    }
    let gate = shared.groupers.closed.clone().read_owned().await;
    if *gate {
        return ("requeued", Settle::Requeue, None);
    }
    let copy = retry_message(delivery, route, retries + 1, since);
    match shared.publisher.publish(copy).await {
        Ok(()) => {
            metrics::counter!("prizepool_handed_back_total", "queue" => route.queue).increment(1);
            ("handed_back", Settle::Ack, Some(gate))
        }
        Err(error) => {
            tracing::error!(%error, "could not hand the delivery back; requeueing");
            ("requeued", Settle::Requeue, None)
        }
    }
}

/// How many times `delivery` was handed back before, and since when (unix
/// milliseconds) it has been failing: now for a first failure.
fn handed_back(delivery: &Delivery) -> (i64, u64) {
    let headers = delivery.properties.headers().as_ref();
    let number = |name: &str| match headers?.inner().get(name)? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        _ => None,
    };
    let retries = number(RETRIES_HEADER).unwrap_or(0).max(0);
    let since = number(FAILING_SINCE_HEADER)
        .and_then(|ms| u64::try_from(ms).ok())
        .unwrap_or_else(unix_ms);
    (retries, since)
}

/// The copy of `delivery` handed back through `route`'s retry queue: the
/// same body and properties, with the retry headers, and without an
/// `expiration` (an expired request would be dead-lettered; its answer is
/// stored for its requester whenever it comes).
fn retry_message(delivery: &Delivery, route: Route, retries: i64, since: u64) -> Outgoing {
    let properties = crate::amqp::publish::without_expiration(&delivery.properties);
    let mut headers: FieldTable = properties.headers().clone().unwrap_or_default();
    headers.insert(RETRIES_HEADER.into(), AMQPValue::LongLongInt(retries));
    headers.insert(
        FAILING_SINCE_HEADER.into(),
        AMQPValue::LongLongInt(i64::try_from(since).unwrap_or(i64::MAX)),
    );
    Outgoing {
        exchange: String::new(),
        routing_key: crate::amqp::retry_queue(route),
        body: delivery.data.clone(),
        properties: properties.with_headers(headers),
        mandatory: true,
    }
}

/// Now, in unix milliseconds.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

//! Domain types shared by the store, the destinations, dispatch and the relay: identities that must not be
//! mixed up, a claimed message (with its creation trace context), and the outcome a destination
//! reports for it.

use std::fmt;

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// The stable identity of a message; every delivery of it carries this id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OutboxId(pub Uuid);

/// The token of one lease; a completion must present the current one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseToken(pub Uuid);

/// The identity a worker claims under (`claimed_by`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WorkerId(String);

impl WorkerId {
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for OutboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A message leased to this worker by `claim_outbox_batch_seq`.
#[derive(Clone, Debug)]
pub struct ClaimedMessage {
    pub id: OutboxId,
    pub lease_token: LeaseToken,
    pub topic: String,
    pub key: Option<String>,
    /// The message's place in enqueue order (`outbox.messages.seq`): increasing within a
    /// key, kept by every redelivery; sent with keyed messages as their per-key sequence.
    pub seq: i64,
    pub payload: Vec<u8>,
    pub content_type: String,
    pub headers: serde_json::Value,
    /// The number this attempt will be recorded under (1 for a first delivery).
    pub attempt_no: i32,
    pub created_at: DateTime<Utc>,
    pub lease_expires_at: DateTime<Utc>,
    /// The payload's size as stored.
    pub payload_bytes: i64,
    /// The payload was larger than the claim's `max_message_bytes` and was not loaded
    /// (`payload` is empty); the message is dead-lettered without being published.
    pub payload_withheld: bool,
    /// `Some` when dispatch has put the send span's context in `headers` for one delivery
    /// attempt (export on), holding the creation context it replaced (`Some(None)`: the
    /// message had none); `None` when `headers` are as the producer wrote them. See
    /// [`ClaimedMessage::creation_context`].
    pub origin: Option<Option<TraceContext>>,
}

#[cfg(test)]
impl ClaimedMessage {
    /// A message on topic `t` with `headers`, as a claim would return it (for unit tests).
    pub(crate) fn example(headers: serde_json::Value) -> Self {
        ClaimedMessage {
            id: OutboxId(Uuid::now_v7()),
            lease_token: LeaseToken(Uuid::new_v4()),
            topic: "t".into(),
            key: None,
            seq: 1,
            payload: Vec::new(),
            content_type: "application/json".into(),
            headers,
            attempt_no: 1,
            created_at: Utc::now(),
            lease_expires_at: Utc::now(),
            payload_bytes: 0,
            payload_withheld: false,
            origin: None,
        }
    }
}

/// A W3C Trace Context (level 1): the `traceparent` of the span that created a message, and
/// the vendors' `tracestate` that goes with it (docs/tracing.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// `00-<trace id: 32 hex>-<parent id: 16 hex>-<flags: 2 hex>`, lower case, neither id
    /// all zeros.
    pub traceparent: String,
    /// The list of `key=value` members, as given.
    pub tracestate: Option<String>,
}

impl TraceContext {
    /// The context of `traceparent` (and `tracestate`), or `None` when `traceparent` is not
    /// a version 00 traceparent. `outbox.enqueue` checks both in full (03_enqueue.sql)
    /// when they come from its arguments or settings; this reads what a message carries,
    /// which a producer may also have put in its headers itself, unchecked.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<TraceContext> {
        let parts: Vec<&str> = traceparent.split('-').collect();
        let hex = |s: &str, len: usize| {
            s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        let well_formed = matches!(parts.as_slice(), [version, trace, parent, flags]
            if *version == "00"
                && hex(trace, 32)
                && hex(parent, 16)
                && hex(flags, 2)
                && trace.bytes().any(|b| b != b'0')
                && parent.bytes().any(|b| b != b'0'));
        well_formed.then(|| TraceContext {
            traceparent: traceparent.to_owned(),
            tracestate: tracestate.filter(|s| !s.is_empty()).map(str::to_owned),
        })
    }

    /// The trace id: 32 lower-case hex digits.
    pub fn trace_id(&self) -> &str {
        &self.traceparent[3..35]
    }

    /// The id of the span that created the message: 16 lower-case hex digits.
    pub fn parent_id(&self) -> &str {
        &self.traceparent[36..52]
    }

    /// Whether the producer's span was sampled (flag 01).
    pub fn sampled(&self) -> bool {
        u8::from_str_radix(&self.traceparent[53..55], 16).is_ok_and(|f| f & 1 == 1)
    }
}

impl ClaimedMessage {
    /// What the message keeps order with within a part: its key on its topic. A claim's run
    /// is a key's messages of one topic (`claim_outbox_batch_seq`), so a key's messages on
    /// two topics in one part are two heads, whatever the key's scope: chained, the second
    /// would wait for the first, and with the key ordered per topic it must not.
    pub fn order_key(&self) -> Option<(&str, &str)> {
        self.key.as_deref().map(|k| (k, self.topic.as_str()))
    }

    /// The outcome of a message not sent because an earlier message of its key in the
    /// part was not delivered ([`Outcome::behind_undelivered`] of its key).
    pub fn behind_undelivered(&self) -> Outcome {
        Outcome::behind_undelivered(self.key.as_deref().unwrap_or_default())
    }

    /// The trace context to send in the transport's headers, from the headers
    /// `traceparent` and `tracestate`: the creation context the producer stored (where
    /// `outbox.enqueue` puts the context of its arguments or of the producer's
    /// `SET LOCAL outbox.traceparent`), or, with span export on, the context of this
    /// attempt's `send` span, which dispatch puts there in its place (the current hop).
    /// `None` when there is no `traceparent` header, or one that is not a string holding a
    /// version 00 traceparent.
    pub fn trace_context(&self) -> Option<TraceContext> {
        let text = |name: &str| self.headers.get(name).and_then(serde_json::Value::as_str);
        TraceContext::parse(text("traceparent")?, text("tracestate"))
    }

    /// The context captured when the message was created (the producer's), never the
    /// current hop: what a destination that also carries the origin in the body (the
    /// CloudEvents `traceparent` extension) writes there, and what the `send` spans link
    /// to.
    pub fn creation_context(&self) -> Option<TraceContext> {
        match &self.origin {
            Some(origin) => origin.clone(),
            None => self.trace_context(),
        }
    }
}

/// What a destination did with one message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Acknowledged by the destination.
    Delivered,
    /// A transient failure (timeout, connection loss, 5xx, NACK); try again later.
    /// `retry_after` is the destination's own hint, when it gave one.
    Retryable {
        reason: String,
        retry_after: Option<std::time::Duration>,
    },
    /// Rejected for good (malformed, unroutable, 4xx); dead-letter it with the reason.
    Permanent { reason: String },
    /// Sent, and no answer came (timed out, or the connection was lost after the request
    /// went out): the destination may have it. An attempt, recorded as RETRYABLE like
    /// [`Outcome::Retryable`], that spends the attempt budget whatever the circuit does with
    /// the rest of its batch, so that `max_attempts` ends the resending of a message a slow
    /// destination keeps taking late.
    Unanswered { reason: String },
    /// Not tried, or not counted as tried: it was never sent (its destination's circuit is
    /// open, the batch's publish window closed or its dispatch deadline was near), or the
    /// whole batch failed before anything was sent and this message was not the one
    /// charged for it. Given back to the queue without an attempt.
    NotAttempted { reason: String },
}

impl Outcome {
    /// The outcome of a message of key `key` not sent because an earlier message of the key
    /// was not delivered: given back without an attempt, it waits for that one.
    pub fn behind_undelivered(key: &str) -> Outcome {
        Outcome::NotAttempted {
            reason: format!("an earlier message of key {key:?} was not delivered"),
        }
    }
}

/// The attempt states a worker may report (`outbox.attempt_state` minus `ZOMBIE_REQUEUE`,
/// which only `repair_expired_leases` records).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptState {
    Dispatched,
    Failed,
    Retryable,
}

impl AttemptState {
    pub fn as_sql(self) -> &'static str {
        match self {
            AttemptState::Dispatched => "DISPATCHED",
            AttemptState::Failed => "FAILED",
            AttemptState::Retryable => "RETRYABLE",
        }
    }
}

/// One row of a `complete_outbox_batch` call.
#[derive(Clone, Debug)]
pub struct Completion {
    pub id: OutboxId,
    pub lease_token: LeaseToken,
    pub state: AttemptState,
    pub error: Option<String>,
    pub retry_at: Option<DateTime<Utc>>,
}

/// The database's answer for one completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompletionResult {
    pub id: OutboxId,
    /// The attempt number recorded; `None` when the lease was lost.
    pub attempt_no: Option<i32>,
    pub lease_lost: bool,
    /// The message went to dead letters: refused for good, or its last retry failed.
    pub dead_lettered: bool,
}

/// A message to enqueue ([`crate::store::enqueue`]).
#[derive(Clone, Debug, Default)]
pub struct NewMessage {
    pub topic: String,
    /// Messages with the same key are delivered one at a time, in enqueue order.
    pub key: Option<String>,
    pub payload: Payload,
    /// A JSON object of header names to values, sent as the destination's headers.
    pub headers: Option<serde_json::Value>,
    /// Not before this time (default: now).
    pub available_at: Option<DateTime<Utc>>,
    /// The producer's own id (default: a new UUIDv7); an id used before is refused.
    pub id: Option<OutboxId>,
    /// Attempts before the message is dead-lettered (default 10).
    pub max_attempts: Option<i32>,
    /// The creation context, stored as the headers `traceparent` and `tracestate` in place
    /// of those of `headers` (default: the transaction's `outbox.traceparent` setting, else
    /// the headers as given). Checked by `outbox.enqueue`, which refuses a malformed one.
    pub trace: Option<TraceContext>,
}

/// A message's payload: a JSON document (stored as its text, content type
/// `application/json`) or bytes with their content type.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    Json(serde_json::Value),
    Bytes { data: Vec<u8>, content_type: String },
}

impl Default for Payload {
    fn default() -> Self {
        Payload::Json(serde_json::Value::Object(serde_json::Map::new()))
    }
}

impl From<serde_json::Value> for Payload {
    fn from(value: serde_json::Value) -> Self {
        Payload::Json(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn a_trace_context_reads_its_ids_and_flags() {
        let t = TraceContext::parse(TRACEPARENT, Some("congo=t61")).unwrap();
        assert_eq!(t.trace_id(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(t.parent_id(), "b7ad6b7169203331");
        assert!(t.sampled());
        assert_eq!(t.tracestate.as_deref(), Some("congo=t61"));
        let unsampled = TraceContext::parse(&TRACEPARENT.replace("-01", "-02"), Some("")).unwrap();
        assert!(!unsampled.sampled());
        assert_eq!(unsampled.tracestate, None);
    }

    #[test]
    fn a_malformed_traceparent_is_no_trace_context() {
        for bad in [
            "",
            "00-x",
            &TRACEPARENT.to_uppercase(),
            &TRACEPARENT.replacen("00-", "01-", 1),
            &format!("{TRACEPARENT}-00"),
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-011",
        ] {
            assert_eq!(TraceContext::parse(bad, None), None, "{bad:?}");
        }
    }

    #[test]
    fn a_claimed_message_gives_the_trace_context_of_its_headers() {
        let m = ClaimedMessage::example(
            serde_json::json!({"traceparent": TRACEPARENT, "tracestate": "a=b", "x": "1"}),
        );
        assert_eq!(
            m.trace_context(),
            Some(TraceContext {
                traceparent: TRACEPARENT.into(),
                tracestate: Some("a=b".into())
            })
        );
        for headers in [
            serde_json::json!({}),
            serde_json::Value::Null,
            serde_json::json!({"traceparent": 7}),
            serde_json::json!({"traceparent": "00-x", "tracestate": "a=b"}),
        ] {
            assert_eq!(
                ClaimedMessage::example(headers.clone()).trace_context(),
                None,
                "{headers}"
            );
        }
    }
}

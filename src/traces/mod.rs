//! Traces of a message's delivery (issue 54): one `send {destination}` span per delivery
//! attempt, linked to the message's creation context (the producer's W3C `traceparent`,
//! kept in its headers), exported over OTLP when turned on. Off by default: then no span is
//! made and the headers pass through unchanged, so export costs nothing unless asked for.
//!
//! `settings.rs` reads the `OTEL_*` variables and the config file's `[tracing]`;
//! `export.rs` builds the OTLP exporter and the tracer; this file makes the spans and the
//! copy of a message that carries the send span's context as its current hop.

mod export;
mod settings;

pub use export::{Exporting, install};
pub use settings::{ExportSettings, Protocol, SamplerSetting, TraceSettings, TracingTable};

use std::collections::HashMap;
use std::time::SystemTime;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanKind, Status, TraceContextExt, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, Span};

use crate::message::{ClaimedMessage, Outcome};

/// Makes the spans of one process; cloned into every dispatcher.
#[derive(Clone, Debug)]
pub struct Spans {
    tracer: SdkTracer,
    parent_first_attempt: bool,
}

/// The `messaging.system` and `messaging.operation.name` of a destination type: the
/// registered values of the semantic conventions where they exist (`kafka`, `rabbitmq`,
/// `aws_sqs`, `aws.sns`, `gcp_pubsub`), our own for the others (docs/tracing.md lists them).
pub fn messaging_system(kind: &str) -> (&'static str, &'static str) {
    match kind {
        "kafka" => ("kafka", "send"),
        "amqp" => ("rabbitmq", "publish"),
        "sqs" => ("aws_sqs", "SendMessageBatch"),
        "sns" => ("aws.sns", "PublishBatch"),
        "pubsub" => ("gcp_pubsub", "publish"),
        "nats" => ("nats", "publish"),
        "redis" => ("redis", "xadd"),
        "mqtt" => ("mqtt", "publish"),
        "kinesis" => ("aws_kinesis", "PutRecords"),
        "eventbridge" => ("aws_eventbridge", "PutEvents"),
        "http" => ("http", "POST"),
        "file" => ("file", "write"),
        "stdout" => ("stdout", "write"),
        "null" => ("null", "discard"),
        _ => ("outbox_relay", "send"),
    }
}

/// The `send` spans of one call of a destination, one per message, and the messages as the
/// destination is to send them (their headers carrying each span's context).
pub struct SendSpans {
    spans: Vec<Span>,
    pub messages: Vec<ClaimedMessage>,
}

/// The creation context stored in `m`'s headers, when it is a valid W3C `traceparent`.
fn creation_span_context(m: &ClaimedMessage) -> Option<SpanContext> {
    let creation = m.creation_context()?;
    let mut carrier = HashMap::with_capacity(2);
    carrier.insert("traceparent".to_owned(), creation.traceparent);
    if let Some(state) = creation.tracestate {
        carrier.insert("tracestate".to_owned(), state);
    }
    let cx = TraceContextPropagator::new().extract(&carrier);
    let sc = cx.span().span_context().clone();
    sc.is_valid().then_some(sc)
}

/// The W3C `traceparent` of `sc`.
fn traceparent(sc: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    )
}

impl Spans {
    pub fn new(tracer: SdkTracer, parent_first_attempt: bool) -> Self {
        Self {
            tracer,
            parent_first_attempt,
        }
    }

    /// Starts a `send {destination}` span (kind PRODUCER) for each of `messages`, about to
    /// be sent in one call of `destination` (of type `kind`), each linked to its message's
    /// creation context (and its child on a first attempt with `parent_first_attempt`), and
    /// copies the messages with `traceparent`/`tracestate` in their headers replaced by the
    /// span's, keeping the creation context in [`ClaimedMessage::origin`]. A span that is
    /// not sampled leaves its message's headers as they were.
    pub fn start(&self, destination: &str, kind: &str, messages: &[ClaimedMessage]) -> SendSpans {
        let (system, operation) = messaging_system(kind);
        let name = format!("send {destination}");
        let batch = messages.len();
        let mut spans = Vec::with_capacity(batch);
        let mut copies = Vec::with_capacity(batch);
        for m in messages {
            let creation = creation_span_context(m);
            let mut attributes = vec![
                KeyValue::new("messaging.system", system),
                KeyValue::new("messaging.operation.type", "send"),
                KeyValue::new("messaging.operation.name", operation),
                KeyValue::new("messaging.destination.name", m.topic.clone()),
                KeyValue::new("messaging.message.id", m.id.to_string()),
                KeyValue::new("messaging.message.body.size", m.payload_bytes),
                KeyValue::new("outbox.destination", destination.to_owned()),
                KeyValue::new("outbox.attempt", i64::from(m.attempt_no)),
            ];
            if batch > 1 {
                attributes.push(KeyValue::new(
                    "messaging.batch.message_count",
                    i64::try_from(batch).unwrap_or(i64::MAX),
                ));
            }
            if let Some(key) = &m.key {
                attributes.push(KeyValue::new(
                    "messaging.message.conversation_id",
                    key.clone(),
                ));
            }
            let mut builder = self
                .tracer
                .span_builder(name.clone())
                .with_kind(SpanKind::Producer)
                .with_attributes(attributes);
            let parent = match &creation {
                Some(sc) => {
                    builder = builder.with_links(vec![Link::with_context(sc.clone())]);
                    if self.parent_first_attempt && m.attempt_no == 1 {
                        Context::new().with_remote_span_context(sc.clone())
                    } else {
                        Context::new()
                    }
                }
                None => Context::new(),
            };
            let span = builder.start_with_context(&self.tracer, &parent);
            let mut copy = m.clone();
            let sc = span.span_context();
            if sc.is_sampled() {
                let origin = m.creation_context();
                let mut headers = match &m.headers {
                    serde_json::Value::Object(o) => o.clone(),
                    _ => serde_json::Map::new(),
                };
                headers.insert("traceparent".into(), traceparent(sc).into());
                let state = sc.trace_state().header();
                if state.is_empty() {
                    headers.remove("tracestate");
                } else {
                    headers.insert("tracestate".into(), state.into());
                }
                // Headers that are not an object are refused by the destination as they
                // are: leave them so.
                if m.headers.is_object() || m.headers.is_null() {
                    copy.headers = serde_json::Value::Object(headers);
                    copy.origin = Some(origin);
                }
            }
            spans.push(span);
            copies.push(copy);
        }
        SendSpans {
            spans,
            messages: copies,
        }
    }
}

impl Spans {
    /// A span (kind CLIENT) for a call of the SQL API function `function` that `worker`
    /// sent at `started` and that has just answered, for `messages` messages, or failed
    /// with `error`. The relay makes one for each claim that returned messages (an empty
    /// poll makes none) and for each batch completion.
    pub fn leasing_call(
        &self,
        function: &'static str,
        worker: &str,
        started: SystemTime,
        messages: usize,
        error: Option<&str>,
    ) {
        let mut span = self
            .tracer
            .span_builder(function)
            .with_kind(SpanKind::Client)
            .with_start_time(started)
            .with_attributes(vec![
                KeyValue::new("db.system.name", "postgresql"),
                KeyValue::new("db.operation.name", function),
                KeyValue::new("outbox.worker_id", worker.to_owned()),
                KeyValue::new(
                    "messaging.batch.message_count",
                    i64::try_from(messages).unwrap_or(i64::MAX),
                ),
            ])
            .start_with_context(&self.tracer, &Context::new());
        if let Some(error) = error {
            span.set_attribute(KeyValue::new("error.type", "database"));
            span.set_status(Status::error(error.to_owned()));
        }
        span.end();
    }
}

impl SendSpans {
    /// Ends each span with its message's outcome: nothing more for a delivery; otherwise
    /// `error.type` (`retryable`, `unanswered`, `permanent` or `not_attempted`), the
    /// reason as the error status and `outbox.outcome`.
    pub fn end(self, outcomes: &[Outcome]) {
        for (mut span, outcome) in self.spans.into_iter().zip(outcomes) {
            let (kind, reason) = match outcome {
                Outcome::Delivered => {
                    span.set_attribute(KeyValue::new("outbox.outcome", "delivered"));
                    span.end();
                    continue;
                }
                Outcome::Retryable { reason, .. } => ("retryable", reason),
                Outcome::Unanswered { reason } => ("unanswered", reason),
                Outcome::Permanent { reason } => ("permanent", reason),
                Outcome::NotAttempted { reason } => ("not_attempted", reason),
            };
            span.set_attribute(KeyValue::new("outbox.outcome", kind));
            span.set_attribute(KeyValue::new("error.type", kind));
            span.set_status(Status::error(reason.clone()));
            span.end();
        }
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::SdkTracerProvider;

    use super::*;

    /// A context as its two header values, for comparisons.
    fn pair(t: Option<crate::message::TraceContext>) -> Option<(String, Option<String>)> {
        t.map(|t| (t.traceparent, t.tracestate))
    }

    const PRODUCER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn spans(parent_first_attempt: bool) -> Spans {
        let provider = SdkTracerProvider::builder().build();
        Spans::new(provider.tracer("test"), parent_first_attempt)
    }

    #[test]
    fn the_copy_carries_the_send_span_as_its_hop_and_keeps_the_creation_context() {
        let m = ClaimedMessage::example(serde_json::json!({
            "traceparent": PRODUCER,
            "tracestate": "shop=1",
            "x-tenant": "acme",
        }));
        assert_eq!(
            pair(m.trace_context()),
            Some((PRODUCER.to_owned(), Some("shop=1".to_owned())))
        );
        let send = spans(false).start("hooks", "http", std::slice::from_ref(&m));
        let copy = &send.messages[0];
        let (hop, state) = pair(copy.trace_context()).unwrap();
        // A root of its own (linked, not parented): another trace, and no tracestate of
        // the producer's trace.
        assert_ne!(hop, PRODUCER);
        assert!(!hop.contains("4bf92f3577b34da6a3ce929d0e0e4736"), "{hop}");
        assert!(hop.starts_with("00-") && hop.ends_with("-01"), "{hop}");
        assert_eq!(state, None);
        assert_eq!(
            pair(copy.creation_context()),
            Some((PRODUCER.to_owned(), Some("shop=1".to_owned())))
        );
        assert_eq!(copy.headers["x-tenant"], "acme");
        // The claimed message itself is left as it was.
        assert_eq!(m.origin, None);
        assert_eq!(
            pair(m.trace_context()),
            Some((PRODUCER.to_owned(), Some("shop=1".to_owned())))
        );
        send.end(&[Outcome::Delivered]);
    }

    #[test]
    fn a_first_attempt_continues_the_producers_trace_when_parented_and_a_retry_does_not() {
        let mut m = ClaimedMessage::example(serde_json::json!({ "traceparent": PRODUCER }));
        let first = spans(true).start("hooks", "http", std::slice::from_ref(&m));
        let (hop, _) = pair(first.messages[0].trace_context()).unwrap();
        assert!(
            hop.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
            "{hop}"
        );
        assert_ne!(hop, PRODUCER);
        m.attempt_no = 2;
        let retry = spans(true).start("hooks", "http", std::slice::from_ref(&m));
        let (hop, _) = pair(retry.messages[0].trace_context()).unwrap();
        assert!(!hop.contains("4bf92f3577b34da6a3ce929d0e0e4736"), "{hop}");
    }

    #[test]
    fn a_message_without_a_valid_context_gets_a_hop_and_no_creation_context() {
        for headers in [
            serde_json::Value::Null,
            serde_json::json!({ "traceparent": "00-not-a-context" }),
        ] {
            let m = ClaimedMessage::example(headers);
            let send = spans(false).start("hooks", "kafka", std::slice::from_ref(&m));
            let copy = &send.messages[0];
            assert!(pair(copy.trace_context()).is_some());
            // The creation context stays what the message held, valid or not.
            assert_eq!(pair(copy.creation_context()), pair(m.trace_context()));
        }
        // Headers that are not an object are left for the destination to refuse.
        let m = ClaimedMessage::example(serde_json::json!(["x"]));
        let send = spans(false).start("hooks", "http", std::slice::from_ref(&m));
        assert_eq!(send.messages[0].headers, serde_json::json!(["x"]));
    }

    #[test]
    fn each_destination_type_has_its_messaging_system() {
        assert_eq!(messaging_system("amqp").0, "rabbitmq");
        assert_eq!(messaging_system("sqs").0, "aws_sqs");
        assert_eq!(messaging_system("sns").0, "aws.sns");
        assert_eq!(messaging_system("pubsub").0, "gcp_pubsub");
        assert_eq!(messaging_system("kinesis").0, "aws_kinesis");
        for kind in crate::destination::DestinationConfig::KINDS {
            assert_ne!(
                messaging_system(kind).0,
                "outbox_relay",
                "{kind} has no system"
            );
        }
    }
}

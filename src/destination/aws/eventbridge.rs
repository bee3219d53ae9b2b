//! The `eventbridge` destination: Amazon EventBridge `PutEvents` to an event bus, in calls
//! of at most 10 entries and 256 KiB, each entry's result its own message's outcome. The
//! event's `source` and `detail-type` come from templates (`{topic}` replaced); its
//! `detail` is the message as one JSON object, the same as a line of the `file` destination,
//! so the outbox_id travels inside the event (`detail.outbox_id`): PutEvents does not let a
//! sender choose the event's `id`. The event's `time` is the message's enqueue time. A
//! message with a trace context has it in `detail.headers` (`traceparent`, `tracestate`:
//! the creation context, or the attempt's `send` span with span export on), and as the
//! entry's `TraceHeader` in AWS X-Ray's form, which EventBridge passes on to targets that
//! take one (Lambda, Step Functions, …).

use std::time::Duration;

use aws_sdk_eventbridge::Client;
use aws_sdk_eventbridge::primitives::DateTime;
use aws_sdk_eventbridge::types::PutEventsRequestEntry;
use futures_util::future::BoxFuture;

use super::{
    Endpoint, Lazy, Prepared, call_failed, concurrency, expand, finish, positional, send_in_calls,
    template,
};
use crate::destination::jsonl::envelope;
use crate::destination::{Destination, Setting, Window};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome, TraceContext};

/// Entries per `PutEvents` call.
const MAX_ENTRIES: usize = 10;
/// Bytes per call, as EventBridge counts an entry (time, source, detail-type, detail).
const MAX_CALL_BYTES: usize = 256 * 1024;

/// The X-Ray trace header of a W3C trace context, as OpenTelemetry's X-Ray propagator
/// writes it: the trace id's first 8 hex digits are X-Ray's epoch part, the other 24 its
/// unique part (`Root=1-<8>-<24>;Parent=<16>;Sampled=<0|1>`).
fn xray_trace_header(trace: &TraceContext) -> String {
    let id = trace.trace_id();
    format!(
        "Root=1-{}-{};Parent={};Sampled={}",
        &id[..8],
        &id[8..],
        trace.parent_id(),
        u8::from(trace.sampled())
    )
}

/// `type = "eventbridge"`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventBridgeConfig {
    /// Event bus name or ARN [default: `default`].
    pub event_bus: Option<String>,
    /// The events' `source`, `{topic}` replaced [default: `outbox-relay`].
    pub source: Option<String>,
    /// The events' `detail-type`, `{topic}` replaced [default: `{topic}`].
    pub detail_type: Option<String>,
    /// AWS region [default: the SDK's chain: AWS_REGION, the profile].
    pub region: Option<String>,
    /// Endpoint override (a local EventBridge-compatible server, a VPC endpoint).
    pub endpoint_url: Option<String>,
    /// PutEvents calls in flight per batch, 1..=64 [default: 8].
    pub concurrency: Option<i64>,
}

impl EventBridgeConfig {
    pub(in crate::destination) fn build(
        &self,
        at: Setting<'_>,
        deadline: Duration,
    ) -> Result<EventBridge, ConfigError> {
        Ok(EventBridge {
            event_bus: template(at, "event_bus", self.event_bus.as_deref(), "default")?,
            source: template(at, "source", self.source.as_deref(), "outbox-relay")?,
            detail_type: template(at, "detail_type", self.detail_type.as_deref(), "{topic}")?,
            client: Lazy::new(Endpoint::new(
                at,
                self.region.as_deref(),
                self.endpoint_url.as_deref(),
                deadline,
            )?),
            concurrency: concurrency(at, self.concurrency)?,
            deadline,
        })
    }
}

pub struct EventBridge {
    client: Lazy<Client>,
    event_bus: String,
    source: String,
    detail_type: String,
    concurrency: usize,
    /// The dispatch deadline of a batch.
    deadline: Duration,
}

impl EventBridge {
    /// The entry of `m` and its size, or why it cannot be sent.
    fn entry(
        &self,
        index: usize,
        m: &ClaimedMessage,
    ) -> Result<Prepared<PutEventsRequestEntry>, String> {
        let detail = String::from_utf8(envelope(m)?)
            .map_err(|_| "the event detail is not UTF-8".to_owned())?;
        let source = expand(&self.source, m);
        let detail_type = expand(&self.detail_type, m);
        // EventBridge counts 14 bytes for the time.
        let bytes = 14 + source.len() + detail_type.len() + detail.len();
        let entry = PutEventsRequestEntry::builder()
            .event_bus_name(&self.event_bus)
            .source(source)
            .detail_type(detail_type)
            .detail(detail)
            .time(DateTime::from_millis(m.created_at.timestamp_millis()))
            .set_trace_header(m.trace_context().map(|t| xray_trace_header(&t)))
            .build();
        Ok(Prepared {
            index,
            bytes,
            entry,
        })
    }
}

impl Destination for EventBridge {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let client = match self.client.get(Client::new).await {
                Ok(c) => c,
                Err(reason) => {
                    return vec![
                        Outcome::Retryable {
                            reason,
                            retry_after: None
                        };
                        batch.len()
                    ];
                }
            };
            let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
            let mut prepared = Vec::with_capacity(batch.len());
            for (index, m) in batch.iter().enumerate() {
                match self.entry(index, m) {
                    Ok(p) => prepared.push((self.event_bus.clone(), p)),
                    Err(reason) => outcomes[index] = Some(Outcome::Permanent { reason }),
                }
            }
            send_in_calls(
                &mut outcomes,
                batch,
                prepared,
                MAX_ENTRIES,
                MAX_CALL_BYTES,
                self.concurrency,
                self.deadline,
                window,
                |bus, entries| {
                    let client = client.clone();
                    async move {
                        let ids: Vec<usize> = entries.iter().map(|(i, _)| *i).collect();
                        let answer = client
                            .put_events()
                            .set_entries(Some(entries.into_iter().map(|(_, e)| e).collect()))
                            .send()
                            .await
                            .map_err(|e| {
                                call_failed(&format!("eventbridge PutEvents {bus}"), &e)
                            })?;
                        // One result per entry, in the order of the request.
                        Ok(positional(
                            "eventbridge PutEvents",
                            ids,
                            answer
                                .entries()
                                .iter()
                                .map(|r| (r.error_code(), r.error_message())),
                        ))
                    }
                },
            )
            .await;
            finish("eventbridge PutEvents", outcomes)
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { self.client.get(Client::new).await.map(|_| ()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trace_header_is_the_trace_context_in_x_rays_form() {
        let sampled = TraceContext::parse(
            "00-5759e988bd862e3fe1be46a994272793-53995c3f42cd8ad8-01",
            Some("congo=t61"),
        )
        .unwrap();
        assert_eq!(
            xray_trace_header(&sampled),
            "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1"
        );
        let unsampled = TraceContext::parse(
            "00-5759e988bd862e3fe1be46a994272793-53995c3f42cd8ad8-00",
            None,
        )
        .unwrap();
        assert!(xray_trace_header(&unsampled).ends_with(";Sampled=0"));
    }
}

//! The `nats` destination: JetStream publish to a subject template (`{topic}` replaced)
//! with `Nats-Msg-Id` = outbox_id, so the stream's duplicate window drops a redelivery.
//! The message's own headers travel as NATS headers, with the outbox metadata
//! (`outbox-id`, `outbox-topic`, `outbox-key`, `outbox-seq`, `outbox-attempt`) and
//! `Content-Type` beside them; a header NATS cannot carry makes that message permanent. A message is delivered
//! when its PubAck arrives (a duplicate ack counts: the stream has it). No stream for the
//! subject is permanent; timeouts and connection loss are retryable. With the CloudEvents
//! envelope, the attributes go as `ce-` headers (binary) or the payload is the JSON event.

use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind};
use futures_util::future::BoxFuture;

use super::cloudevents::{self, Envelope, Mode, STRUCTURED_CONTENT_TYPE, percent_encode};
use super::{Destination, Setting, Window, metadata, user_headers};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};
use crate::secret::redact_url;

/// `type = "nats"`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// Comma-separated server addresses [default: nats://127.0.0.1:4222].
    pub url: Option<String>,
    /// Subject template [default: `{topic}`].
    pub subject: Option<String>,
    /// `"cloudevents"` to send each message as a CloudEvent [default: none].
    pub envelope: Option<String>,
    /// `"binary"` or `"structured"` [default: binary].
    pub cloudevents_mode: Option<String>,
    /// The CloudEvents `source` template [default: /outbox-relay].
    pub cloudevents_source: Option<String>,
    /// The CloudEvents `type` template [default: `{topic}`].
    pub cloudevents_type: Option<String>,
}

impl NatsConfig {
    /// Checks every server address with the client's own parser and for a path it would
    /// take for a host (`nats//host:4222`), so that a typo stops the start instead of every
    /// delivery.
    pub(super) fn build(&self, at: Setting<'_>, deadline: Duration) -> Result<Nats, ConfigError> {
        let url = self.url.as_deref().unwrap_or("nats://127.0.0.1:4222");
        if url.trim().is_empty() {
            return Err(at.invalid("url", "must not be empty"));
        }
        for server in url.split(',') {
            let address = server
                .trim()
                .parse::<async_nats::ServerAddr>()
                .map_err(|e| {
                    at.invalid(
                        "url",
                        format!(
                            "{:?} is not a NATS server address (nats://, tls://, ws:// or wss://): {e}",
                            redact_url(server.trim())
                        ),
                    )
                })?;
            // The client reads an address without `scheme://` as a host, so `nats//host:4222`
            // parses as host `nats` with the path `//host:4222`; a NATS address has no path.
            let parsed = address.into_inner();
            if matches!(parsed.scheme(), "nats" | "tls") && !matches!(parsed.path(), "" | "/") {
                return Err(at.invalid(
                    "url",
                    format!(
                        "{:?} is not a NATS server address: it has a path ({:?}) and a NATS \
                         address has none; write nats://HOST:PORT (is the colon of `nats://` \
                         missing?)",
                        redact_url(server.trim()),
                        parsed.path()
                    ),
                ));
            }
        }
        let subject = self.subject.as_deref().unwrap_or("{topic}");
        if subject.trim().is_empty() {
            return Err(at.invalid("subject", "must not be empty"));
        }
        let envelope = Envelope::from_settings(
            at,
            &cloudevents::Settings {
                envelope: self.envelope.as_deref(),
                mode: self.cloudevents_mode.as_deref(),
                source: self.cloudevents_source.as_deref(),
                kind: self.cloudevents_type.as_deref(),
            },
        )?;
        Ok(Nats {
            envelope,
            url: url.to_owned(),
            subject: subject.to_owned(),
            timeout: deadline,
            context: tokio::sync::Mutex::new(None),
        })
    }
}

pub struct Nats {
    url: String,
    subject: String,
    timeout: Duration,
    context: tokio::sync::Mutex<Option<jetstream::Context>>,
    envelope: Option<Envelope>,
}

impl Nats {
    async fn context(&self) -> Result<jetstream::Context, String> {
        let mut slot = self.context.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(self.timeout)
            .request_timeout(Some(self.timeout))
            .connect(&self.url)
            .await
            .map_err(|e| format!("nats connect {}: {e}", redact_url(&self.url)))?;
        let mut context = jetstream::new(client);
        context.set_timeout(self.timeout);
        *slot = Some(context.clone());
        Ok(context)
    }

    fn classify(&self, subject: &str, e: &jetstream::context::PublishError) -> Outcome {
        match e.kind() {
            PublishErrorKind::StreamNotFound => Outcome::Permanent {
                reason: format!("no JetStream stream captures subject {subject}"),
            },
            PublishErrorKind::MaxPayloadExceeded => Outcome::Permanent {
                reason: format!("message too large for the NATS server: {e}"),
            },
            _ => Outcome::Retryable {
                reason: format!("publish to {subject}: {e}"),
                retry_after: None,
            },
        }
    }
}

/// The NATS headers of `m`: its own, `Content-Type`, the CloudEvents attributes (binary
/// mode), then the outbox metadata; or why they cannot be sent.
fn headers(
    m: &ClaimedMessage,
    envelope: Option<&Envelope>,
) -> Result<async_nats::HeaderMap, String> {
    let mut headers = async_nats::HeaderMap::new();
    let mut insert = |name: &str, value: &str| -> Result<(), String> {
        let n: async_nats::HeaderName = name
            .parse()
            .map_err(|_| format!("header name {name:?} is not valid in NATS"))?;
        let v: async_nats::HeaderValue = value
            .parse()
            .map_err(|_| format!("header {name:?}: the value is not valid in NATS"))?;
        headers.insert(n, v);
        Ok(())
    };
    for (name, value) in user_headers(m)? {
        insert(name, &value)?;
    }
    match envelope {
        Some(e) if e.mode == Mode::Structured => insert("Content-Type", STRUCTURED_CONTENT_TYPE)?,
        Some(e) => {
            // The NATS binding: every attribute as a `ce-` header, percent-encoded.
            insert("Content-Type", &m.content_type)?;
            for (name, value) in e.headers(m, "ce-", true) {
                insert(&name, &percent_encode(&value))?;
            }
        }
        None => insert("Content-Type", &m.content_type)?,
    }
    for (name, value) in metadata(m) {
        insert(name, &value)?;
    }
    Ok(headers)
}

impl Destination for Nats {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let context = match self.context().await {
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
            // Send every message first, then collect the acks: one round trip per batch. One
            // deadline covers the whole batch, so a dead server costs one timeout, not one
            // per message.
            let deadline = tokio::time::Instant::now() + self.timeout;
            let mut pending = Vec::with_capacity(batch.len());
            for m in batch {
                let subject = self.subject.replace("{topic}", &m.topic);
                // Each publish is a request of its own (sending may wait on a reconnect).
                if let Err(not_sent) = window.check() {
                    pending.push((subject, Err(not_sent)));
                    continue;
                }
                let headers = match headers(m, self.envelope.as_ref()) {
                    Ok(h) => h,
                    Err(reason) => {
                        pending.push((subject, Err(Outcome::Permanent { reason })));
                        continue;
                    }
                };
                let payload = match &self.envelope {
                    Some(e) if e.mode == Mode::Structured => match e.structured(m) {
                        Ok(body) => body,
                        Err(reason) => {
                            pending.push((subject, Err(Outcome::Permanent { reason })));
                            continue;
                        }
                    },
                    _ => m.payload.clone(),
                };
                let publish = jetstream::message::PublishMessage::build()
                    .payload(payload.into())
                    .headers(headers)
                    .message_id(m.id.to_string());
                // While the client is reconnecting, sending waits: bound it like the ack.
                let sent = tokio::time::timeout_at(
                    deadline,
                    context.send_publish(subject.clone(), publish),
                )
                .await;
                pending.push((subject, Ok(sent)));
            }
            let timed_out = |subject: &str| Outcome::Retryable {
                reason: format!(
                    "publish to {subject}: timed out, no ack within {:?}",
                    self.timeout
                ),
                retry_after: None,
            };
            let mut outcomes = Vec::with_capacity(batch.len());
            for (subject, sent) in pending {
                outcomes.push(match sent {
                    Err(refused) => refused,
                    Ok(Err(_)) => timed_out(&subject),
                    Ok(Ok(Err(e))) => self.classify(&subject, &e),
                    Ok(Ok(Ok(ack))) => match tokio::time::timeout_at(deadline, ack).await {
                        Err(_) => timed_out(&subject),
                        Ok(Ok(_)) => Outcome::Delivered,
                        Ok(Err(e)) => self.classify(&subject, &e),
                    },
                });
            }
            outcomes
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let context = self.context().await?;
            match context.client().connection_state() {
                async_nats::connection::State::Connected => Ok(()),
                state => Err(format!("nats connection {state}")),
            }
        })
    }
}

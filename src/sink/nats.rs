//! The `nats` destination: JetStream publish to a subject template (`{topic}` replaced)
//! with `Nats-Msg-Id` = outbox_id, so the stream's duplicate window drops a redelivery.
//! A message is delivered when its PubAck arrives (a duplicate ack counts: the stream has
//! it). No stream for the subject is permanent; timeouts and connection loss are retryable.

use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind};
use futures_util::future::BoxFuture;

use super::{Sink, SinkError};
use crate::message::{ClaimedMessage, Outcome};
use crate::secret::redact_url;

pub struct Nats {
    url: String,
    subject: String,
    timeout: Duration,
    context: tokio::sync::Mutex<Option<jetstream::Context>>,
}

impl Nats {
    pub fn new(url: &str, subject: &str, timeout: Duration) -> Result<Self, SinkError> {
        if url.is_empty() {
            return Err(SinkError {
                sink: "nats",
                problem: "url must not be empty".into(),
            });
        }
        Ok(Self {
            url: url.to_owned(),
            subject: subject.to_owned(),
            timeout,
            context: tokio::sync::Mutex::new(None),
        })
    }

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

impl Sink for Nats {
    fn name(&self) -> &'static str {
        "nats"
    }

    fn publish<'a>(&'a self, batch: &'a [ClaimedMessage]) -> BoxFuture<'a, Vec<Outcome>> {
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
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Outbox-Topic", m.topic.as_str());
                headers.insert("Outbox-Attempt", m.attempt_no.to_string().as_str());
                headers.insert("Content-Type", m.content_type.as_str());
                if let Some(key) = &m.key {
                    headers.insert("Outbox-Key", key.as_str());
                }
                let publish = jetstream::message::PublishMessage::build()
                    .payload(m.payload.clone().into())
                    .headers(headers)
                    .message_id(m.id.to_string());
                // While the client is reconnecting, sending waits: bound it like the ack.
                let sent = tokio::time::timeout_at(
                    deadline,
                    context.send_publish(subject.clone(), publish),
                )
                .await;
                pending.push((subject, sent));
            }
            let timed_out = |subject: &str| Outcome::Retryable {
                reason: format!("publish to {subject}: no answer within {:?}", self.timeout),
                retry_after: None,
            };
            let mut outcomes = Vec::with_capacity(batch.len());
            for (subject, sent) in pending {
                outcomes.push(match sent {
                    Err(_) => timed_out(&subject),
                    Ok(Err(e)) => self.classify(&subject, &e),
                    Ok(Ok(ack)) => match tokio::time::timeout_at(deadline, ack).await {
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

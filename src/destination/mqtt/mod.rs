//! The `mqtt` destination: MQTT 5 (or 3.1.1) publish at QoS 1 to a topic template (`{topic}`
//! replaced), retained flag off, a message delivered when the broker's PUBACK for it arrives.
//! On MQTT 5 the message's own headers and the outbox metadata (`outbox-id`, the consumer's
//! dedupe id; `outbox-topic`, `outbox-key`, `outbox-attempt`) travel as user properties and
//! the content type as the Content Type property; a header MQTT cannot carry (a name or
//! value over 65,535 bytes) makes that message permanent. MQTT 3.1.1 has no headers: they
//! are not sent (the documented rule; the CloudEvents structured envelope carries the id in
//! the payload instead).
//!
//! One connection per destination, with a clean session and a client id unique to the
//! process (`client_id` + random suffix). The client (`rumqttc`) numbers the packets; the
//! number of each publish is learnt from the event the client emits as it takes the
//! request, in the order the requests were queued, and its PUBACK settles its message. A
//! PUBACK with a reason code of 0x80 or more (MQTT 5) is the broker's refusal: not
//! authorized, topic name invalid, payload format invalid and implementation-specific
//! errors are permanent, the rest retryable. A lost connection, or a batch not acknowledged
//! within the deadline, answers its waiting messages retryable and drops the connection;
//! the next batch connects again, so nothing the client would resend on its own is mixed
//! with new publishes.
//!
//! Its settings and their validation are in `config.rs`; one connection and the publishes
//! waiting on it are in `session.rs`; this file is the publisher.

mod config;
mod session;

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use rumqttc::Transport;

pub use config::MqttConfig;
use config::topic_problem;
use session::{Ack, Packet, Session};

use super::cloudevents::{Envelope, Mode, STRUCTURED_CONTENT_TYPE};
use super::{Destination, Window, metadata, user_headers};
use crate::message::{ClaimedMessage, Outcome};

/// Publishes queued in the client at once (its request channel); a batch beyond it is
/// answered retryable for the messages that did not fit.
const QUEUE: usize = 4096;
/// Publishes awaiting their PUBACK at once (the broker's Receive Maximum, when lower, wins).
const INFLIGHT: u16 = 100;
/// The longest string MQTT encodes (a two-byte length).
const MQTT_STRING: usize = 65_535;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocol {
    V311,
    V5,
}

/// What a connection needs, from the settings.
#[derive(Clone)]
struct Settings {
    host: String,
    port: u16,
    protocol: Protocol,
    client_id: String,
    credentials: Option<(String, String)>,
    transport: Option<Transport>,
    keep_alive: Duration,
    max_packet: usize,
}

pub struct Mqtt {
    settings: Settings,
    url: String,
    topic: String,
    timeout: Duration,
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    envelope: Option<Envelope>,
}

impl Mqtt {
    async fn session(&self) -> Result<Arc<Session>, String> {
        let mut slot = self.session.lock().await;
        if let Some(s) = slot.as_ref().filter(|s| s.is_open()) {
            return Ok(s.clone());
        }
        *slot = None;
        let session = Arc::new(Session::connect(&self.settings, &self.url, self.timeout).await?);
        *slot = Some(session.clone());
        Ok(session)
    }

    /// Forgets `session` (a batch timed out on it), so that the next batch connects again.
    async fn drop_session(&self, session: &Arc<Session>) {
        let mut slot = self.session.lock().await;
        if slot.as_ref().is_some_and(|s| Arc::ptr_eq(s, session)) {
            *slot = None;
        }
    }

    /// The publish of `m`, or why it cannot be sent.
    fn packet(&self, m: &ClaimedMessage) -> Result<Packet, String> {
        let topic = self.topic.replace("{topic}", &m.topic);
        topic_problem(&topic)?;
        let (content_type, payload) = match &self.envelope {
            Some(e) if e.mode == Mode::Structured => (STRUCTURED_CONTENT_TYPE, e.structured(m)?),
            _ => (m.content_type.as_str(), m.payload.clone()),
        };
        let mut size = topic.len() + payload.len();
        let properties = match self.settings.protocol {
            Protocol::V311 => None,
            Protocol::V5 => {
                let mut props = Vec::new();
                let outbox = metadata(m);
                // The MQTT binding: attributes as user properties under their own names,
                // `datacontenttype` as the Content Type property. Attributes and headers
                // share that one namespace, so an attribute wins over a header of its name
                // (the event's `traceparent` is the creation context; never two values).
                let attributes = match self.envelope.as_ref().filter(|e| e.mode == Mode::Binary) {
                    Some(e) => e.headers(m, "", false),
                    None => Vec::new(),
                };
                for (name, value) in user_headers(m)? {
                    if !outbox.iter().any(|(n, _)| *n == name)
                        && !attributes.iter().any(|(n, _)| n == name)
                    {
                        props.push((name.to_owned(), value));
                    }
                }
                props.extend(attributes);
                props.extend(outbox.into_iter().map(|(n, v)| (n.to_owned(), v)));
                for (name, value) in &props {
                    if name.len() > MQTT_STRING || value.len() > MQTT_STRING {
                        return Err(format!(
                            "header {:?}: MQTT carries names and values of at most {MQTT_STRING} bytes",
                            truncate(name)
                        ));
                    }
                    size += name.len() + value.len() + 5;
                }
                size += content_type.len();
                Some(rumqttc::v5::mqttbytes::v5::PublishProperties {
                    user_properties: props,
                    content_type: Some(content_type.to_owned()),
                    ..Default::default()
                })
            }
        };
        if size > self.settings.max_packet {
            return Err(format!(
                "the message is {size} bytes as an MQTT publish, over max_packet_bytes ({})",
                self.settings.max_packet
            ));
        }
        Ok(Packet {
            topic,
            payload,
            properties,
        })
    }
}

fn truncate(name: &str) -> &str {
    let mut end = name.len().min(40);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

impl Destination for Mqtt {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let retryable = |reason: String| Outcome::Retryable {
                reason,
                retry_after: None,
            };
            if let Err(not_sent) = window.check() {
                return vec![not_sent; batch.len()];
            }
            let session = match self.session().await {
                Ok(s) => s,
                Err(reason) => return vec![retryable(reason); batch.len()],
            };
            let deadline = tokio::time::Instant::now() + self.timeout;
            let mut pending = Vec::with_capacity(batch.len());
            for m in batch {
                // Each publish is a frame of its own.
                if let Err(not_sent) = window.check() {
                    pending.push(Err(not_sent));
                    continue;
                }
                pending.push(match self.packet(m) {
                    Err(reason) => Err(Outcome::Permanent { reason }),
                    Ok(packet) => session.send(packet).map_err(retryable),
                });
            }
            let mut timed_out = false;
            let mut outcomes = Vec::with_capacity(batch.len());
            for sent in pending {
                outcomes.push(match sent {
                    Err(outcome) => outcome,
                    Ok(ack) => match tokio::time::timeout_at(deadline, ack).await {
                        Err(_) => {
                            timed_out = true;
                            retryable(format!(
                                "publish to {}: timed out, no PUBACK within {:?}",
                                self.url, self.timeout
                            ))
                        }
                        Ok(Err(_)) => retryable("the MQTT connection was dropped".into()),
                        Ok(Ok(Ack::Delivered)) => Outcome::Delivered,
                        Ok(Ok(Ack::Refused {
                            permanent: true,
                            reason,
                        })) => Outcome::Permanent { reason },
                        Ok(Ok(Ack::Refused { reason, .. } | Ack::Lost(reason))) => {
                            retryable(reason)
                        }
                    },
                });
            }
            if timed_out {
                self.drop_session(&session).await;
            }
            outcomes
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { self.session().await.map(|_| ()) })
    }
}

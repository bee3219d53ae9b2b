//! The `amqp` destination (RabbitMQ): publisher confirms on, persistent delivery,
//! `message_id` = outbox_id, `mandatory` so that a message no queue is bound for comes back
//! (permanent: it would otherwise be dropped silently). The message's own headers go into
//! the AMQP `headers` table with the outbox metadata (`outbox-id`, `outbox-topic`,
//! `outbox-key`, `outbox-seq`, `outbox-attempt`) beside them. A message is delivered when the broker
//! confirms it; a nack or a lost connection is retryable. The client has no timeout of its
//! own: a broker that stops answering is cut off by the dispatch deadline. With the
//! CloudEvents envelope, the attributes go as `cloudEvents_` headers (binary) or the body is
//! the JSON event (structured).

use std::collections::HashMap;
use std::time::Duration;

use futures_util::future::BoxFuture;
use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use super::cloudevents::{self, Envelope, Mode, STRUCTURED_CONTENT_TYPE};
use super::{Destination, Setting, Window, install_tls_provider, metadata, user_headers};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};
use crate::secret::redact_url;

/// `type = "amqp"`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AmqpConfig {
    /// `amqp://` or `amqps://` [default: amqp://guest:guest@127.0.0.1:5672/%2f].
    pub url: Option<String>,
    /// Exchange [default: "", the default exchange].
    pub exchange: Option<String>,
    /// Routing key template [default: `{topic}`].
    pub routing_key: Option<String>,
    /// `"cloudevents"` to send each message as a CloudEvent [default: none].
    pub envelope: Option<String>,
    /// `"binary"` or `"structured"` [default: binary].
    pub cloudevents_mode: Option<String>,
    /// The CloudEvents `source` template [default: /outbox-relay].
    pub cloudevents_source: Option<String>,
    /// The CloudEvents `type` template [default: `{topic}`].
    pub cloudevents_type: Option<String>,
}

impl AmqpConfig {
    /// Checks the URL with the client's own parser, and that it carries the credentials the
    /// broker will ask for (see [`credentials_problem`]).
    pub(super) fn build(&self, at: Setting<'_>, _deadline: Duration) -> Result<Amqp, ConfigError> {
        install_tls_provider();
        let url = self
            .url
            .as_deref()
            .unwrap_or("amqp://guest:guest@127.0.0.1:5672/%2f");
        if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
            return Err(at.invalid("url", "must start with amqp:// or amqps://"));
        }
        let parsed = url.parse::<lapin::uri::AMQPUri>().map_err(|e| {
            at.invalid(
                "url",
                format!("{:?} is not a valid AMQP URL: {e}", redact_url(url)),
            )
        })?;
        if let Some(problem) = credentials_problem(url, &parsed.authority.host) {
            return Err(at.invalid("url", format!("{:?} {problem}", redact_url(url))));
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
        Ok(Amqp {
            envelope,
            url: url.to_owned(),
            exchange: self.exchange.clone().unwrap_or_default(),
            routing_key: self
                .routing_key
                .clone()
                .unwrap_or_else(|| "{topic}".to_owned()),
            channel: tokio::sync::Mutex::new(None),
        })
    }
}

/// What is wrong with the credentials of `url`, if anything. Without `user:password@` the
/// client logs in as guest/guest, which RabbitMQ accepts only from localhost: to a remote
/// broker every delivery would then fail on ACCESS_REFUSED, so that is refused at start;
/// a user without a password is refused anywhere (the client would send `guest`).
fn credentials_problem(url: &str, host: &str) -> Option<&'static str> {
    let authority = url.split_once("://")?.1.split(['/', '?']).next()?;
    match authority.rsplit_once('@').map(|(userinfo, _)| userinfo) {
        Some(userinfo) if !userinfo.contains(':') => Some(
            "names a user without a password: write amqp://USER:PASSWORD@HOST:5672/VHOST \
             (the password may come from ${NAME} or ${file:PATH})",
        ),
        None if !is_loopback(host) => Some(
            "has no credentials, so the client would log in as guest, which RabbitMQ refuses \
             from anywhere but localhost: write amqp://USER:PASSWORD@HOST:5672/VHOST",
        ),
        _ => None,
    }
}

fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

pub struct Amqp {
    url: String,
    exchange: String,
    routing_key: String,
    channel: tokio::sync::Mutex<Option<(Connection, Channel)>>,
    envelope: Option<Envelope>,
}

impl Amqp {
    /// The channel, (re)connecting when needed. The caller holds `slot` for a whole batch:
    /// returned messages are drained per channel, so batches must not share it at once.
    async fn channel(&self, slot: &mut Option<(Connection, Channel)>) -> Result<Channel, String> {
        if let Some((connection, channel)) = slot.as_ref()
            && connection.status().connected()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        // Named so an operator (or a test) can find this process's connection in RabbitMQ.
        let properties = ConnectionProperties::default()
            .with_connection_name(format!("outbox-relay pid {}", std::process::id()).into());
        let connection = Connection::connect(&self.url, properties)
            .await
            .map_err(|e| format!("amqp connect: {e}"))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| format!("amqp channel: {e}"))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| format!("amqp confirm_select: {e}"))?;
        *slot = Some((connection, channel.clone()));
        Ok(channel)
    }
}

/// The AMQP `headers` table of `m`: its own headers, the CloudEvents attributes (binary
/// mode), then the outbox metadata; or why they cannot be sent.
fn headers(m: &ClaimedMessage, envelope: Option<&Envelope>) -> Result<FieldTable, String> {
    let mut table = FieldTable::default();
    let mut insert = |name: &str, value: AMQPValue| -> Result<(), String> {
        if name.is_empty() || name.len() > 255 {
            return Err(format!(
                "header name {name:?} is not valid in AMQP (1 to 255 bytes)"
            ));
        }
        table.insert(name.into(), value);
        Ok(())
    };
    for (name, value) in user_headers(m)? {
        insert(name, AMQPValue::LongString(LongString::from(value)))?;
    }
    // The AMQP binding's application properties, with the `cloudEvents_` prefix it prefers
    // (JMS selectors refuse `:`); `datacontenttype` is the content-type property.
    if let Some(e) = envelope.filter(|e| e.mode == Mode::Binary) {
        for (name, value) in e.headers(m, "cloudEvents_", false) {
            insert(&name, AMQPValue::LongString(LongString::from(value)))?;
        }
    }
    for (name, value) in metadata(m) {
        insert(name, AMQPValue::LongString(LongString::from(value)))?;
    }
    Ok(table)
}

impl Destination for Amqp {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let retry = |reason: String| Outcome::Retryable {
                reason,
                retry_after: None,
            };
            let mut slot = self.channel.lock().await;
            let channel = match self.channel(&mut slot).await {
                Ok(c) => c,
                Err(reason) => return vec![retry(reason); batch.len()],
            };
            let mut confirms = Vec::with_capacity(batch.len());
            for m in batch {
                let routing_key = self.routing_key.replace("{topic}", &m.topic);
                // Each publish frame is a call of its own (it may wait on flow control).
                if let Err(not_sent) = window.check() {
                    confirms.push((routing_key, Err(not_sent)));
                    continue;
                }
                let headers = match headers(m, self.envelope.as_ref()) {
                    Ok(h) => h,
                    Err(reason) => {
                        confirms.push((routing_key, Err(Outcome::Permanent { reason })));
                        continue;
                    }
                };
                let (content_type, structured) = match &self.envelope {
                    Some(e) if e.mode == Mode::Structured => match e.structured(m) {
                        Ok(body) => (STRUCTURED_CONTENT_TYPE, Some(body)),
                        Err(reason) => {
                            confirms.push((routing_key, Err(Outcome::Permanent { reason })));
                            continue;
                        }
                    },
                    _ => (m.content_type.as_str(), None),
                };
                let properties = BasicProperties::default()
                    .with_message_id(ShortString::from(m.id.to_string()))
                    .with_delivery_mode(2)
                    .with_content_type(ShortString::from(content_type))
                    .with_headers(headers);
                let sent = channel
                    .basic_publish(
                        ShortString::from(self.exchange.as_str()),
                        ShortString::from(routing_key.as_str()),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        structured.as_deref().unwrap_or(&m.payload),
                        properties,
                    )
                    .await
                    .map_err(|e| retry(format!("amqp publish: {e}")));
                confirms.push((routing_key, sent));
            }
            // A returned (unroutable) message may be handed back with the confirm of another
            // message, or with none (the broker acks several at once), so returns are
            // collected from the confirms and from the channel, and matched to messages by
            // their message_id, the outbox_id.
            let mut answers = Vec::with_capacity(batch.len());
            let mut returned: HashMap<String, String> = HashMap::new();
            for (routing_key, sent) in confirms {
                let answer = match sent {
                    Err(refused) => Err(refused),
                    Ok(confirm) => match confirm.await {
                        Ok(Confirmation::Ack(r)) => {
                            if let Some(r) = r
                                && let Some(id) = r.properties.message_id()
                            {
                                returned.insert(id.to_string(), format!(
                                    "unroutable: exchange {:?} has no queue bound for routing key {routing_key:?} ({})",
                                    self.exchange, r.reply_text
                                ));
                            }
                            Ok(())
                        }
                        Ok(Confirmation::Nack(_)) => {
                            Err(retry("the broker nacked the message".into()))
                        }
                        Ok(Confirmation::NotRequested) => {
                            Err(retry("publisher confirms are off".into()))
                        }
                        Err(e) => Err(retry(format!("amqp confirm: {e}"))),
                    },
                };
                answers.push(answer);
            }
            // Every message returned since the last batch (this batch: the channel is ours).
            match channel.wait_for_confirms().await {
                Ok(drained) => {
                    for r in drained {
                        if let Some(id) = r.properties.message_id() {
                            returned.entry(id.to_string()).or_insert_with(|| {
                                format!(
                                    "unroutable: exchange {:?} has no queue bound for it ({})",
                                    self.exchange, r.reply_text
                                )
                            });
                        }
                    }
                }
                Err(e) => {
                    return vec![retry(format!("amqp confirms: {e}")); batch.len()];
                }
            }
            drop(slot);
            let outcomes: Vec<Outcome> = batch
                .iter()
                .zip(answers)
                .map(
                    |(m, answer)| match (answer, returned.remove(&m.id.to_string())) {
                        (_, Some(reason)) => Outcome::Permanent { reason },
                        (Ok(()), None) => Outcome::Delivered,
                        (Err(outcome), None) => outcome,
                    },
                )
                .collect();
            outcomes
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            self.channel(&mut *self.channel.lock().await)
                .await
                .map(|_| ())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::credentials_problem;

    #[test]
    fn a_remote_broker_needs_credentials_and_a_user_needs_a_password() {
        assert!(
            credentials_problem("amqp://broker.internal:5672/%2f", "broker.internal").is_some()
        );
        assert!(credentials_problem("amqp://app@broker.internal/%2f", "broker.internal").is_some());
        assert!(credentials_problem("amqp://app@127.0.0.1/%2f", "127.0.0.1").is_some());
        assert_eq!(
            credentials_problem("amqp://app:pw@broker.internal/%2f", "broker.internal"),
            None
        );
        assert_eq!(
            credentials_problem("amqp://127.0.0.1:5672/%2f", "127.0.0.1"),
            None
        );
        assert_eq!(credentials_problem("amqp://localhost", "localhost"), None);
    }
}

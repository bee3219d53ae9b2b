//! The `amqp` destination (RabbitMQ): publisher confirms on, persistent delivery,
//! `message_id` = outbox_id, `mandatory` so that a message no queue is bound for comes back
//! (permanent: it would otherwise be dropped silently). A message is delivered when the
//! broker confirms it; a nack or a lost connection is retryable.

use std::collections::HashMap;

use futures_util::future::BoxFuture;
use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use super::{Sink, SinkError, install_tls_provider};
use crate::message::{ClaimedMessage, Outcome};

pub struct Amqp {
    url: String,
    exchange: String,
    routing_key: String,
    channel: tokio::sync::Mutex<Option<(Connection, Channel)>>,
}

impl Amqp {
    pub fn new(url: &str, exchange: &str, routing_key: &str) -> Result<Self, SinkError> {
        install_tls_provider();
        if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
            return Err(SinkError {
                sink: "amqp",
                problem: "url must start with amqp:// or amqps://".into(),
            });
        }
        Ok(Self {
            url: url.to_owned(),
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            channel: tokio::sync::Mutex::new(None),
        })
    }

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

impl Sink for Amqp {
    fn name(&self) -> &'static str {
        "amqp"
    }

    fn publish<'a>(&'a self, batch: &'a [ClaimedMessage]) -> BoxFuture<'a, Vec<Outcome>> {
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
                let mut headers = FieldTable::default();
                headers.insert(
                    "outbox-topic".into(),
                    AMQPValue::LongString(LongString::from(m.topic.as_str())),
                );
                headers.insert("outbox-attempt".into(), AMQPValue::LongInt(m.attempt_no));
                if let Some(key) = &m.key {
                    headers.insert(
                        "outbox-key".into(),
                        AMQPValue::LongString(LongString::from(key.as_str())),
                    );
                }
                let properties = BasicProperties::default()
                    .with_message_id(ShortString::from(m.id.to_string()))
                    .with_delivery_mode(2)
                    .with_content_type(ShortString::from(m.content_type.as_str()))
                    .with_headers(headers);
                let sent = channel
                    .basic_publish(
                        ShortString::from(self.exchange.as_str()),
                        ShortString::from(routing_key.as_str()),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &m.payload,
                        properties,
                    )
                    .await;
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
                    Err(e) => Err(format!("amqp publish: {e}")),
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
                        Ok(Confirmation::Nack(_)) => Err("the broker nacked the message".into()),
                        Ok(Confirmation::NotRequested) => Err("publisher confirms are off".into()),
                        Err(e) => Err(format!("amqp confirm: {e}")),
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
                        (Err(reason), None) => retry(reason),
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

//! The `kafka` destination: an idempotent producer (librdkafka through `rdkafka`), so a
//! broker retry never writes a record twice. A message becomes one record on the topic its
//! template names (`{topic}` replaced), keyed by its `message_key` (every message of a key
//! goes to one partition, in order; a claim may hold a key's head with the run behind it,
//! and dispatch hands this destination a key's next message only once the one before it
//! was delivered, or with `runs_in_one_call` the whole run in one call
//! ([`Destination::keeps_key_order`]), produced in enqueue order, which the idempotent
//! producer keeps within a partition through its own retries) or, without a key, by its
//! outbox_id. A record the client does not take holds back the later records of its key
//! in the call: they are given back unsent. The message's own headers travel as
//! record headers, with the outbox metadata (`outbox-id`, the consumer's dedupe id;
//! `outbox-topic`, `outbox-key`, `outbox-seq`, `outbox-attempt`) and `content-type` beside
//! them.
//!
//! A message is delivered only when its delivery report confirms it; each report settles
//! its own message. A refusal the broker or the client will repeat (unknown topic or
//! partition, record too large, invalid record, authorization failed) is permanent with the
//! reason; everything else (broker unreachable, leader not available, timed out, queue
//! full) is retryable. The producer gives a message up at 90 % of the dispatch deadline, so
//! its own reason is the one recorded. A producer the broker fenced, or whose id or
//! sequence state it refused, is replaced by a new one (a new producer id), which is given
//! the records the old one could not write.
//!
//! With the CloudEvents envelope, the attributes go as `ce_` headers (binary) or the value
//! is the JSON event (structured). With the debezium envelope, the record is the one
//! Debezium's outbox event router writes (`debezium.rs`): its key, value, headers and
//! timestamp replace those above.
//!
//! Its settings and their validation are in `config.rs`; this file is the publisher.

mod config;
mod debezium;

use std::collections::HashSet;
use std::sync::RwLock;
use std::time::Duration;

use futures_util::future::BoxFuture;
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};

pub use config::KafkaConfig;
use config::topic_char;

use super::cloudevents::{Envelope, Mode, STRUCTURED_CONTENT_TYPE};
use super::{Destination, Window, metadata, user_headers};
use crate::message::{ClaimedMessage, Outcome};

fn create(config: &ClientConfig) -> Result<FutureProducer, KafkaError> {
    config.create()
}

pub struct Kafka {
    config: ClientConfig,
    /// Replaced when the client reports a fatal error (an idempotent producer that lost
    /// its sequence state cannot go on); the config is the one that built it.
    producer: RwLock<FutureProducer>,
    topic: String,
    brokers: String,
    readiness_timeout: Duration,
    envelope: Option<Envelope>,
    debezium: Option<debezium::Debezium>,
    /// `runs_in_one_call`: a key's run is produced in one call.
    runs_in_one_call: bool,
}

impl Kafka {
    fn producer(&self) -> FutureProducer {
        self.producer
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// After a fatal error, or an error that leaves the producer's id or sequence state
    /// unusable (fenced, epoch or sequence refused), a new producer with a new producer id
    /// takes over; records the old one had not confirmed were reported retryable.
    /// Returns the producer that took over.
    fn replace(&self, failed: &FutureProducer) -> FutureProducer {
        let mut slot = self
            .producer
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.client().native_ptr() != failed.client().native_ptr() {
            return slot.clone(); // another batch replaced it already
        }
        match create(&self.config) {
            Ok(producer) => {
                let fatal = failed
                    .client()
                    .fatal_error()
                    .map(|(code, reason)| format!("{code}: {reason}"));
                tracing::warn!(
                    fatal_error = fatal,
                    "kafka producer cannot go on; replaced it with a new one"
                );
                *slot = producer;
            }
            Err(e) => {
                tracing::error!(error = %e, "kafka producer cannot go on and could not be replaced")
            }
        }
        slot.clone()
    }
}

/// Errors after which the producer cannot deliver anything more.
fn producer_unusable(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::Fatal
            | C::ProducerFenced
            | C::InvalidProducerEpoch
            | C::InvalidProducerIdMapping
            | C::UnknownProducerId
            | C::OutOfOrderSequenceNumber
    )
}

/// What the client answered about one record, as the message's outcome.
fn classify(topic: &str, e: &KafkaError) -> Outcome {
    use RDKafkaErrorCode as C;
    let permanent = matches!(
        e.rdkafka_error_code(),
        Some(
            C::UnknownTopicOrPartition
                | C::UnknownTopic
                | C::UnknownPartition
                | C::MessageSizeTooLarge
                | C::InvalidMessageSize
                | C::MessageBatchTooLarge
                | C::InvalidMessage
                | C::InvalidRecord
                | C::InvalidTopic
                | C::TopicAuthorizationFailed
                | C::ClusterAuthorizationFailed
                | C::PolicyViolation
                | C::UnsupportedForMessageFormat
        )
    );
    let reason = match e.rdkafka_error_code() {
        Some(code) => format!("produce to kafka topic {topic}: {code}"),
        None => format!("produce to kafka topic {topic}: {e}"),
    };
    if permanent {
        Outcome::Permanent { reason }
    } else {
        Outcome::Retryable {
            reason,
            retry_after: None,
        }
    }
}

/// The record headers of `m`: its own, then `content-type`, the CloudEvents attributes
/// (binary mode), and the outbox metadata.
fn headers(m: &ClaimedMessage, envelope: Option<&Envelope>) -> Result<OwnedHeaders, String> {
    let own = user_headers(m)?;
    let outbox = metadata(m);
    // The Kafka binding: `ce_` headers, `datacontenttype` as `content-type`.
    let (content_type, attributes) = match envelope {
        Some(e) if e.mode == Mode::Structured => (STRUCTURED_CONTENT_TYPE, Vec::new()),
        Some(e) => (m.content_type.as_str(), e.headers(m, "ce_", false)),
        None => (m.content_type.as_str(), Vec::new()),
    };
    let all = own
        .iter()
        .map(|(n, v)| (*n, v.as_str()))
        .chain([("content-type", content_type)])
        .chain(attributes.iter().map(|(n, v)| (n.as_str(), v.as_str())))
        .chain(outbox.iter().map(|(n, v)| (*n, v.as_str())));
    Ok(all.fold(OwnedHeaders::new(), |headers, (key, value)| {
        headers.insert(Header {
            key,
            value: Some(value),
        })
    }))
}

impl Kafka {
    /// Produces `batch` with `producer` and waits for each record's report: one outcome
    /// per message, and whether its error left the producer unusable. Each record is a
    /// produce call, sent only while `window` is open.
    async fn produce(
        &self,
        producer: &FutureProducer,
        batch: &[&ClaimedMessage],
        window: &Window,
    ) -> Vec<(Outcome, bool)> {
        // Hand every record to the client first, then wait for the reports: the client
        // batches them into requests.
        let mut pending = Vec::with_capacity(batch.len());
        // A key's run (runs_in_one_call) after a record of it the client did not take: the
        // later records are not produced, so that none is written ahead of it.
        let mut held_back: HashSet<(&str, &str)> = HashSet::new();
        for m in batch {
            let topic = self.topic.replace("{topic}", &m.topic);
            let run = m.order_key();
            let sent = if run.is_some_and(|r| held_back.contains(&r)) {
                Err(m.behind_undelivered())
            } else if let Err(not_sent) = window.check() {
                Err(not_sent)
            } else {
                self.produce_one(producer, m, &topic)
            };
            if let (Err(_), Some(run)) = (&sent, run) {
                held_back.insert(run);
            }
            pending.push((topic, sent));
        }
        let mut outcomes = Vec::with_capacity(batch.len());
        for (topic, sent) in pending {
            outcomes.push(match sent {
                Err(refused) => (refused, false),
                Ok(report) => match report.await {
                    Ok(Ok(_delivery)) => (Outcome::Delivered, false),
                    Ok(Err((e, _))) => (
                        classify(&topic, &e),
                        e.rdkafka_error_code().is_some_and(producer_unusable),
                    ),
                    Err(_canceled) => (
                        Outcome::Retryable {
                            reason: format!(
                                "produce to kafka topic {topic}: the producer closed before it reported"
                            ),
                            retry_after: None,
                        },
                        false,
                    ),
                },
            });
        }
        outcomes
    }

    /// Hands the record of `m` to the client; its delivery report to wait for, or why the
    /// client did not take it.
    fn produce_one(
        &self,
        producer: &FutureProducer,
        m: &ClaimedMessage,
        topic: &str,
    ) -> Result<DeliveryFuture, Outcome> {
        if topic.is_empty() || topic.len() > 249 || !topic.chars().all(topic_char) {
            let reason = format!(
                "{topic:?} is not a valid Kafka topic name (1 to 249 letters, digits, '.', '_', '-')"
            );
            return Err(Outcome::Permanent { reason });
        }
        if let Some(debezium) = &self.debezium {
            let r = debezium
                .record(m)
                .map_err(|reason| Outcome::Permanent { reason })?;
            let headers = r.headers.iter().fold(OwnedHeaders::new(), |h, (k, v)| {
                h.insert(Header {
                    key: k,
                    value: Some(v),
                })
            });
            let mut record = FutureRecord::<str, [u8]>::to(topic)
                .headers(headers)
                .timestamp(r.timestamp);
            if let Some(key) = r.key.as_deref() {
                record = record.key(key);
            }
            if let Some(value) = r.value.as_deref() {
                record = record.payload(value);
            }
            return producer
                .send_result(record)
                .map_err(|(e, _)| classify(topic, &e));
        }
        let headers =
            headers(m, self.envelope.as_ref()).map_err(|reason| Outcome::Permanent { reason })?;
        let structured = match &self.envelope {
            Some(e) if e.mode == Mode::Structured => Some(
                e.structured(m)
                    .map_err(|reason| Outcome::Permanent { reason })?,
            ),
            _ => None,
        };
        let id = m.id.to_string();
        let key = m.key.as_deref().unwrap_or(&id);
        let record = FutureRecord::to(topic)
            .key(key)
            .payload(structured.as_deref().unwrap_or(&m.payload))
            .headers(headers);
        producer
            .send_result(record)
            .map_err(|(e, _)| classify(topic, &e))
    }
}

impl Destination for Kafka {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let producer = self.producer();
            let all: Vec<&ClaimedMessage> = batch.iter().collect();
            let mut outcomes = self.produce(&producer, &all, window).await;
            let run_of = |i: usize| batch[i].order_key();
            // The records the producer could not write because of its own state, to give
            // its replacement: not one behind an earlier record of its key that failed
            // otherwise, nor one a later record of its key was written after (either would
            // then be written ahead of the other). Those keep their retryable outcome.
            let mut failed: HashSet<(&str, &str)> = HashSet::new();
            let mut again = Vec::new();
            for (i, (outcome, unusable)) in outcomes.iter().enumerate() {
                let run = run_of(i);
                let later_written = || {
                    run.is_some_and(|r| {
                        (i + 1..outcomes.len())
                            .any(|j| run_of(j) == Some(r) && outcomes[j].0 == Outcome::Delivered)
                    })
                };
                if *unusable && run.is_none_or(|r| !failed.contains(&r)) && !later_written() {
                    again.push(i);
                } else if let (false, Some(run)) = (*outcome == Outcome::Delivered, run) {
                    failed.insert(run);
                }
            }
            // The producer cannot go on (fenced, its id or sequence refused, or in a fatal
            // state that refuses every record at once): a replacement takes over, and the
            // records above are given to it once, so that a message does not pay an attempt
            // for the producer's state.
            let broken = outcomes.iter().any(|(_, unusable)| *unusable)
                || producer.client().fatal_error().is_some();
            if broken {
                let fresh = self.replace(&producer);
                // The last handle of a replaced producer purges and flushes it (up to half a
                // second) and joins its thread: not on the runtime's threads.
                tokio::task::spawn_blocking(move || drop(producer));
                if !again.is_empty() {
                    let retry: Vec<&ClaimedMessage> = again.iter().map(|&i| &batch[i]).collect();
                    for (i, outcome) in again
                        .into_iter()
                        .zip(self.produce(&fresh, &retry, window).await)
                    {
                        outcomes[i] = outcome;
                    }
                }
            }
            outcomes.into_iter().map(|(outcome, _)| outcome).collect()
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let producer = self.producer();
            let timeout = self.readiness_timeout;
            let brokers = self.brokers.clone();
            // A metadata request (blocking in the client) shows a broker answers.
            tokio::task::spawn_blocking(move || {
                producer
                    .client()
                    .fetch_metadata(None, timeout)
                    .map(|_| ())
                    .map_err(|e| format!("kafka brokers {brokers}: {e}"))
            })
            .await
            .map_err(|e| format!("kafka readiness check: {e}"))?
        })
    }

    fn keeps_key_order(&self) -> bool {
        self.runs_in_one_call
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn refusals_the_broker_repeats_are_permanent() {
        let produce = |code| KafkaError::MessageProduction(code);
        for code in [
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::TopicAuthorizationFailed,
            RDKafkaErrorCode::InvalidRecord,
        ] {
            assert!(
                matches!(classify("t", &produce(code)), Outcome::Permanent { .. }),
                "{code:?}"
            );
        }
        for code in [
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::LeaderNotAvailable,
            RDKafkaErrorCode::RequestTimedOut,
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::QueueFull,
        ] {
            assert!(
                matches!(classify("t", &produce(code)), Outcome::Retryable { .. }),
                "{code:?}"
            );
        }
    }

    /// With runs_in_one_call, a record the client does not take (its queue holds one
    /// record, and no broker answers) holds back the later records of its key on its
    /// topic: they are given back unsent; other keys and topics, and unkeyed messages, are
    /// still tried.
    #[tokio::test]
    async fn a_record_the_client_did_not_take_holds_back_the_rest_of_its_run() {
        let config: KafkaConfig = toml::from_str(
            "brokers = \"127.0.0.1:1\"\nruns_in_one_call = true\n\
             [properties]\n\"queue.buffering.max.messages\" = 1\n",
        )
        .unwrap();
        let kafka = config
            .build(crate::destination::Setting("d"), Duration::from_secs(1))
            .unwrap();
        let message = |key: Option<&str>, topic: &str| {
            let mut m = ClaimedMessage::example(serde_json::json!({}));
            m.key = key.map(str::to_owned);
            m.topic = topic.to_owned();
            m
        };
        let batch = [
            message(Some("k"), "t"), // taken: it fills the queue
            message(Some("k"), "t"), // queue full
            message(Some("k"), "t"), // held back behind it
            message(Some("k"), "u"), // the key on another topic: tried (queue full)
            message(None, "t"),      // unkeyed: tried (queue full)
        ];
        let outcomes = kafka.publish(&batch, &Window::unbounded()).await;
        let kinds: Vec<&str> = outcomes
            .iter()
            .map(|o| match o {
                Outcome::Retryable { .. } => "retryable",
                Outcome::NotAttempted { .. } => "not attempted",
                _ => "other",
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "retryable",
                "retryable",
                "not attempted",
                "retryable",
                "retryable"
            ],
            "{outcomes:?}"
        );
        assert!(
            matches!(&outcomes[1], Outcome::Retryable { reason, .. } if reason.contains("QueueFull")),
            "{outcomes:?}"
        );
        assert!(
            matches!(&outcomes[2], Outcome::NotAttempted { reason } if reason == "an earlier message of key \"k\" was not delivered"),
            "{outcomes:?}"
        );
    }

    #[test]
    fn headers_carry_the_outbox_metadata_beside_the_message_own() {
        use rdkafka::message::Headers;
        let mut m = ClaimedMessage::example(serde_json::json!({"traceparent": "00-a-b-01"}));
        let all = |m: &ClaimedMessage| -> BTreeMap<String, Vec<u8>> {
            headers(m, None)
                .unwrap()
                .iter()
                .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                .collect()
        };
        let unkeyed = all(&m);
        assert_eq!(unkeyed["traceparent"], b"00-a-b-01");
        assert_eq!(unkeyed["outbox-id"], m.id.to_string().as_bytes());
        assert_eq!(unkeyed["content-type"], b"application/json");
        assert_eq!(unkeyed["outbox-attempt"], b"1");
        assert!(
            !unkeyed.contains_key("outbox-seq"),
            "an unkeyed message has no sequence"
        );
        m.key = Some("order-7".into());
        m.seq = 42;
        let keyed = all(&m);
        assert_eq!(keyed["outbox-key"], b"order-7");
        assert_eq!(keyed["outbox-seq"], b"42");
    }
}

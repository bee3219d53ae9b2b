//! The `kafka` destination: an idempotent producer (librdkafka through `rdkafka`), so a
//! broker retry never writes a record twice. A message becomes one record on the topic its
//! template names (`{topic}` replaced), keyed by its `message_key` (every message of a key
//! goes to one partition, in order; the claim holds back a key's next message until the
//! head is settled) or, without a key, by its outbox_id. The message's own headers travel as
//! record headers, with the outbox metadata (`outbox-id`, the consumer's dedupe id;
//! `outbox-topic`, `outbox-key`, `outbox-attempt`) and `content-type` beside them.
//!
//! A message is delivered only when its delivery report confirms it; each report settles
//! its own message. A refusal the broker or the client will repeat (unknown topic or
//! partition, record too large, invalid record, authorization failed) is permanent with the
//! reason; everything else (broker unreachable, leader not available, timed out, queue
//! full) is retryable. The producer gives a message up at 90 % of the dispatch deadline, so
//! its own reason is the one recorded. A producer the broker fenced, or whose id or
//! sequence state it refused, is replaced by a new one (a new producer id), which is given
//! the records the old one could not write.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::RwLock;
use std::time::Duration;

use futures_util::future::BoxFuture;
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use super::{Destination, Setting, metadata, user_headers};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};

/// `type = "kafka"`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Comma-separated bootstrap brokers, `host:port` [default: 127.0.0.1:9092].
    pub brokers: Option<String>,
    /// Topic template [default: `{topic}`].
    pub topic: Option<String>,
    /// `client.id` [default: outbox-relay].
    pub client_id: Option<String>,
    /// Only `all` (or `-1`): the idempotent producer needs every in-sync replica's ack
    /// [default: all].
    pub acks: Option<String>,
    /// `none`, `gzip`, `snappy`, `lz4` or `zstd` [default: none].
    pub compression: Option<String>,
    /// How long the producer waits to fill a request, 0..=900000 [default: 0: a claimed
    /// batch is handed to the client at once, so its records share requests anyway].
    pub linger_ms: Option<i64>,
    /// The largest record the producer sends, 1000..=1000000000 [default: 1000000]; a
    /// larger message is refused for good (set it to the broker's `message.max.bytes`).
    pub message_max_bytes: Option<i64>,
    /// `plaintext`, `ssl`, `sasl_plaintext` or `sasl_ssl` [default: plaintext].
    pub security_protocol: Option<String>,
    /// `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512` (with a `sasl_*` protocol).
    pub sasl_mechanism: Option<String>,
    pub sasl_username: Option<String>,
    /// A secret: write it as `${NAME}` or `${file:PATH}`.
    pub sasl_password: Option<String>,
    /// CA certificates (PEM) to verify the brokers with [default: the system's].
    pub ssl_ca_location: Option<PathBuf>,
    /// Client certificate and key (PEM) for mutual TLS.
    pub ssl_certificate_location: Option<PathBuf>,
    pub ssl_key_location: Option<PathBuf>,
    pub ssl_key_password: Option<String>,
    /// Other librdkafka producer properties, passed through; the client refuses one it does
    /// not know at start-up.
    pub properties: Option<BTreeMap<String, toml::Value>>,
}

/// Properties with a setting of their own, or that the guarantees depend on.
const RESERVED: &[(&str, &str)] = &[
    ("bootstrap.servers", "set it as brokers"),
    ("metadata.broker.list", "set it as brokers"),
    ("client.id", "set it as client_id"),
    ("acks", "set it as acks"),
    ("request.required.acks", "set it as acks"),
    ("compression.type", "set it as compression"),
    ("compression.codec", "set it as compression"),
    ("linger.ms", "set it as linger_ms"),
    ("queue.buffering.max.ms", "set it as linger_ms"),
    ("message.max.bytes", "set it as message_max_bytes"),
    ("security.protocol", "set it as security_protocol"),
    ("sasl.mechanism", "set it as sasl_mechanism"),
    ("sasl.mechanisms", "set it as sasl_mechanism"),
    ("sasl.username", "set it as sasl_username"),
    ("sasl.password", "set it as sasl_password"),
    (
        "enable.idempotence",
        "the producer is always idempotent, so a broker retry never duplicates a record",
    ),
    (
        "message.timeout.ms",
        "it follows the destination's timeout_ms",
    ),
    (
        "delivery.timeout.ms",
        "it follows the destination's timeout_ms",
    ),
    (
        "transactional.id",
        "the destination does not use transactions",
    ),
];

impl KafkaConfig {
    /// Validates the settings and creates the producer, so a property the client refuses
    /// stops the start. The producer connects in the background.
    pub(super) fn build(&self, at: Setting<'_>, deadline: Duration) -> Result<Kafka, ConfigError> {
        let brokers = self.brokers.as_deref().unwrap_or("127.0.0.1:9092");
        check_brokers(at, brokers)?;
        let topic = self.topic.as_deref().unwrap_or("{topic}");
        if topic.trim().is_empty() {
            return Err(at.invalid("topic", "must not be empty"));
        }
        if let Some(bad) = topic
            .replace("{topic}", "")
            .chars()
            .find(|&c| !topic_char(c))
        {
            return Err(at.invalid(
                "topic",
                format!("{bad:?} cannot be in a Kafka topic name (letters, digits, '.', '_', '-')"),
            ));
        }
        let acks = self.acks.as_deref().unwrap_or("all");
        if !matches!(acks, "all" | "-1") {
            return Err(at.invalid(
                "acks",
                format!(
                    "{acks:?}: the idempotent producer needs acks = \"all\", so that a record \
                     the broker confirmed survives the leader"
                ),
            ));
        }
        let compression = self.compression.as_deref().unwrap_or("none");
        if !["none", "gzip", "snappy", "lz4", "zstd"].contains(&compression) {
            return Err(at.invalid(
                "compression",
                format!("{compression:?} is not one of none, gzip, snappy, lz4, zstd"),
            ));
        }
        // The producer gives a message up a little before the dispatch deadline, so that
        // the report carries the client's reason.
        let message_timeout = u64::try_from(deadline.as_millis() * 9 / 10)
            .unwrap_or(u64::MAX)
            .max(1);
        let linger = at.ranged("linger_ms", self.linger_ms, 0, 0, 900_000)?;
        if u64::try_from(linger).unwrap_or(0) >= message_timeout {
            return Err(at.invalid(
                "linger_ms",
                format!(
                    "{linger} must be shorter than the producer's message timeout \
                     ({message_timeout} ms, 90 % of timeout_ms)"
                ),
            ));
        }
        let max_bytes = at.ranged(
            "message_max_bytes",
            self.message_max_bytes,
            1_000_000,
            1000,
            1_000_000_000,
        )?;

        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", brokers)
            .set(
                "client.id",
                self.client_id.as_deref().unwrap_or("outbox-relay"),
            )
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("compression.type", compression)
            .set("linger.ms", linger.to_string())
            .set("message.max.bytes", max_bytes.to_string())
            .set("message.timeout.ms", message_timeout.to_string())
            // The Java client's partitioner: a key lands where a Java producer puts it.
            .set("partitioner", "murmur2_random")
            // A topic missing from the metadata is unknown after this long (librdkafka
            // waits 30 s by default, longer than a short deadline).
            .set(
                "topic.metadata.propagation.max.ms",
                (message_timeout / 3).max(1).to_string(),
            );
        // After an outage, reconnect within a second rather than librdkafka's 10 s, so the
        // circuit's probe finds the broker back.
        config.set("reconnect.backoff.max.ms", "1000");
        self.security(at, &mut config)?;
        for (key, value) in self.properties.iter().flatten() {
            let field = format!("properties.{key}");
            if let Some((_, why)) = RESERVED.iter().find(|(k, _)| k == key) {
                return Err(at.invalid(&field, format!("cannot be set here: {why}")));
            }
            let value = match value {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_) => {
                    value.to_string()
                }
                _ => {
                    return Err(at.invalid(&field, "must be a string, number or boolean"));
                }
            };
            config.set(key, value);
        }
        let producer = create(&config).map_err(|e| match e {
            KafkaError::ClientConfig(_, description, key, _) => {
                let field = if self.properties.iter().flatten().any(|(k, _)| *k == key) {
                    format!("properties.{key}")
                } else {
                    key
                };
                at.invalid(
                    &field,
                    format!("refused by the Kafka client: {description}"),
                )
            }
            other => at.invalid("properties", format!("the Kafka client refused: {other}")),
        })?;
        Ok(Kafka {
            config,
            producer: RwLock::new(producer),
            topic: topic.to_owned(),
            brokers: brokers.to_owned(),
            readiness_timeout: deadline.min(Duration::from_secs(5)),
        })
    }

    /// The TLS and SASL settings, checked for what the client would only find on connecting.
    fn security(&self, at: Setting<'_>, config: &mut ClientConfig) -> Result<(), ConfigError> {
        let protocol = self.security_protocol.as_deref().unwrap_or("plaintext");
        if !["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"].contains(&protocol) {
            return Err(at.invalid(
                "security_protocol",
                format!("{protocol:?} is not one of plaintext, ssl, sasl_plaintext, sasl_ssl"),
            ));
        }
        config.set("security.protocol", protocol);
        let sasl = protocol.starts_with("sasl_");
        match (&self.sasl_mechanism, sasl) {
            (None, true) => {
                return Err(at.invalid(
                    "sasl_mechanism",
                    format!("security_protocol {protocol:?} needs a SASL mechanism"),
                ));
            }
            (Some(_), false) => {
                return Err(at.invalid(
                    "sasl_mechanism",
                    format!("is used with security_protocol sasl_plaintext or sasl_ssl, not {protocol:?}"),
                ));
            }
            (Some(mechanism), true) => {
                if !["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"].contains(&mechanism.as_str()) {
                    return Err(at.invalid(
                        "sasl_mechanism",
                        format!("{mechanism:?} is not one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"),
                    ));
                }
                let username = self
                    .sasl_username
                    .as_deref()
                    .ok_or_else(|| at.invalid("sasl_username", format!("{mechanism} needs it")))?;
                let password = self
                    .sasl_password
                    .as_deref()
                    .ok_or_else(|| at.invalid("sasl_password", format!("{mechanism} needs it")))?;
                config
                    .set("sasl.mechanism", mechanism)
                    .set("sasl.username", username)
                    .set("sasl.password", password);
            }
            (None, false) => {
                if self.sasl_username.is_some() || self.sasl_password.is_some() {
                    return Err(at.invalid(
                        "sasl_username",
                        "SASL credentials need security_protocol sasl_plaintext or sasl_ssl",
                    ));
                }
            }
        }
        let files = [
            ("ssl_ca_location", "ssl.ca.location", &self.ssl_ca_location),
            (
                "ssl_certificate_location",
                "ssl.certificate.location",
                &self.ssl_certificate_location,
            ),
            (
                "ssl_key_location",
                "ssl.key.location",
                &self.ssl_key_location,
            ),
        ];
        for (field, property, path) in files {
            let Some(path) = path else { continue };
            if !protocol.ends_with("ssl") {
                return Err(at.invalid(
                    field,
                    format!("is used with security_protocol ssl or sasl_ssl, not {protocol:?}"),
                ));
            }
            std::fs::File::open(path)
                .map_err(|e| at.invalid(field, format!("{}: {e}", path.display())))?;
            config.set(property, path.display().to_string());
        }
        if let Some(password) = &self.ssl_key_password {
            config.set("ssl.key.password", password);
        }
        Ok(())
    }
}

fn check_brokers(at: Setting<'_>, brokers: &str) -> Result<(), ConfigError> {
    for broker in brokers.split(',').map(str::trim) {
        let port = broker
            .rsplit_once(':')
            .filter(|(host, _)| !host.is_empty() && !host.contains('/'))
            .and_then(|(_, port)| port.parse::<u16>().ok());
        if port.is_none() {
            return Err(at.invalid(
                "brokers",
                format!("{broker:?} is not host:port (comma-separated, no scheme)"),
            ));
        }
    }
    Ok(())
}

fn topic_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

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

/// The record headers of `m`: its own, then `content-type` and the outbox metadata.
fn headers(m: &ClaimedMessage) -> Result<OwnedHeaders, String> {
    let own = user_headers(m)?;
    let outbox = metadata(m);
    let all = own
        .iter()
        .map(|(n, v)| (*n, v.as_str()))
        .chain([("content-type", m.content_type.as_str())])
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
    /// per message, and whether its error left the producer unusable.
    async fn produce(
        &self,
        producer: &FutureProducer,
        batch: &[&ClaimedMessage],
    ) -> Vec<(Outcome, bool)> {
        // Hand every record to the client first, then wait for the reports: the client
        // batches them into requests.
        let mut pending = Vec::with_capacity(batch.len());
        for m in batch {
            let topic = self.topic.replace("{topic}", &m.topic);
            if topic.is_empty() || topic.len() > 249 || !topic.chars().all(topic_char) {
                let reason = format!(
                    "{topic:?} is not a valid Kafka topic name (1 to 249 letters, digits, '.', '_', '-')"
                );
                pending.push((topic, Err(Outcome::Permanent { reason })));
                continue;
            }
            let headers = match headers(m) {
                Ok(h) => h,
                Err(reason) => {
                    pending.push((topic, Err(Outcome::Permanent { reason })));
                    continue;
                }
            };
            let id = m.id.to_string();
            let key = m.key.as_deref().unwrap_or(&id);
            let record = FutureRecord::to(&topic)
                .key(key)
                .payload(&m.payload)
                .headers(headers);
            let sent = producer
                .send_result(record)
                .map_err(|(e, _)| classify(&topic, &e));
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
}

impl Destination for Kafka {
    fn publish<'a>(&'a self, batch: &'a [ClaimedMessage]) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let producer = self.producer();
            let all: Vec<&ClaimedMessage> = batch.iter().collect();
            let mut outcomes = self.produce(&producer, &all).await;
            let again: Vec<usize> = (0..outcomes.len()).filter(|&i| outcomes[i].1).collect();
            if !again.is_empty() {
                // The producer cannot go on (fenced, its id or sequence refused): the
                // records it could not write are given once to its replacement, so that
                // the message does not pay an attempt for the producer's state.
                let fresh = self.replace(&producer);
                // The last handle of a replaced producer purges and flushes it (up to half a
                // second) and joins its thread: not on the runtime's threads.
                tokio::task::spawn_blocking(move || drop(producer));
                let retry: Vec<&ClaimedMessage> = again.iter().map(|&i| &batch[i]).collect();
                for (i, outcome) in again.into_iter().zip(self.produce(&fresh, &retry).await) {
                    outcomes[i] = outcome;
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(toml: &str) -> Result<Kafka, ConfigError> {
        let config: KafkaConfig = toml::from_str(toml).unwrap();
        config.build(Setting("k"), Duration::from_secs(30))
    }

    fn refused(toml: &str) -> ConfigError {
        match build(toml) {
            Ok(_) => panic!("{toml} was accepted"),
            Err(e) => e,
        }
    }

    #[test]
    fn defaults_build_an_idempotent_producer() {
        let k = build("").unwrap();
        let get = |key| k.config.get(key).map(str::to_owned);
        assert_eq!(get("enable.idempotence").as_deref(), Some("true"));
        assert_eq!(get("acks").as_deref(), Some("all"));
        assert_eq!(get("bootstrap.servers").as_deref(), Some("127.0.0.1:9092"));
        assert_eq!(get("message.timeout.ms").as_deref(), Some("27000"));
    }

    #[test]
    fn bad_settings_name_their_field() {
        let cases = [
            ("brokers = \"kafka://a:9092\"", "destinations.k.brokers"),
            ("brokers = \"a\"", "destinations.k.brokers"),
            ("topic = \"a/{topic}\"", "destinations.k.topic"),
            ("acks = \"1\"", "destinations.k.acks"),
            ("compression = \"brotli\"", "destinations.k.compression"),
            ("linger_ms = 30000", "destinations.k.linger_ms"),
            ("message_max_bytes = 10", "destinations.k.message_max_bytes"),
            (
                "security_protocol = \"tls\"",
                "destinations.k.security_protocol",
            ),
            (
                "security_protocol = \"sasl_ssl\"",
                "destinations.k.sasl_mechanism",
            ),
            (
                "security_protocol = \"sasl_ssl\"\nsasl_mechanism = \"PLAIN\"",
                "destinations.k.sasl_username",
            ),
            (
                "security_protocol = \"ssl\"\nssl_ca_location = \"/nonexistent/ca.pem\"",
                "destinations.k.ssl_ca_location",
            ),
            (
                "[properties]\n\"enable.idempotence\" = false",
                "destinations.k.properties.enable.idempotence",
            ),
            (
                "[properties]\n\"no.such.property\" = 1",
                "destinations.k.properties.no.such.property",
            ),
            (
                "[properties]\n\"batch.num.messages\" = \"many\"",
                "destinations.k.properties.batch.num.messages",
            ),
        ];
        for (toml, setting) in cases {
            let err = refused(toml);
            assert_eq!(err.setting, setting, "{toml}: {err}");
        }
    }

    #[test]
    fn properties_reach_the_client() {
        let k = build(
            "[properties]\n\"batch.num.messages\" = 500\n\"socket.keepalive.enable\" = true\n",
        )
        .unwrap();
        assert_eq!(k.config.get("batch.num.messages"), Some("500"));
        assert_eq!(k.config.get("socket.keepalive.enable"), Some("true"));
    }

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

    #[test]
    fn headers_carry_the_outbox_metadata_beside_the_message_own() {
        use rdkafka::message::Headers;
        let m = ClaimedMessage::example(serde_json::json!({"traceparent": "00-a-b-01"}));
        let h = headers(&m).unwrap();
        let all: BTreeMap<&str, &[u8]> = h
            .iter()
            .map(|h| (h.key, h.value.unwrap_or_default()))
            .collect();
        assert_eq!(all["traceparent"], b"00-a-b-01");
        assert_eq!(all["outbox-id"], m.id.to_string().as_bytes());
        assert_eq!(all["content-type"], b"application/json");
        assert_eq!(all["outbox-attempt"], b"1");
    }
}

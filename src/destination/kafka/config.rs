//! The `kafka` destination's settings: what `[destinations.NAME]` may hold, checked before
//! anything connects (brokers, topic template, acks, compression, TLS and SASL, extra client
//! properties minus those the destination must own), and the producer they build.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::RwLock;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;

use super::debezium::{self, Debezium};
use super::{Kafka, create};
use crate::destination::Setting;
use crate::destination::cloudevents::{self, Envelope};
use crate::error::ConfigError;

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
    /// `"cloudevents"` to send each message as a CloudEvent, `"debezium"` to write it as
    /// Debezium's outbox event router does [default: none].
    pub envelope: Option<String>,
    /// With the debezium envelope: the message headers placed in the record, Debezium's
    /// `table.fields.additional.placement` (`type:header:eventType,…`) [default: none].
    pub debezium_placement: Option<String>,
    /// With the debezium envelope: `json` (the payload expanded) or `string` (a JSON string
    /// of its text) [default: json].
    pub debezium_value: Option<String>,
    /// With the debezium envelope: an empty payload as a tombstone [default: false].
    pub debezium_tombstone_on_empty_payload: Option<bool>,
    /// `"binary"` or `"structured"` [default: binary].
    pub cloudevents_mode: Option<String>,
    /// The CloudEvents `source` template [default: /outbox-relay].
    pub cloudevents_source: Option<String>,
    /// The CloudEvents `type` template [default: `{topic}`].
    pub cloudevents_type: Option<String>,
    /// Produce a key's run of messages in one call, in enqueue order, instead of a key's
    /// next message only once the one before it was delivered [default: false]. The
    /// idempotent producer writes a partition's records in the order they were produced;
    /// a record refused for good is dead-lettered while the later records of its key may
    /// already be written.
    pub runs_in_one_call: Option<bool>,
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
    pub(in crate::destination) fn build(
        &self,
        at: Setting<'_>,
        deadline: Duration,
    ) -> Result<Kafka, ConfigError> {
        let brokers = self.brokers.as_deref().unwrap_or("127.0.0.1:9092");
        check_brokers(at, brokers)?;
        let debezium = self.debezium(at)?;
        let default_topic = if debezium.is_some() {
            debezium::DEFAULT_TOPIC
        } else {
            "{topic}"
        };
        // Debezium's name for the routed value, so that its replacement template pastes.
        let topic = self
            .topic
            .as_deref()
            .unwrap_or(default_topic)
            .replace("${routedByValue}", "{topic}");
        let topic = topic.as_str();
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
        let envelope = Envelope::from_settings(
            at,
            &cloudevents::Settings {
                envelope: self.envelope.as_deref().filter(|e| *e != "debezium"),
                mode: self.cloudevents_mode.as_deref(),
                source: self.cloudevents_source.as_deref(),
                kind: self.cloudevents_type.as_deref(),
            },
        )?;
        if debezium.is_some()
            && let Some(field) = [
                ("cloudevents_mode", &self.cloudevents_mode),
                ("cloudevents_source", &self.cloudevents_source),
                ("cloudevents_type", &self.cloudevents_type),
            ]
            .iter()
            .find_map(|(field, v)| v.is_some().then_some(*field))
        {
            return Err(at.invalid(field, "is used only with envelope = \"cloudevents\""));
        }
        Ok(Kafka {
            envelope,
            debezium,
            config,
            producer: RwLock::new(producer),
            topic: topic.to_owned(),
            brokers: brokers.to_owned(),
            readiness_timeout: deadline.min(Duration::from_secs(5)),
            runs_in_one_call: self.runs_in_one_call.unwrap_or(false),
        })
    }

    /// The debezium envelope, when `envelope = "debezium"`; its settings are refused with
    /// any other envelope.
    fn debezium(&self, at: Setting<'_>) -> Result<Option<Debezium>, ConfigError> {
        match self.envelope.as_deref() {
            None | Some("none" | "cloudevents" | "debezium") => {}
            Some(other) => {
                return Err(at.invalid(
                    "envelope",
                    format!(
                        "{other:?} is not an envelope of the kafka destination: \"none\", \
                         \"cloudevents\" or \"debezium\""
                    ),
                ));
            }
        }
        if self.envelope.as_deref() == Some("debezium") {
            return Debezium::from_settings(
                at,
                self.debezium_placement.as_deref(),
                self.debezium_value.as_deref(),
                self.debezium_tombstone_on_empty_payload,
            )
            .map(Some);
        }
        let stray = [
            ("debezium_placement", self.debezium_placement.is_some()),
            ("debezium_value", self.debezium_value.is_some()),
            (
                "debezium_tombstone_on_empty_payload",
                self.debezium_tombstone_on_empty_payload.is_some(),
            ),
        ];
        match stray.iter().find(|(_, set)| *set) {
            Some((field, _)) => Err(at.invalid(field, "is used only with envelope = \"debezium\"")),
            None => Ok(None),
        }
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

pub(super) fn topic_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
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
}

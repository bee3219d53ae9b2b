//! Destinations. Each is one module that owns everything about it: its `[destinations.NAME]`
//! settings (serde, unknown keys refused, defaults, validation naming
//! `destinations.NAME.FIELD`), building it, publishing a batch, and classifying what the
//! destination answered into delivered / retryable / permanent. The `destinations!` list
//! below is the one place that registers them; `docs/adding-a-destination.md` lists every
//! place a new destination touches.
//!
//! A destination publishes a batch and answers one [`Outcome`] per message, in batch order,
//! only after the destination acknowledged or refused it.
//!
//! A batch travels with its publish [`Window`]: until when this relayer may still send under
//! the leases it holds. A call to the destination's server is one unit: before each one
//! (a request, a pipeline flush, a produce call, a publish frame) the destination checks
//! [`Window::check`], and a message it may no longer send is answered with the
//! [`Outcome::NotAttempted`] that check gives, without being sent. A destination that sends
//! a whole batch in one call checks once, before that call; one that sends a request per
//! message checks before each request, so that a relayer frozen part-way through a batch
//! and woken after its leases were taken over sends none of the rest. The dispatch layer
//! checks too, before each call of `publish`. Apart from that outcome, a destination never
//! answers [`Outcome::NotAttempted`]: it is the dispatch layer's (circuits, deadlines,
//! budgets).
//! Keys: a claim may hold ordered runs of one key (a key's head and the messages after it,
//! in enqueue order). A destination declares with [`Destination::keeps_key_order`] whether
//! it can take a run in one call:
//!
//! - one that does not (the default) is never given two messages with the same key in one
//!   batch, so it may deliver a batch's messages in any order or in parallel; the dispatch
//!   layer splits runs into successive calls, a key's next message only after its
//!   predecessor was delivered;
//! - one that does (Pub/Sub with ordering keys; with `runs_in_one_call`, Kinesis with
//!   partition keys, SQS FIFO queues with message groups and Kafka with partitions) is
//!   given the whole part, runs included, and sends a key's messages in enqueue order: in
//!   one request where the service keeps the order within a request, else in requests one
//!   after the other ([`calls`] cuts them), a key's later request only once the earlier one
//!   delivered all of the key's messages in it, or (Kafka) handed to a client that keeps a
//!   partition's order across the requests it has in flight. What
//!   follows a message of its key that was not delivered is not sent
//!   ([`Outcome::NotAttempted`]); where a service takes a request's entries one by one and
//!   may refuse one and take those after it, the dispatch layer counts those after it not
//!   delivered (see `dispatch`), so that the outbox never records a key's message delivered
//!   after its predecessor failed.
//!
//! A problem with one message (a header the protocol cannot carry, a payload refused) makes
//! that message permanent, never the batch.

#[cfg(feature = "amqp")]
mod amqp;
#[cfg(feature = "aws")]
mod aws;
#[cfg(any(feature = "aws", feature = "pubsub"))]
mod calls;
#[cfg_attr(
    not(any(
        feature = "http",
        feature = "nats",
        feature = "amqp",
        feature = "redis",
        feature = "kafka",
        feature = "mqtt"
    )),
    allow(dead_code)
)]
mod cloudevents;
#[cfg(feature = "http")]
mod http;
mod jsonl;
#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "mqtt")]
mod mqtt;
#[cfg(feature = "nats")]
mod nats;
mod null;
#[cfg(feature = "pubsub")]
mod pubsub;
#[cfg(feature = "redis")]
mod redis;
mod window;

#[cfg(feature = "aws")]
pub use aws::sdk_config as aws_sdk_config;
pub use window::{DEADLINE_PASSED, WINDOW_CLOSED, Window};

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};

/// A destination, built from its [`DestinationConfig`].
pub trait Destination: Send + Sync + 'static {
    /// Publishes `batch` and returns exactly one outcome per message, in the same order;
    /// sends nothing once `window` has closed (checked before each call to the server).
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>>;

    /// Whether the destination can take messages now (for /readyz); the error says why not.
    fn ready(&self) -> BoxFuture<'_, Result<(), String>>;

    /// Whether one call of `publish` may be given several messages of one key (a run, in
    /// enqueue order) because the destination delivers them in that order: in one request
    /// the service keeps in order, or in requests sent one after the other. `false` (the
    /// default): a batch never holds two messages with the same key.
    fn keeps_key_order(&self) -> bool {
        false
    }
}

/// The one list of destinations: each line names a destination's variant of
/// [`DestinationConfig`], its `type` as written in the config, the cargo feature that
/// builds it (`if "feature"`; none for those always built), and its settings type. The
/// enum, [`DestinationConfig::kind`], [`DestinationConfig::KINDS`] and the factory
/// ([`DestinationConfig::build`]) are generated from it, so a destination is registered
/// here and nowhere else in the library. Every settings type has
/// `build(&self, Setting, deadline) -> Result<impl Destination, ConfigError>`. A type whose
/// feature is off still parses (as [`NotBuilt`]), so that its config is refused naming the
/// feature rather than as an unknown type.
macro_rules! destinations {
    ($($(#[$attr:meta])* $variant:ident = $kind:literal $(if $feature:literal)? => $config:ty,)*) => {
        /// One `[destinations.NAME]` table's destination part, chosen by its `type`.
        #[derive(Clone, Debug, serde::Deserialize)]
        #[serde(tag = "type")]
        pub enum DestinationConfig {
            $(
                $(#[$attr])*
                #[cfg(all($(feature = $feature)?))]
                #[serde(rename = $kind)]
                $variant($config),
                $(
                    #[cfg(not(feature = $feature))]
                    #[serde(rename = $kind)]
                    $variant(NotBuilt),
                )?
            )*
        }

        impl DestinationConfig {
            /// Every `type`, in the order of the list (those this build leaves out too).
            pub const KINDS: &'static [&'static str] = &[$($kind),*];

            /// The `type` as written in the config.
            pub fn kind(&self) -> &'static str {
                match self {
                    $(Self::$variant(_) => $kind,)*
                }
            }

            /// Validates the settings of destination `name` and builds it. `deadline` is the
            /// dispatch deadline of a batch: clients that have timeouts of their own use it
            /// too. Network destinations connect on first use, not here.
            pub fn build(
                &self,
                name: &str,
                deadline: Duration,
            ) -> Result<Arc<dyn Destination>, ConfigError> {
                let at = Setting(name);
                Ok(match self {
                    $(
                        #[cfg(all($(feature = $feature)?))]
                        Self::$variant(c) => Arc::new(c.build(at, deadline)?),
                        $(
                            #[cfg(not(feature = $feature))]
                            Self::$variant(_) => return Err(at.not_built($kind, $feature)),
                        )?
                    )*
                })
            }
        }
    };
}

destinations! {
    Stdout = "stdout" => jsonl::StdoutConfig,
    File = "file" => jsonl::FileConfig,
    Null = "null" => null::NullConfig,
    Http = "http" if "http" => http::HttpConfig,
    Nats = "nats" if "nats" => nats::NatsConfig,
    Amqp = "amqp" if "amqp" => amqp::AmqpConfig,
    Redis = "redis" if "redis" => redis::RedisConfig,
    /// Boxed: its settings are several times the size of the others'.
    Kafka = "kafka" if "kafka" => Box<kafka::KafkaConfig>,
    Mqtt = "mqtt" if "mqtt" => mqtt::MqttConfig,
    Pubsub = "pubsub" if "pubsub" => pubsub::PubsubConfig,
    Sqs = "sqs" if "aws" => aws::SqsConfig,
    Sns = "sns" if "aws" => aws::SnsConfig,
    Eventbridge = "eventbridge" if "aws" => aws::EventBridgeConfig,
    Kinesis = "kinesis" if "aws" => aws::KinesisConfig,
}

/// The settings of a destination type this build leaves out (its cargo feature is off):
/// whatever they are, building it is refused, naming the feature.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct NotBuilt {}

impl DestinationConfig {
    /// The `stdout` destination (the default of a relayer given no destinations).
    pub fn stdout() -> Self {
        Self::Stdout(jsonl::StdoutConfig {})
    }

    /// The `file` destination appending to `path`.
    pub fn file(path: std::path::PathBuf, fsync: Option<bool>) -> Self {
        Self::File(jsonl::FileConfig { path, fsync })
    }

    /// The `null` destination, acknowledging after `latency_ms`.
    pub fn null(latency_ms: Option<i64>) -> Self {
        Self::Null(null::NullConfig { latency_ms })
    }
}

/// Names the settings of destination `.0` in errors: `destinations.NAME.FIELD`.
#[derive(Clone, Copy)]
struct Setting<'a>(&'a str);

impl Setting<'_> {
    /// A destination of `kind`, which this build left out with its cargo `feature`.
    #[allow(
        dead_code,
        reason = "used only by a build without some destination feature"
    )]
    fn not_built(self, kind: &str, feature: &str) -> ConfigError {
        self.invalid(
            "type",
            format!(
                "\"{kind}\" destinations are not in this build of outbox-relay: it was \
                 built without the cargo feature `{feature}` (rebuild with `--features \
                 {feature}`, or with the default features, which include every destination)"
            ),
        )
    }

    fn invalid(self, field: &str, problem: impl Into<String>) -> ConfigError {
        ConfigError {
            setting: format!("destinations.{}.{field}", self.0),
            problem: problem.into(),
        }
    }

    /// `value` (or `default`) checked against `min..=max`.
    fn ranged(
        self,
        field: &str,
        value: Option<i64>,
        default: i64,
        min: i64,
        max: i64,
    ) -> Result<i64, ConfigError> {
        let value = value.unwrap_or(default);
        if (min..=max).contains(&value) {
            Ok(value)
        } else {
            Err(self.invalid(field, format!("{value} is out of range {min}..={max}")))
        }
    }
}

/// The message's own headers (its `headers` object), as name/value text. A string value is
/// taken as is, a number or boolean as its JSON text; anything else is refused with the
/// reason, which makes that message permanent.
#[cfg_attr(
    not(any(
        feature = "http",
        feature = "nats",
        feature = "amqp",
        feature = "redis",
        feature = "kafka",
        feature = "mqtt"
    )),
    allow(dead_code)
)]
fn user_headers(m: &ClaimedMessage) -> Result<Vec<(&str, String)>, String> {
    let object = match &m.headers {
        serde_json::Value::Null => return Ok(Vec::new()),
        serde_json::Value::Object(o) => o,
        other => {
            return Err(format!(
                "headers must be a JSON object of names to values, not {}",
                json_kind(other)
            ));
        }
    };
    object
        .iter()
        .map(|(name, value)| match value {
            serde_json::Value::String(s) => Ok((name.as_str(), s.clone())),
            serde_json::Value::Number(n) => Ok((name.as_str(), n.to_string())),
            serde_json::Value::Bool(b) => Ok((name.as_str(), b.to_string())),
            other => Err(format!(
                "header {name:?}: a value must be a string, number or boolean, not {}",
                json_kind(other)
            )),
        })
        .collect()
}

#[cfg_attr(
    not(any(
        feature = "http",
        feature = "nats",
        feature = "amqp",
        feature = "redis",
        feature = "kafka",
        feature = "mqtt"
    )),
    allow(dead_code)
)]
fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The outbox metadata every header-carrying destination sends beside the message's own
/// headers (and over them, on a clash: the consumer's dedupe id must be the outbox_id). A
/// keyed message also carries its key and its sequence (`outbox-seq`, increasing in the
/// key's enqueue order), so that a consumer can drop a rewound run by the last sequence it
/// saw for the key; an unkeyed message has no order, and so no sequence.
#[cfg_attr(
    not(any(
        feature = "http",
        feature = "nats",
        feature = "amqp",
        feature = "redis",
        feature = "kafka",
        feature = "mqtt"
    )),
    allow(dead_code)
)]
fn metadata(m: &ClaimedMessage) -> Vec<(&'static str, String)> {
    let mut headers = vec![
        ("outbox-id", m.id.to_string()),
        ("outbox-topic", m.topic.clone()),
        ("outbox-attempt", m.attempt_no.to_string()),
    ];
    if let Some(key) = &m.key {
        headers.push(("outbox-key", key.clone()));
        headers.push(("outbox-seq", m.seq.to_string()));
    }
    headers
}

/// TLS (HTTPS, AMQPS) uses rustls with the ring provider, installed once per process.
#[cfg_attr(
    not(any(feature = "http", feature = "amqp", feature = "mqtt")),
    allow(dead_code)
)]
fn install_tls_provider() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        // Err means another provider is installed already, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A type this build leaves out parses, and building it names the feature to enable.
    #[test]
    #[cfg(not(feature = "mqtt"))]
    fn a_type_built_without_its_feature_names_the_feature() {
        let config = parse("type = \"mqtt\"\nurl = \"mqtt://x\"\n").unwrap();
        let err = config.build("d", Duration::from_secs(1)).err().unwrap();
        assert_eq!(err.setting, "destinations.d.type");
        assert!(err.problem.contains("feature `mqtt`"), "{err}");
    }

    fn parse(toml: &str) -> Result<DestinationConfig, String> {
        toml::from_str(toml).map_err(|e| e.to_string())
    }

    /// Whether the destination `toml` configures takes a key's run in one call.
    #[cfg(any(feature = "aws", feature = "kafka"))]
    fn keeps_key_order(toml: &str) -> bool {
        parse(toml)
            .unwrap()
            .build("d", Duration::from_secs(1))
            .unwrap()
            .keeps_key_order()
    }

    /// Kinesis and SQS FIFO answer per record and go on after a refused one, so a key's run
    /// goes in one call only where `runs_in_one_call` says so; by default one message of a
    /// key per call keeps a key's first deliveries in enqueue order.
    #[test]
    #[cfg(feature = "aws")]
    fn a_keys_run_goes_in_one_call_only_where_runs_in_one_call_is_set() {
        let keeps = |toml: &str| {
            keeps_key_order(&format!(
                "{toml}region = \"us-east-1\"\nendpoint_url = \"http://127.0.0.1:1\"\n"
            ))
        };
        assert!(!keeps("type = \"kinesis\"\n"));
        assert!(keeps("type = \"kinesis\"\nruns_in_one_call = true\n"));
        assert!(!keeps("type = \"sqs\"\nqueue = \"orders.fifo\"\n"));
        assert!(keeps(
            "type = \"sqs\"\nqueue = \"orders.fifo\"\nruns_in_one_call = true\n"
        ));
        assert!(!keeps(
            "type = \"sqs\"\nqueue = \"orders\"\nruns_in_one_call = true\n"
        ));
    }

    /// Kafka's idempotent producer keeps a partition's order, but the setting stays the
    /// operator's choice there too.
    #[test]
    #[cfg(feature = "kafka")]
    fn a_kafka_destination_takes_runs_in_one_call_only_when_set() {
        assert!(!keeps_key_order("type = \"kafka\"\n"));
        assert!(keeps_key_order(
            "type = \"kafka\"\nruns_in_one_call = true\n"
        ));
        assert!(!keeps_key_order(
            "type = \"kafka\"\nruns_in_one_call = false\n"
        ));
    }

    #[test]
    #[cfg(all(feature = "redis", feature = "kafka"))]
    fn each_type_refuses_keys_it_does_not_know() {
        assert!(parse("type = \"redis\"\nstream = \"s\"\n").is_ok());
        let err = parse("type = \"redis\"\nstreem = \"s\"\n").unwrap_err();
        assert!(err.contains("streem"), "{err}");
        let err = parse("type = \"kafkaa\"\n").unwrap_err();
        assert!(err.contains("kafkaa"), "{err}");
        let err = parse("type = \"kafka\"\nbroker = \"a:1\"\n").unwrap_err();
        assert!(err.contains("broker"), "{err}");
    }

    #[test]
    #[cfg(all(
        feature = "http",
        feature = "nats",
        feature = "amqp",
        feature = "redis",
        feature = "kafka",
        feature = "mqtt"
    ))]
    fn bad_values_name_their_setting() {
        let cases = [
            ("type = \"http\"\nurl = \"ftp://x\"\n", "destinations.d.url"),
            (
                "type = \"http\"\nurl = \"http://x\"\nconcurrency = 0\n",
                "destinations.d.concurrency",
            ),
            (
                "type = \"http\"\nurl = \"http://x\"\nsigning_secret = \"whsec_!!\"\n",
                "destinations.d.signing_secret",
            ),
            (
                "type = \"null\"\nlatency_ms = -1\n",
                "destinations.d.latency_ms",
            ),
            (
                "type = \"nats\"\nurl = \"nats://a:b:c:d\"\n",
                "destinations.d.url",
            ),
            (
                "type = \"amqp\"\nurl = \"http://x\"\n",
                "destinations.d.url",
            ),
            (
                "type = \"redis\"\nurl = \"mongodb://x\"\n",
                "destinations.d.url",
            ),
            ("type = \"redis\"\nmaxlen = 0\n", "destinations.d.maxlen"),
            (
                "type = \"nats\"\nsubject = \"\"\n",
                "destinations.d.subject",
            ),
            (
                "type = \"http\"\nurl = \"http://x\"\nenvelope = \"xml\"\n",
                "destinations.d.envelope",
            ),
            (
                "type = \"kafka\"\nenvelope = \"cloudevents\"\ncloudevents_mode = \"batch\"\n",
                "destinations.d.cloudevents_mode",
            ),
            ("type = \"mqtt\"\nurl = \"tcp://x\"\n", "destinations.d.url"),
            (
                "type = \"mqtt\"\nprotocol = \"4\"\n",
                "destinations.d.protocol",
            ),
            (
                "type = \"mqtt\"\ntopic = \"a/+/{topic}\"\n",
                "destinations.d.topic",
            ),
            (
                "type = \"mqtt\"\nprotocol = \"3.1.1\"\nenvelope = \"cloudevents\"\n",
                "destinations.d.cloudevents_mode",
            ),
        ];
        for (toml, setting) in cases {
            let config = parse(toml).unwrap();
            let err = match config.build("d", Duration::from_secs(1)) {
                Ok(_) => panic!("{toml} was accepted"),
                Err(e) => e,
            };
            assert_eq!(err.setting, setting, "{toml}: {err}");
        }
    }

    /// Runs in a build without the feature (`cargo test --lib --no-default-features`).
    #[cfg(not(feature = "pubsub"))]
    #[test]
    fn a_type_compiled_out_is_refused_naming_its_feature() {
        let config = parse("type = \"pubsub\"\nproject = \"p\"\n").unwrap();
        assert_eq!(config.kind(), "pubsub");
        let err = match config.build("d", Duration::from_secs(1)) {
            Ok(_) => panic!("a type this build does not have was built"),
            Err(e) => e,
        };
        assert_eq!(err.setting, "destinations.d.type");
        assert!(
            err.problem.contains("cargo feature \"pubsub\""),
            "{}",
            err.problem
        );
    }

    #[test]
    fn headers_are_text_and_a_nested_value_is_refused_with_its_name() {
        let m = ClaimedMessage::example(
            serde_json::json!({"traceparent": "00-ab-cd-01", "n": 3, "ok": true}),
        );
        let mut h = user_headers(&m).unwrap();
        h.sort();
        assert_eq!(
            h,
            vec![
                ("n", "3".into()),
                ("ok", "true".into()),
                ("traceparent", "00-ab-cd-01".into())
            ]
        );
        let err =
            user_headers(&ClaimedMessage::example(serde_json::json!({"x": {"y": 1}}))).unwrap_err();
        assert!(err.contains("\"x\"") && err.contains("an object"), "{err}");
        let err = user_headers(&ClaimedMessage::example(serde_json::json!([1]))).unwrap_err();
        assert!(err.contains("JSON object"), "{err}");
    }
}

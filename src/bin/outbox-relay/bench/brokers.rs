//! The destination servers a `--destination` run delivers to: what each needs on its
//! server (a stream, a queue, a topic), the destination built from its settings as the
//! relayer builds it, and what is removed afterwards.

use std::sync::Arc;
#[cfg_attr(not(any(feature = "kafka", feature = "aws")), allow(unused_imports))]
use std::time::Duration;

use anyhow::{Context, Result};

use outbox_relay::destination::{Destination, DestinationConfig};

use super::BENCH_DEADLINE;

/// What a destination benchmark leaves behind and removes afterwards.
pub(super) enum Cleanup {
    Nothing,
    #[cfg(feature = "nats")]
    NatsStream(async_nats::jetstream::Context),
    #[cfg(feature = "amqp")]
    AmqpQueue(lapin::Channel),
    #[cfg(feature = "redis")]
    RedisStream(redis::aio::MultiplexedConnection),
    #[cfg(feature = "kafka")]
    KafkaTopic(rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>),
    /// The topic's URL on the Pub/Sub emulator.
    #[cfg(feature = "pubsub")]
    PubsubTopic(String),
    /// The queue's URL.
    #[cfg(feature = "aws")]
    SqsQueue(aws_sdk_sqs::Client, String),
    /// The topic's ARN.
    #[cfg(feature = "aws")]
    SnsTopic(aws_sdk_sns::Client, String),
    #[cfg(feature = "aws")]
    EventBus(aws_sdk_eventbridge::Client),
    #[cfg(feature = "aws")]
    KinesisStream(aws_sdk_kinesis::Client),
}

impl Cleanup {
    pub(super) async fn run(self) {
        let _: Result<(), String> = match self {
            Cleanup::Nothing => Ok(()),
            #[cfg(feature = "nats")]
            Cleanup::NatsStream(js) => js
                .delete_stream(BENCH_TARGET)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            #[cfg(feature = "amqp")]
            Cleanup::AmqpQueue(ch) => ch
                .queue_delete(
                    BENCH_TARGET.into(),
                    lapin::options::QueueDeleteOptions::default(),
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            #[cfg(feature = "redis")]
            Cleanup::RedisStream(mut r) => redis::cmd("DEL")
                .arg(format!("{BENCH_TARGET}:bench"))
                .query_async::<()>(&mut r)
                .await
                .map_err(|e| e.to_string()),
            #[cfg(feature = "kafka")]
            Cleanup::KafkaTopic(admin) => admin
                .delete_topics(&[BENCH_TARGET], &rdkafka::admin::AdminOptions::new())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            #[cfg(feature = "pubsub")]
            Cleanup::PubsubTopic(url) => reqwest::Client::new()
                .delete(url)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            #[cfg(feature = "aws")]
            Cleanup::SqsQueue(client, url) => client
                .delete_queue()
                .queue_url(url)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            #[cfg(feature = "aws")]
            Cleanup::SnsTopic(client, arn) => client
                .delete_topic()
                .topic_arn(arn)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            #[cfg(feature = "aws")]
            Cleanup::EventBus(client) => client
                .delete_event_bus()
                .name(BENCH_TARGET)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            #[cfg(feature = "aws")]
            Cleanup::KinesisStream(client) => client
                .delete_stream()
                .stream_name(BENCH_TARGET)
                .enforce_consumer_deletion(true)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
        };
    }
}

/// Stream, queue and subject prefix the destination benchmarks use.
pub(super) const BENCH_TARGET: &str = "outbox-bench";

/// A destination built from its `[destinations.NAME]` settings, as the relayer builds it.
fn build(toml: &str) -> Result<Arc<dyn Destination>> {
    let config: DestinationConfig = toml::from_str(toml).context("bench destination settings")?;
    Ok(config.build("bench", BENCH_DEADLINE)?)
}

/// The destination for a destination benchmark, with whatever it needs on the server.
pub(super) async fn destination(kind: &str) -> Result<(Arc<dyn Destination>, Cleanup)> {
    Ok(match kind {
        "http" => {
            let app =
                axum::Router::new().route("/hooks/{topic}", axum::routing::post(|| async { "ok" }));
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let url = format!("http://{}/hooks/{{topic}}", listener.local_addr()?);
            tokio::spawn(async move {
                let _ = axum::serve(listener, app).await;
            });
            (
                build(&format!("type = \"http\"\nurl = \"{url}\"\n"))?,
                Cleanup::Nothing,
            )
        }
        #[cfg(feature = "nats")]
        "nats" => {
            let js = async_nats::jetstream::new(
                async_nats::connect("127.0.0.1:4222")
                    .await
                    .context("NATS on 127.0.0.1:4222")?,
            );
            let _ = js.delete_stream(BENCH_TARGET).await;
            js.create_stream(async_nats::jetstream::stream::Config {
                name: BENCH_TARGET.into(),
                subjects: vec![format!("{BENCH_TARGET}.>")],
                ..Default::default()
            })
            .await
            .map_err(|e| anyhow::anyhow!("create JetStream stream: {e}"))?;
            let destination = build(&format!(
                "type = \"nats\"\nsubject = \"{BENCH_TARGET}.{{topic}}\"\n"
            ))?;
            (destination, Cleanup::NatsStream(js))
        }
        #[cfg(feature = "amqp")]
        "amqp" => {
            let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
            let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
                .await
                .context("RabbitMQ on 127.0.0.1:5672")?;
            let ch = conn.create_channel().await?;
            ch.queue_declare(
                BENCH_TARGET.into(),
                lapin::options::QueueDeclareOptions::default(),
                Default::default(),
            )
            .await?;
            let destination = build(&format!(
                "type = \"amqp\"\nurl = \"{url}\"\nrouting_key = \"{BENCH_TARGET}\"\n"
            ))?;
            (destination, Cleanup::AmqpQueue(ch))
        }
        #[cfg(feature = "redis")]
        "redis" => {
            let r = redis::Client::open("redis://127.0.0.1:6379")?
                .get_multiplexed_async_connection()
                .await
                .context("Redis on 127.0.0.1:6379")?;
            let destination = build(&format!(
                "type = \"redis\"\nstream = \"{BENCH_TARGET}:{{topic}}\"\nmaxlen = 100000\n"
            ))?;
            (destination, Cleanup::RedisStream(r))
        }
        #[cfg(feature = "kafka")]
        "kafka" => {
            use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
            let admin: AdminClient<_> = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", "127.0.0.1:9092")
                .create()
                .context("Kafka admin client for 127.0.0.1:9092")?;
            let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
            let _ = admin.delete_topics(&[BENCH_TARGET], &options).await;
            let created = admin
                .create_topics(
                    &[NewTopic::new(BENCH_TARGET, 3, TopicReplication::Fixed(1))],
                    &options,
                )
                .await
                .context("a Kafka-protocol broker on 127.0.0.1:9092 (make test starts tansu)")?;
            for result in created {
                result.map_err(|(topic, e)| anyhow::anyhow!("create Kafka topic {topic}: {e}"))?;
            }
            // Every message of the bench goes to one topic, keyed by its outbox_id (or its
            // key: a key's run in one call, as `--keyed-drain` compares).
            let destination = build(&format!(
                "type = \"kafka\"\nbrokers = \"127.0.0.1:9092\"\ntopic = \"{BENCH_TARGET}\"\nruns_in_one_call = true\n"
            ))?;
            (destination, Cleanup::KafkaTopic(admin))
        }
        "mqtt" => {
            // QoS 1 to a topic nobody subscribes to: the broker acknowledges every publish
            // and keeps nothing, so there is nothing to create or remove.
            let destination = build(&format!(
                "type = \"mqtt\"\nurl = \"mqtt://127.0.0.1:1883\"\ntopic = \"{BENCH_TARGET}/{{topic}}\"\n"
            ))?;
            (destination, Cleanup::Nothing)
        }
        #[cfg(feature = "pubsub")]
        "pubsub" => {
            // The emulator (no subscription: the bench measures publishing). Built first: it
            // installs the TLS provider the HTTP client below needs.
            let host = std::env::var("PUBSUB_EMULATOR_HOST")
                .unwrap_or_else(|_| "127.0.0.1:8085".to_owned());
            let destination = build(&format!(
                "type = \"pubsub\"\nproject = \"{BENCH_TARGET}\"\nemulator_host = \"{host}\"\ntopic = \"{BENCH_TARGET}\"\n"
            ))?;
            let url = format!("http://{host}/v1/projects/{BENCH_TARGET}/topics/{BENCH_TARGET}");
            let client = reqwest::Client::new();
            let _ = client.delete(&url).send().await;
            let created = client.put(&url).send().await.with_context(|| {
                format!("the Pub/Sub emulator on {host} (PUBSUB_EMULATOR_HOST)")
            })?;
            if !created.status().is_success() {
                anyhow::bail!("create Pub/Sub topic: HTTP {}", created.status());
            }
            (destination, Cleanup::PubsubTopic(url))
        }
        #[cfg(feature = "aws")]
        "sqs" | "sns" | "eventbridge" | "kinesis" => aws(kind).await?,
        // A destination this build leaves out: its settings name the missing feature.
        other => (build(&format!("type = \"{other}\"\n"))?, Cleanup::Nothing),
    })
}

/// Where the AWS benchmarks send: `AWS_ENDPOINT_URL` (a moto server, whose figures measure
/// moto more than the relayer; see docs/performance.md), region us-east-1 unless
/// `AWS_REGION` says otherwise, credentials from the SDK's default chain. Returns the
/// endpoint, the region and the SDK's configuration for them.
#[cfg(feature = "aws")]
pub(super) async fn aws_target() -> Result<(String, String, aws_config::SdkConfig)> {
    let endpoint =
        std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:5000".to_owned());
    let region = std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".to_owned());
    let config = outbox_relay::destination::aws_sdk_config(
        Some(&region),
        Some(&endpoint),
        Duration::from_secs(30),
    )
    .await
    .map_err(anyhow::Error::msg)?;
    Ok((endpoint, region, config))
}

/// An AWS destination of the benchmarks and its target, at [`aws_target`].
#[cfg(feature = "aws")]
async fn aws(kind: &str) -> Result<(Arc<dyn Destination>, Cleanup)> {
    let (endpoint, region, config) = aws_target().await?;
    let server = || {
        format!(
            "{kind} on {endpoint} (AWS_ENDPOINT_URL; a moto server: \
             target/venv/bin/python tests/destinations/moto_server.py -p 5000, \
             with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY set to anything)"
        )
    };
    let settings = format!("region = \"{region}\"\nendpoint_url = \"{endpoint}\"\n");
    Ok(match kind {
        "sqs" => {
            let client = aws_sdk_sqs::Client::new(&config);
            let url = client
                .create_queue()
                .queue_name(BENCH_TARGET)
                .send()
                .await
                .map_err(sdk_error)
                .with_context(server)?
                .queue_url
                .context("CreateQueue answered no queue URL")?;
            let destination = build(&format!(
                "type = \"sqs\"\nqueue = \"{BENCH_TARGET}\"\n{settings}"
            ))?;
            (destination, Cleanup::SqsQueue(client, url))
        }
        "sns" => {
            let client = aws_sdk_sns::Client::new(&config);
            let arn = client
                .create_topic()
                .name(BENCH_TARGET)
                .send()
                .await
                .map_err(sdk_error)
                .with_context(server)?
                .topic_arn
                .context("CreateTopic answered no topic ARN")?;
            let destination = build(&format!(
                "type = \"sns\"\ntopic_arn = \"{arn}\"\n{settings}"
            ))?;
            (destination, Cleanup::SnsTopic(client, arn))
        }
        "eventbridge" => {
            let client = aws_sdk_eventbridge::Client::new(&config);
            // A bus left by an interrupted run is removed as a finished run removes it.
            Cleanup::EventBus(client.clone()).run().await;
            client
                .create_event_bus()
                .name(BENCH_TARGET)
                .send()
                .await
                .map_err(sdk_error)
                .with_context(server)?;
            let destination = build(&format!(
                "type = \"eventbridge\"\nevent_bus = \"{BENCH_TARGET}\"\n{settings}"
            ))?;
            (destination, Cleanup::EventBus(client))
        }
        _ => {
            // Four shards, records spread over them by the partition key (the outbox_id).
            let client = aws_sdk_kinesis::Client::new(&config);
            Cleanup::KinesisStream(client.clone()).run().await;
            client
                .create_stream()
                .stream_name(BENCH_TARGET)
                .shard_count(4)
                .send()
                .await
                .map_err(sdk_error)
                .with_context(server)?;
            let destination = build(&format!(
                "type = \"kinesis\"\nstream = \"{BENCH_TARGET}\"\nruns_in_one_call = true\n{settings}"
            ))?;
            (destination, Cleanup::KinesisStream(client))
        }
    })
}

/// An AWS SDK error with its whole chain of causes (the SDK's `Display` gives only the
/// outermost, such as "dispatch failure").
#[cfg(feature = "aws")]
fn sdk_error<E: std::error::Error + Send + Sync + 'static>(e: E) -> anyhow::Error {
    anyhow::anyhow!("{}", aws_sdk_sqs::error::DisplayErrorContext(e))
}

//! The destination servers a `--destination` run delivers to: what each needs on its
//! server (a stream, a queue, a topic), the destination built from its settings as the
//! relayer builds it, and what is removed afterwards.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use outbox_relay::destination::{Destination, DestinationConfig};

use super::BENCH_DEADLINE;

/// What a destination benchmark leaves behind and removes afterwards.
pub(super) enum Cleanup {
    Nothing,
    NatsStream(async_nats::jetstream::Context),
    AmqpQueue(lapin::Channel),
    RedisStream(redis::aio::MultiplexedConnection),
    KafkaTopic(rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>),
}

impl Cleanup {
    pub(super) async fn run(self) {
        let _ = match self {
            Cleanup::Nothing => Ok(()),
            Cleanup::NatsStream(js) => js
                .delete_stream(BENCH_TARGET)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Cleanup::AmqpQueue(ch) => ch
                .queue_delete(
                    BENCH_TARGET.into(),
                    lapin::options::QueueDeleteOptions::default(),
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Cleanup::RedisStream(mut r) => redis::cmd("DEL")
                .arg(format!("{BENCH_TARGET}:bench"))
                .query_async::<()>(&mut r)
                .await
                .map_err(|e| e.to_string()),
            Cleanup::KafkaTopic(admin) => admin
                .delete_topics(&[BENCH_TARGET], &rdkafka::admin::AdminOptions::new())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
        };
    }
}

/// Stream, queue and subject prefix the destination benchmarks use.
const BENCH_TARGET: &str = "outbox-bench";

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
            // Every message of the bench goes to one topic, keyed by its outbox_id.
            let destination = build(&format!(
                "type = \"kafka\"\nbrokers = \"127.0.0.1:9092\"\ntopic = \"{BENCH_TARGET}\"\n"
            ))?;
            (destination, Cleanup::KafkaTopic(admin))
        }
        other => bail!("unknown destination {other}"),
    })
}

//! `bench --keyed-drain --destination D`: does keyed traffic go at the destination's full
//! speed? Each round, into a fresh target on the destination's server (a topic, stream,
//! queue or bus made for the drain and removed after it):
//!
//! - the relays drain `--messages` unkeyed messages;
//! - they drain as many with 10 % keyed (every tenth message, ten keys, so that each key
//!   has a run of `--messages` / 100);
//! - they drain those again with the destination taken as one that does not keep a key's
//!   order within a call (one message of a key per call, in waves: the control, and the
//!   rule every destination followed before);
//! - the relays drain as many unkeyed into the null destination (the relayer's own ceiling
//!   here: claiming and completing in Postgres, nothing sent);
//! - a one-process client sends as many payloads of the same size with the service's batch
//!   API, one request at a time, in requests of `--batch-size` messages (at most the
//!   service's maximum): Pub/Sub `topics.publish` over REST (reqwest, as the destination),
//!   Kinesis `PutRecords`, SQS `SendMessageBatch`, SNS `PublishBatch`, EventBridge
//!   `PutEvents` (the AWS SDK, as the destination); Kafka: an idempotent `rdkafka`
//!   producer (as the destination) given `--batch-size` records at a time, their reports
//!   awaited before the next ones. MQTT has no batch request: its client
//!   publishes at QoS 1 to Mosquitto with as many publishes awaiting their PUBACK as the
//!   destination keeps (100, `rumqttc`, as the destination), and is done at the last
//!   PUBACK. The client sends the bare payload; the relayer sends it with the outbox's
//!   attributes (or, on Kinesis and EventBridge, inside the message's JSON envelope; on
//!   MQTT 5, as user properties).
//!
//! It prints each rate with the load average, keyed / unkeyed and relayer / client, and the
//! medians of the rounds. It judges nothing.

use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(any(
    feature = "pubsub",
    feature = "aws",
    feature = "mqtt",
    feature = "kafka"
))]
use anyhow::Context;
use anyhow::{Result, bail};
use tokio_util::sync::CancellationToken;

use futures_util::future::BoxFuture;
use outbox_relay::destination::{Destination, Window};
use outbox_relay::message::{ClaimedMessage, Outcome};
use outbox_relay::store::fill_messages;

#[cfg(any(
    feature = "pubsub",
    feature = "aws",
    feature = "mqtt",
    feature = "kafka"
))]
use super::brokers::BENCH_TARGET;
use super::brokers::destination;
use super::{Options, Recorder, lock, median, per_sec, settle, shutdown_relays, start_relays};

/// Every tenth message is keyed, with `'k' || (i % 100)`: ten keys.
const KEYED_EVERY: i64 = 10;
const KEY_MODULUS: i64 = 100;
/// Payload size, as the other shapes.
const PAYLOAD_BYTES: i32 = 256;

pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    let kind = o.destination.as_str();
    let per_request = client_batch(kind)?.min(o.batch_size as usize);
    outln!(
        "keyed drain into {kind}: {} messages per drain, 10 % keyed (10 keys, runs of {}), \
         {} workers, batch {}, {} batches in flight per worker; the client: one process, one \
         request at a time, {per_request} messages per request",
        o.messages,
        o.messages / 100,
        o.workers,
        o.batch_size,
        o.in_flight,
    );
    let mut rows = Vec::new();
    for round in 1..=o.rounds {
        let (unkeyed, _) = relay_drain(url, o, sql, None, false, false).await?;
        line(round, "relayer, unkeyed", o.messages, unkeyed);
        let (keyed, by) = relay_drain(url, o, sql, Some(KEYED_EVERY), false, false).await?;
        line(round, "relayer, 10 % keyed", o.messages, keyed);
        tail(keyed, by);
        let (waves, by) = relay_drain(url, o, sql, Some(KEYED_EVERY), true, false).await?;
        line(
            round,
            "relayer, 10 % keyed, one message of a key per call",
            o.messages,
            waves,
        );
        tail(waves, by);
        let (null, _) = relay_drain(url, o, sql, None, false, true).await?;
        line(
            round,
            "relayer, unkeyed, null destination",
            o.messages,
            null,
        );
        let client = client_drain(kind, o.messages, per_request).await?;
        line(round, "one-process batch client", o.messages, client);
        let (u, k, c, w, n) = (
            per_sec(o.messages, unkeyed),
            per_sec(o.messages, keyed),
            per_sec(o.messages, client),
            per_sec(o.messages, waves),
            per_sec(o.messages, null),
        );
        outln!(
            "  round {round}: keyed / unkeyed = {:.2} (one message of a key per call: {:.2}); relayer keyed / client = {:.2}; relayer unkeyed / client = {:.2}; relayer null / client = {:.2}",
            k / u,
            w / u,
            k / c,
            u / c,
            n / c
        );
        rows.push((u, k, c, w, n));
    }
    let med = |f: fn(&(f64, f64, f64, f64, f64)) -> f64| median(rows.iter().map(|r| Some(f(r))));
    let show = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"));
    outln!(
        "{kind}, medians of {} rounds: unkeyed {} msg/s, 10 % keyed {} msg/s (one message of a \
         key per call {}), client {} msg/s; keyed / unkeyed {} (one per call {}), relayer keyed \
         / client {}, relayer unkeyed / client {}; null destination {} msg/s (load average {})",
        rows.len(),
        show(med(|r| r.0)),
        show(med(|r| r.1)),
        show(med(|r| r.3)),
        show(med(|r| r.2)),
        show(med(|r| r.1 / r.0)),
        show(med(|r| r.3 / r.0)),
        show(med(|r| r.1 / r.2)),
        show(med(|r| r.0 / r.2)),
        show(med(|r| r.4)),
        load_average()
    );
    Ok(())
}

fn line(round: u32, what: &str, n: u64, t: Duration) {
    outln!(
        "round {round}: {what}: {n} messages in {:.2} s = {:.0} msg/s (load average {})",
        t.as_secs_f64(),
        per_sec(n, t),
        load_average()
    );
}

/// The 1-, 5- and 15-minute load averages, as /proc/loadavg gives them.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// Drains `--messages` (keyed every `keyed_every`-th) into a fresh target; the time from
/// the relays' start to the last acknowledgement, and to the last of an unkeyed message.
/// With `waves`, the destination is taken as one that does not keep a key's order within a
/// call.
async fn relay_drain(
    url: &str,
    o: &Options,
    sql: &tokio_postgres::Client,
    keyed_every: Option<i64>,
    waves: bool,
    null: bool,
) -> Result<(Duration, Option<Duration>)> {
    let (destination, cleanup) = destination(if null { "null" } else { &o.destination }).await?;
    let destination: Option<Arc<dyn Destination>> = match (null, waves) {
        (true, _) => None,
        (false, true) => Some(Arc::new(Waves(destination))),
        (false, false) => Some(destination),
    };
    let n = i64::try_from(o.messages)?;
    fill_messages(sql, "bench", n, keyed_every, KEY_MODULUS, PAYLOAD_BYTES).await?;
    sql.batch_execute("VACUUM ANALYZE outbox.messages").await?;
    settle(sql).await;
    let recorder = Recorder::new(destination);
    let target = recorder.target(o.messages);
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let relays = start_relays(url, o, &recorder, &shutdown)?;
    let reached = recorder.reached(target, "draining").await;
    let t = started.elapsed();
    shutdown_relays(&shutdown, relays).await;
    cleanup.run().await;
    reached?;
    let unkeyed = lock(&recorder.last_unkeyed).map(|at| at.duration_since(started));
    Ok((t, unkeyed))
}

/// After a keyed drain's line: how long its keyed runs outlasted its unkeyed messages.
fn tail(t: Duration, unkeyed: Option<Duration>) {
    if let Some(unkeyed) = unkeyed {
        outln!(
            "  its unkeyed messages were all delivered by {:.2} s; the last {:.2} s delivered \
             keyed runs alone",
            unkeyed.as_secs_f64(),
            t.saturating_sub(unkeyed).as_secs_f64()
        );
    }
}

/// A destination taken as one that does not keep a key's order within a call.
struct Waves(Arc<dyn Destination>);

impl Destination for Waves {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        self.0.publish(batch, window)
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        self.0.ready()
    }
}

/// Messages per request of the service's batch API.
fn client_batch(kind: &str) -> Result<usize> {
    Ok(match kind {
        "pubsub" => 1000,
        "kinesis" => 500,
        "sqs" | "sns" | "eventbridge" => 10,
        // Not a request: the publishes awaiting their PUBACK at once.
        "mqtt" => MQTT_INFLIGHT.into(),
        // Not a request: the records handed to the producer before their reports are
        // awaited (the producer packs them into requests itself); `--batch-size` caps it.
        "kafka" => 10_000,
        other => bail!(
            "--keyed-drain compares with a batch client of pubsub, kinesis, sqs, sns, \
             eventbridge, mqtt or kafka, not {other:?}"
        ),
    })
}

/// The payload of message `i`, as `fill_messages` makes it.
fn payload(i: u64) -> String {
    let n = i.to_string();
    let pad = usize::try_from(PAYLOAD_BYTES).unwrap_or(256) - 20 - n.len();
    serde_json::json!({ "n": i, "pad": "x".repeat(pad) }).to_string()
}

/// Sends `n` payloads to a fresh target in requests of `per_request`, one at a time; the
/// time it took.
async fn client_drain(kind: &str, n: u64, per_request: usize) -> Result<Duration> {
    let (_, cleanup) = destination(kind).await?;
    let payloads: Vec<String> = (1..=n).map(payload).collect();
    let result = send(kind, &payloads, per_request).await;
    cleanup.run().await;
    result
}

#[allow(unused_variables)]
async fn send(kind: &str, payloads: &[String], per_request: usize) -> Result<Duration> {
    match kind {
        #[cfg(feature = "pubsub")]
        "pubsub" => {
            use base64::Engine;
            let host = std::env::var("PUBSUB_EMULATOR_HOST")
                .unwrap_or_else(|_| "127.0.0.1:8085".to_owned());
            let url =
                format!("http://{host}/v1/projects/{BENCH_TARGET}/topics/{BENCH_TARGET}:publish");
            let client = reqwest::Client::new();
            let started = Instant::now();
            for chunk in payloads.chunks(per_request) {
                let body = serde_json::json!({
                    "messages": chunk.iter().map(|p| serde_json::json!({
                        "data": base64::engine::general_purpose::STANDARD.encode(p),
                    })).collect::<Vec<_>>(),
                });
                let answer = client
                    .post(&url)
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(body.to_string())
                    .send()
                    .await
                    .context("Pub/Sub publish")?;
                if !answer.status().is_success() {
                    bail!("Pub/Sub publish: HTTP {}", answer.status());
                }
            }
            Ok(started.elapsed())
        }
        #[cfg(feature = "aws")]
        "kinesis" | "sqs" | "sns" | "eventbridge" => aws(kind, payloads, per_request).await,
        #[cfg(feature = "mqtt")]
        "mqtt" => mqtt(payloads).await,
        #[cfg(feature = "kafka")]
        "kafka" => kafka(payloads, per_request).await,
        other => bail!("no batch client of {other:?} in this build"),
    }
}

/// Publishes awaiting their PUBACK at once, as the `mqtt` destination keeps them.
const MQTT_INFLIGHT: u16 = 100;

/// Publishes `payloads` at QoS 1 over MQTT 5 to Mosquitto on 127.0.0.1:1883 (the topic the
/// bench destination publishes to, which nobody subscribes to), up to [`MQTT_INFLIGHT`]
/// awaiting their PUBACK; the time from the first publish to the last PUBACK.
#[cfg(feature = "mqtt")]
async fn mqtt(payloads: &[String]) -> Result<Duration> {
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::{AsyncClient, Event, MqttOptions};
    let mut options = MqttOptions::new(
        format!("outbox-bench-{}", uuid::Uuid::new_v4().simple()),
        "127.0.0.1",
        1883,
    );
    options
        .set_clean_start(true)
        .set_keep_alive(Duration::from_secs(30))
        .set_outgoing_inflight_upper_limit(MQTT_INFLIGHT);
    // The request channel holds every publish, so that the client is never waiting on it.
    let (client, mut events) = AsyncClient::new(options, payloads.len().max(1));
    loop {
        match events.poll().await.context("MQTT on 127.0.0.1:1883")? {
            Event::Incoming(Packet::ConnAck(_)) => break,
            _ => continue,
        }
    }
    let topic = format!("{BENCH_TARGET}/bench");
    let started = Instant::now();
    for p in payloads {
        client
            .publish(
                topic.clone(),
                QoS::AtLeastOnce,
                false,
                p.clone().into_bytes(),
            )
            .await
            .context("MQTT publish")?;
    }
    let mut acked = 0;
    while acked < payloads.len() {
        if let Event::Incoming(Packet::PubAck(ack)) =
            events.poll().await.context("MQTT connection")?
        {
            // Mosquitto answers "no matching subscribers" (0x10), a success.
            use rumqttc::v5::mqttbytes::v5::PubAckReason::{NoMatchingSubscribers, Success};
            if !matches!(ack.reason, Success | NoMatchingSubscribers) {
                bail!("the broker refused a publish: {:?}", ack.reason);
            }
            acked += 1;
        }
    }
    let t = started.elapsed();
    let _ = client.disconnect().await;
    Ok(t)
}

/// Produces `payloads` to the bench topic on 127.0.0.1:9092 with an idempotent producer
/// configured as the `kafka` destination configures its own (acks all, no linger), each
/// keyed by a new UUID: `per_request` records handed to the producer at once, then their
/// delivery reports awaited before the next ones; the time from the first record to the
/// last report.
#[cfg(feature = "kafka")]
async fn kafka(payloads: &[String], per_request: usize) -> Result<Duration> {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", "127.0.0.1:9092")
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "0")
        .set("partitioner", "murmur2_random")
        .create()
        .context("Kafka producer for 127.0.0.1:9092")?;
    let started = Instant::now();
    for chunk in payloads.chunks(per_request) {
        let mut reports = Vec::with_capacity(chunk.len());
        for p in chunk {
            let key = uuid::Uuid::new_v4().to_string();
            let record = FutureRecord::to(BENCH_TARGET)
                .key(&key)
                .payload(p.as_bytes());
            reports.push(
                producer
                    .send_result(record)
                    .map_err(|(e, _)| anyhow::anyhow!("Kafka produce: {e}"))?,
            );
        }
        for report in reports {
            report
                .await
                .context("Kafka producer closed")?
                .map_err(|(e, _)| anyhow::anyhow!("Kafka produce: {e}"))?;
        }
    }
    Ok(started.elapsed())
}

#[cfg(feature = "aws")]
async fn aws(kind: &str, payloads: &[String], per_request: usize) -> Result<Duration> {
    let (_, _, config) = super::brokers::aws_target().await?;
    let failed = |what: &str, e: &dyn std::error::Error| anyhow::anyhow!("{what}: {e:?}");
    match kind {
        "kinesis" => {
            use aws_sdk_kinesis::primitives::Blob;
            use aws_sdk_kinesis::types::PutRecordsRequestEntry;
            let client = aws_sdk_kinesis::Client::new(&config);
            let started = Instant::now();
            for chunk in payloads.chunks(per_request) {
                let records = chunk
                    .iter()
                    .map(|p| {
                        PutRecordsRequestEntry::builder()
                            .data(Blob::new(p.as_bytes()))
                            .partition_key(uuid::Uuid::now_v7().to_string())
                            .build()
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let answer = client
                    .put_records()
                    .stream_name(BENCH_TARGET)
                    .set_records(Some(records))
                    .send()
                    .await
                    .map_err(|e| failed("PutRecords", &e))?;
                if answer.failed_record_count().unwrap_or(0) > 0 {
                    bail!("PutRecords refused records");
                }
            }
            Ok(started.elapsed())
        }
        "sqs" => {
            use aws_sdk_sqs::types::SendMessageBatchRequestEntry;
            let client = aws_sdk_sqs::Client::new(&config);
            let url = client
                .get_queue_url()
                .queue_name(BENCH_TARGET)
                .send()
                .await
                .map_err(|e| failed("GetQueueUrl", &e))?
                .queue_url
                .context("no queue URL")?;
            let started = Instant::now();
            for chunk in payloads.chunks(per_request) {
                let entries = chunk
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        SendMessageBatchRequestEntry::builder()
                            .id(i.to_string())
                            .message_body(p)
                            .build()
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let answer = client
                    .send_message_batch()
                    .queue_url(&url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .map_err(|e| failed("SendMessageBatch", &e))?;
                if !answer.failed().is_empty() {
                    bail!("SendMessageBatch refused messages");
                }
            }
            Ok(started.elapsed())
        }
        "sns" => {
            use aws_sdk_sns::types::PublishBatchRequestEntry;
            let client = aws_sdk_sns::Client::new(&config);
            let arn = client
                .create_topic()
                .name(BENCH_TARGET)
                .send()
                .await
                .map_err(|e| failed("CreateTopic", &e))?
                .topic_arn
                .context("no topic ARN")?;
            let started = Instant::now();
            for chunk in payloads.chunks(per_request) {
                let entries = chunk
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        PublishBatchRequestEntry::builder()
                            .id(i.to_string())
                            .message(p)
                            .build()
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let answer = client
                    .publish_batch()
                    .topic_arn(&arn)
                    .set_publish_batch_request_entries(Some(entries))
                    .send()
                    .await
                    .map_err(|e| failed("PublishBatch", &e))?;
                if !answer.failed().is_empty() {
                    bail!("PublishBatch refused messages");
                }
            }
            Ok(started.elapsed())
        }
        _ => {
            use aws_sdk_eventbridge::types::PutEventsRequestEntry;
            let client = aws_sdk_eventbridge::Client::new(&config);
            let started = Instant::now();
            for chunk in payloads.chunks(per_request) {
                let entries = chunk
                    .iter()
                    .map(|p| {
                        PutEventsRequestEntry::builder()
                            .event_bus_name(BENCH_TARGET)
                            .source("outbox.bench")
                            .detail_type("bench")
                            .detail(p)
                            .build()
                    })
                    .collect();
                let answer = client
                    .put_events()
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .map_err(|e| failed("PutEvents", &e))?;
                if answer.failed_entry_count() > 0 {
                    bail!("PutEvents refused events");
                }
            }
            Ok(started.elapsed())
        }
    }
}

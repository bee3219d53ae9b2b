//! `outbox-relay bench` (a module of the binary, not of the library): measures the relayer against the Postgres in `DATABASE_URL`, in a
//! database of its own that it creates and drops. It prints figures; it judges nothing.
//!
//! 1. floor: a bare SQL drain with no relayer (claim and complete in one statement per
//!    batch), the most any relayer could do on this machine;
//! 2. drain: `workers` relays (null destination) drain `messages` messages;
//! 3. backlog: throughput draining a 20,000 backlog, and the first `messages` of a
//!    `big_backlog` one (is the claim cost flat as the queue grows?);
//! 4. latency: a steady enqueue rate for a while, commit-to-acknowledgement percentiles;
//! 5. memory: the process's peak resident set.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures_util::future::BoxFuture;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use outbox_relay::config::{RawConfig, Settings};
use outbox_relay::connection::Target;
use outbox_relay::destination::{Destination, DestinationConfig};
use outbox_relay::dispatch::Dispatcher;
use outbox_relay::message::{ClaimedMessage, Outcome};
use outbox_relay::relay::Relay;
use outbox_relay::store::{Store, StoreError, fill_messages, with_database};

mod fleet;
mod hot_key;
mod peers;
mod sustained;

#[derive(Clone, Debug, clap::Args)]
pub struct Options {
    /// Messages per drain measurement.
    #[arg(long, default_value_t = 200_000)]
    pub messages: u64,
    /// Relays (worker pools) draining at once, each with its own worker id.
    #[arg(long, default_value_t = 2)]
    pub workers: u32,
    #[arg(long, default_value_t = 500)]
    pub batch_size: u32,
    /// Backlog for the flatness measurement (0 skips it).
    #[arg(long, default_value_t = 1_000_000)]
    pub big_backlog: u64,
    /// Enqueue rate of the latency measurement, messages per second.
    #[arg(long, default_value_t = 2000)]
    pub rate: u64,
    /// Length of the latency measurement, seconds.
    #[arg(long, default_value_t = 30)]
    pub latency_secs: u64,
    /// Destination: null (measures the relayer and Postgres), or a local server: http (a
    /// server the bench starts), nats (127.0.0.1:4222), amqp (127.0.0.1:5672), redis
    /// (127.0.0.1:6379), kafka (127.0.0.1:9092). With a server, only the drain and latency
    /// figures are measured.
    #[arg(long, default_value = "null", value_parser = ["null", "http", "nats", "amqp", "redis", "kafka"])]
    pub destination: String,
    /// Instead of the other measurements: deliver this many messages (null destination) in
    /// ten rounds and print the resident memory after each, to show that it stays flat.
    #[arg(long, default_value_t = 0)]
    pub memory_messages: u64,
    /// Instead of the other measurements: enqueue throughput with these numbers of producer
    /// connections (comma-separated, e.g. 1,16,64), one message per transaction, against
    /// the same INSERT without a notification and with one per transaction.
    #[arg(long, value_delimiter = ',')]
    pub enqueue_connections: Vec<u32>,
    /// Seconds per enqueue measurement.
    #[arg(long, default_value_t = 10)]
    pub enqueue_secs: u64,
    /// Instead of the other measurements: the hot-key shape, `--rounds` times. N unkeyed
    /// messages drained alone, then N messages of one key enqueued together with N unkeyed
    /// ones: the unkeyed rate beside the hot key (against the rate alone) and the hot key's
    /// own rate, per round and as medians.
    #[arg(long, default_value_t = 0)]
    pub hot_key: u64,
    /// Instead of the other measurements: drain `--messages` with each of these numbers of
    /// relays (comma-separated, e.g. 1,2,4,8,16), showing how much of the database's time
    /// goes to waiting on locks.
    #[arg(long, value_delimiter = ',')]
    pub fleet: Vec<u32>,
    /// Claimed batches each relay keeps in flight (`max_batches_in_flight`).
    #[arg(long, default_value_t = 3)]
    pub in_flight: u32,
    /// Instead of the other measurements: measure the drain rate, then run this many
    /// seconds with a producer at 80 % of it and the attempt log pruned alongside, printing
    /// throughput, backlog and dead tuples per 30-second window.
    #[arg(long, default_value_t = 0)]
    pub sustained_secs: u64,
    /// The sustained run's producer rate, messages per second, instead of 80 % of the
    /// drain rate (on a small machine the producer and the relays share the cores, so the
    /// drain rate measured alone is not reachable with a producer running).
    #[arg(long)]
    pub sustained_rate: Option<u64>,
    /// The sustained run without pruning the attempt log (the control for what pruning
    /// alongside costs).
    #[arg(long)]
    pub sustained_no_prune: bool,
    /// Instead of the other measurements: the relayer against graphile-worker, pg-boss and
    /// pgmq (see `scripts/bench-peers.sh`, which prepares this directory: Node packages in
    /// DIR/node_modules, pgmq's SQL-only install in DIR/pgmq.sql).
    #[arg(long, value_name = "DIR")]
    pub peers: Option<std::path::PathBuf>,
    /// Rounds of the peers comparison (each drains once with every contender) and of the
    /// hot-key shape.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
}

/// A null destination that counts deliveries and, while recording, notes when each
/// message was acknowledged.
struct Recorder {
    /// The destination measured; `None` acknowledges everything at once.
    inner: Option<Arc<dyn Destination>>,
    delivered: AtomicU64,
    /// The delivered count when the current target was set (for progress).
    from: AtomicU64,
    target: AtomicU64,
    done: Notify,
    acks: Mutex<Vec<(Uuid, Instant)>>,
    recording: std::sync::atomic::AtomicBool,
}

impl Recorder {
    fn new(inner: Option<Arc<dyn Destination>>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            delivered: AtomicU64::new(0),
            from: AtomicU64::new(0),
            target: AtomicU64::new(u64::MAX),
            done: Notify::new(),
            acks: Mutex::new(Vec::new()),
            recording: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The delivered count `n` more deliveries from now; pass it to [`Recorder::reached`].
    fn target(&self, n: u64) -> u64 {
        let from = self.delivered.load(Ordering::SeqCst);
        let target = from + n;
        self.from.store(from, Ordering::SeqCst);
        self.target.store(target, Ordering::SeqCst);
        target
    }

    /// Resolves once `target` messages have been delivered in all, showing how far `what`
    /// has got on a terminal; fails when no message has been delivered for `STALL_LIMIT`
    /// (the relays' log says why), so that a stuck run ends instead of waiting forever.
    async fn reached(&self, target: u64, what: &str) -> Result<()> {
        let from = self.from.load(Ordering::SeqCst);
        let mut shown = Instant::now();
        let (mut last, mut moved) = (self.delivered.load(Ordering::SeqCst), Instant::now());
        loop {
            let now = self.delivered.load(Ordering::SeqCst);
            if now >= target {
                break;
            }
            if now != last {
                (last, moved) = (now, Instant::now());
            } else if moved.elapsed() >= STALL_LIMIT {
                progress("");
                bail!(
                    "{what}: no message delivered for {} s, {} of {} still undelivered",
                    STALL_LIMIT.as_secs(),
                    target - now,
                    target - from
                );
            }
            if shown.elapsed() >= PROGRESS_EVERY {
                progress(&format!(
                    "{what}: {} of {}",
                    now.saturating_sub(from),
                    target - from
                ));
                shown = Instant::now();
            }
            let notified = self.done.notified();
            if self.delivered.load(Ordering::SeqCst) >= target {
                break;
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
        }
        progress("");
        Ok(())
    }
}

/// How long [`Recorder::reached`] waits without a delivery before it gives up.
const STALL_LIMIT: Duration = Duration::from_secs(120);

const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// Shows `line` in place of the previous one on stderr when it is a terminal (the figures
/// go to stdout, terminal or not); an empty line clears it.
fn progress(line: &str) {
    use std::io::{IsTerminal, Write};
    let mut err = std::io::stderr();
    if err.is_terminal() {
        let _ = write!(err, "\r\x1b[2K{line}");
        let _ = err.flush();
    }
}

impl Destination for Recorder {
    fn publish<'a>(&'a self, batch: &'a [ClaimedMessage]) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let outcomes = match &self.inner {
                Some(destination) => destination.publish(batch).await,
                None => vec![Outcome::Delivered; batch.len()],
            };
            let now = Instant::now();
            let delivered: Vec<Uuid> = batch
                .iter()
                .zip(&outcomes)
                .filter(|(_, o)| **o == Outcome::Delivered)
                .map(|(m, _)| m.id.0)
                .collect();
            if self.recording.load(Ordering::Relaxed) {
                lock(&self.acks).extend(delivered.iter().map(|id| (*id, now)));
            }
            let n = delivered.len() as u64;
            let total = self.delivered.fetch_add(n, Ordering::SeqCst) + n;
            if total >= self.target.load(Ordering::SeqCst) {
                self.done.notify_waiters();
            }
            outcomes
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

pub async fn run(database_url: &str, o: &Options) -> Result<()> {
    outbox_relay::logging::init(outbox_relay::config::LogFormat::Human);
    outbox_relay::telemetry::install();
    if let Some(dir) = &o.peers {
        return peers::run(database_url, dir, o).await;
    }
    let db = format!("outbox_bench_{}", std::process::id());
    let admin = connect(database_url)
        .await
        .context("connect to DATABASE_URL")?;
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await?;
    let url = with_database(database_url, &db);
    let result = measure(&url, o).await;
    drop(admin);
    let admin = connect(database_url).await?;
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await?;
    result
}

async fn measure(url: &str, o: &Options) -> Result<()> {
    let store = Store::connect(url, 4)?;
    store.migrate().await?;
    let sql = connect(url).await?;
    println!(
        "outbox-relay bench: {} messages per drain, {} workers, batch {}, 256-byte JSON payloads, 10% keyed, Postgres {}",
        o.messages,
        o.workers,
        o.batch_size,
        sql.query_one("SHOW server_version", &[])
            .await?
            .get::<_, String>(0)
    );

    if o.memory_messages > 0 {
        return memory(url, o, &sql).await;
    }
    if !o.enqueue_connections.is_empty() {
        return enqueue_rates(url, o, &sql).await;
    }
    if o.hot_key > 0 {
        return hot_key::run(url, o, &sql).await;
    }
    if !o.fleet.is_empty() {
        return fleet::run(url, o, &sql).await;
    }
    if o.sustained_secs > 0 {
        return sustained::run(url, o, &sql).await;
    }

    if o.destination != "null" {
        let (destination, cleanup) = destination(&o.destination).await?;
        let recorder = Recorder::new(Some(destination));
        let shutdown = CancellationToken::new();
        let relays = start_relays(url, o, &recorder, &shutdown)?;
        let t = drain(&sql, &recorder, o.messages).await?;
        report(
            &format!("relay drain into {} (local server)", o.destination),
            o.messages,
            o.messages,
            t,
            o.workers,
        );
        latency(url, &recorder, o).await?;
        shutdown_relays(&shutdown, relays).await;
        cleanup.run().await;
        return Ok(());
    }

    // 1. The floor: no relayer.
    fill(&sql, o.messages).await?;
    progress("floor: draining with bare SQL");
    let started = Instant::now();
    let mut drains = Vec::new();
    for w in 0..o.workers {
        let url = url.to_owned();
        let batch = i64::from(o.batch_size);
        drains.push(tokio::spawn(async move {
            bare_drain(&url, batch, &format!("floor-{w}")).await
        }));
    }
    for d in drains {
        d.await??;
    }
    report(
        "floor: bare SQL claim+complete, one statement per batch",
        o.messages,
        o.messages,
        started.elapsed(),
        o.workers,
    );

    // 2. The relayer.
    let recorder = Recorder::new(None);
    let shutdown = CancellationToken::new();
    let relays = start_relays(url, o, &recorder, &shutdown)?;
    let rate = drain(&sql, &recorder, o.messages).await?;
    report(
        "relay drain (null destination)",
        o.messages,
        o.messages,
        rate,
        o.workers,
    );

    // 3. Flatness: a small backlog against a big one.
    let small = 20_000;
    let t_small = drain(&sql, &recorder, small).await?;
    let small_rate = per_sec(small, t_small);
    report(
        "relay drain at small backlog",
        small,
        small,
        t_small,
        o.workers,
    );
    if o.big_backlog > 0 {
        shutdown_relays(&shutdown, relays).await;
        fill(&sql, o.big_backlog).await?;
        sql.batch_execute("VACUUM ANALYZE outbox.messages").await?;
        settle(&sql).await;
        let shutdown = CancellationToken::new();
        let relays = start_relays(url, o, &recorder, &shutdown)?;
        let measured = o.messages.min(o.big_backlog);
        let started = Instant::now();
        recorder
            .reached(recorder.target(measured), "draining the big backlog")
            .await?;
        let t_big = started.elapsed();
        report(
            "relay drain at big backlog (first part)",
            o.big_backlog,
            measured,
            t_big,
            o.workers,
        );
        println!(
            "  flatness: throughput at {} backlog / at {} backlog = {:.2}",
            o.big_backlog,
            small,
            per_sec(measured, t_big) / small_rate
        );
        shutdown_relays(&shutdown, relays).await;
        sql.batch_execute("TRUNCATE outbox.messages").await?;
        sql.batch_execute("VACUUM ANALYZE outbox.messages").await?;
        settle(&sql).await;
        // 4. Latency under a steady rate.
        let shutdown = CancellationToken::new();
        let relays = start_relays(url, o, &recorder, &shutdown)?;
        latency(url, &recorder, o).await?;
        shutdown_relays(&shutdown, relays).await;
    } else {
        latency(url, &recorder, o).await?;
        shutdown_relays(&shutdown, relays).await;
    }

    // 5. Memory.
    println!(
        "peak RSS of this process (relays + bench harness): {:.1} MiB",
        peak_rss_mib()
    );
    Ok(())
}

fn start_relays(
    url: &str,
    o: &Options,
    sink: &Arc<Recorder>,
    shutdown: &CancellationToken,
) -> Result<Vec<tokio::task::JoinHandle<outbox_relay::relay::Summary>>> {
    let mut relays = Vec::new();
    for w in 0..o.workers {
        let settings = Settings::from_raw(RawConfig {
            database_url: Some(url.to_owned()),
            worker_id: Some(format!("bench-{w}")),
            batch_size: Some(i64::from(o.batch_size)),
            poll_interval_ms: Some(100),
            max_batches_in_flight: Some(i64::from(o.in_flight)),
            // A claim, a completion per batch in flight, and the repair and observer passes.
            pool_size: Some(i64::from(o.in_flight.max(2)) + 2),
            ..RawConfig::default()
        })?;
        let store = Store::connect(url, settings.pool_size)?;
        let dispatcher = Dispatcher::single(
            "bench",
            sink.clone(),
            settings.dispatch.circuit,
            BENCH_DEADLINE,
            settings.max_batches_in_flight,
        );
        let relay = Relay::new(settings, store, Arc::new(dispatcher));
        relays.push(tokio::spawn(relay.run(shutdown.clone())));
    }
    Ok(relays)
}

async fn shutdown_relays(
    shutdown: &CancellationToken,
    relays: Vec<tokio::task::JoinHandle<outbox_relay::relay::Summary>>,
) {
    shutdown.cancel();
    for r in relays {
        let _ = r.await;
    }
}

/// Enqueues `n` messages and waits until the relays delivered them.
async fn drain(sql: &tokio_postgres::Client, recorder: &Recorder, n: u64) -> Result<Duration> {
    let target = recorder.target(n);
    fill(sql, n).await?;
    let started = Instant::now();
    recorder.reached(target, "draining").await?;
    Ok(started.elapsed())
}

/// Inserts `n` messages: 256-byte JSON payloads, every tenth with one of 1,000 keys.
async fn fill(sql: &tokio_postgres::Client, n: u64) -> Result<()> {
    progress(&format!("enqueueing {n} messages"));
    fill_messages(sql, "bench", i64::try_from(n)?, Some(10), 1000, 256).await?;
    Ok(())
}

/// Claims and completes in one statement per batch until nothing is left (no leases, no
/// per-key order, in primary-key order: the cost of just consuming and recording).
async fn bare_drain(url: &str, batch: i64, worker: &str) -> Result<()> {
    let c = connect(url).await?;
    let stmt = c
        .prepare(
            "WITH done AS (
                 DELETE FROM outbox.messages
                  WHERE outbox_id = ANY (ARRAY(SELECT outbox_id FROM outbox.messages
                                                ORDER BY outbox_id
                                                LIMIT $1 FOR UPDATE SKIP LOCKED))
              RETURNING outbox_id, attempt_count)
             INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token)
             SELECT outbox_id, attempt_count + 1, 'DISPATCHED', $2, gen_random_uuid() FROM done",
        )
        .await?;
    loop {
        if c.execute(&stmt, &[&batch, &worker]).await? == 0 {
            return Ok(());
        }
    }
}

/// Enqueues at `rate` per second for `latency_secs` through `outbox.enqueue` (one
/// transaction each, from 16 producer connections) and prints the percentiles of the time
/// from the producer's commit returning to the destination's acknowledgement.
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss
)]
async fn latency(url: &str, recorder: &Arc<Recorder>, o: &Options) -> Result<()> {
    const PRODUCERS: u64 = 16;
    let total = o.rate * o.latency_secs;
    lock(&recorder.acks).clear();
    recorder.recording.store(true, Ordering::SeqCst);
    let target = recorder.target(total);
    let commits: Arc<Mutex<Vec<(Uuid, Instant)>>> = Arc::default();
    progress(&format!(
        "latency: enqueueing {} msg/s for {} s",
        o.rate, o.latency_secs
    ));
    let started = Instant::now();
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let url = url.to_owned();
        let commits = commits.clone();
        let interval = Duration::from_secs_f64(PRODUCERS as f64 / o.rate as f64);
        let count = total / PRODUCERS + u64::from(p < total % PRODUCERS);
        producers.push(tokio::spawn(async move {
            let c = connect(&url).await?;
            let stmt = c
                .prepare(
                    "SELECT outbox.enqueue('bench', convert_to(json_build_object('pad', repeat('x', 240))::text, 'UTF8'), \
                     CASE WHEN $1::bigint % 10 = 0 THEN 'key-' || ($1::bigint % 100) END, '{}', NULL, NULL, 10, 'application/json')",
                )
                .await?;
            let t0 = tokio::time::Instant::now() + interval.mul_f64(p as f64 / PRODUCERS as f64);
            for i in 0..count {
                tokio::time::sleep_until(t0 + interval.mul_f64(i as f64)).await;
                let id: Uuid = c.query_one(&stmt, &[&i64::try_from(i)?]).await?.get(0);
                lock(&commits).push((id, Instant::now()));
            }
            anyhow::Ok(())
        }));
    }
    for p in producers {
        p.await??;
    }
    let produced = started.elapsed();
    recorder
        .reached(target, "latency: waiting for the last acks")
        .await?;
    recorder.recording.store(false, Ordering::SeqCst);

    let acks: HashMap<Uuid, Instant> = std::mem::take(&mut *lock(&recorder.acks))
        .into_iter()
        .collect();
    let mut l: Vec<f64> = lock(&commits)
        .iter()
        .filter_map(|(id, committed)| {
            // The ack can come before the producer has read its commit reply: count that as 0.
            acks.get(id)
                .map(|ack| ack.saturating_duration_since(*committed).as_secs_f64() * 1000.0)
        })
        .collect();
    l.sort_by(f64::total_cmp);
    // Nearest-rank percentile: the value below which p of the samples fall.
    let pct = |p: f64| {
        let rank = (p * l.len() as f64).ceil() as usize;
        l.get(rank.saturating_sub(1)).copied().unwrap_or(f64::NAN)
    };
    println!(
        "latency, commit to destination ack, at {} msg/s for {} s ({} messages, backlog ~0, {} workers, batch {}): \
         p50 {:.2} ms, p95 {:.2} ms, p99 {:.2} ms, max {:.2} ms (enqueue rate achieved: {:.0} msg/s)",
        o.rate,
        o.latency_secs,
        l.len(),
        o.workers,
        o.batch_size,
        pct(0.50),
        pct(0.95),
        pct(0.99),
        l.last().copied().unwrap_or(f64::NAN),
        total as f64 / produced.as_secs_f64()
    );
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a destination benchmark leaves behind and removes afterwards.
enum Cleanup {
    Nothing,
    NatsStream(async_nats::jetstream::Context),
    AmqpQueue(lapin::Channel),
    RedisStream(redis::aio::MultiplexedConnection),
    KafkaTopic(rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>),
}

impl Cleanup {
    async fn run(self) {
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

/// The dispatch deadline of the benchmarked destinations.
const BENCH_DEADLINE: Duration = Duration::from_secs(30);

/// A destination built from its `[destinations.NAME]` settings, as the relayer builds it.
fn build(toml: &str) -> Result<Arc<dyn Destination>> {
    let config: DestinationConfig = toml::from_str(toml).context("bench destination settings")?;
    Ok(config.build("bench", BENCH_DEADLINE)?)
}

/// The destination for a destination benchmark, with whatever it needs on the server.
async fn destination(kind: &str) -> Result<(Arc<dyn Destination>, Cleanup)> {
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

/// Flushes dirty buffers before a measurement, so a checkpoint triggered by the previous
/// phase's writes does not land in it (needs superuser or pg_checkpoint; skipped otherwise).
async fn settle(sql: &tokio_postgres::Client) {
    if let Err(e) = sql.batch_execute("CHECKPOINT").await {
        eprintln!("bench: CHECKPOINT not run ({e}); figures may include checkpoint I/O");
    }
}

fn per_sec(n: u64, t: Duration) -> f64 {
    n as f64 / t.as_secs_f64()
}

/// The median of the values that are there; `None` when none is.
fn median(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let mut there: Vec<f64> = values.flatten().collect();
    if there.is_empty() {
        return None;
    }
    there.sort_by(f64::total_cmp);
    let mid = there.len() / 2;
    Some(if there.len() % 2 == 1 {
        there[mid]
    } else {
        f64::midpoint(there[mid - 1], there[mid])
    })
}

fn report(what: &str, backlog: u64, n: u64, t: Duration, workers: u32) {
    progress("");
    println!(
        "{what}: {n} messages in {:.2} s = {:.0} msg/s (backlog {backlog}, {workers} workers)",
        t.as_secs_f64(),
        per_sec(n, t)
    );
}

/// Delivers `o.memory_messages` in ten rounds (each enqueued, then drained) and prints the
/// resident memory after each: a relayer's memory must not grow with what it delivered.
async fn memory(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    let recorder = Recorder::new(None);
    let shutdown = CancellationToken::new();
    let relays = start_relays(url, o, &recorder, &shutdown)?;
    let round = o.memory_messages.div_ceil(10);
    let mut delivered = 0;
    println!("memory: RSS {:.1} MiB before delivering", rss_mib("VmRSS:"));
    for _ in 0..10 {
        let t = drain(sql, &recorder, round).await?;
        delivered += round;
        // What autovacuum does to a drained queue: the table's statistics now say empty.
        sql.batch_execute("VACUUM outbox.messages").await?;
        progress("");
        println!(
            "memory: RSS {:.1} MiB after {delivered} delivered ({:.0} msg/s this round)",
            rss_mib("VmRSS:"),
            per_sec(round, t)
        );
    }
    shutdown_relays(&shutdown, relays).await;
    println!("memory: peak RSS {:.1} MiB", peak_rss_mib());
    Ok(())
}

/// What a producer runs per transaction, measured by `--enqueue-connections`; each is
/// compared with the plain INSERT (at `PLAIN_INSERT`).
const PRODUCER_STATEMENTS: [(&str, &str); 4] = [
    (
        "outbox.enqueue",
        "SELECT outbox.enqueue('bench', $1::bytea, NULL, '{}', NULL, NULL, 10, 'application/json')",
    ),
    (
        "plain INSERT",
        "INSERT INTO outbox.messages (topic, payload, content_type) VALUES ('bench', $1, 'application/json')",
    ),
    (
        "INSERT + pg_notify",
        "WITH i AS (INSERT INTO outbox.messages (topic, payload, content_type) \
         VALUES ('bench', $1, 'application/json') RETURNING topic) \
         SELECT pg_notify('outbox_new', i.topic) FROM i",
    ),
    (
        "outbox.enqueue with a jsonb payload",
        "SELECT outbox.enqueue('bench', convert_from($1, 'UTF8')::jsonb)",
    ),
];

const PLAIN_INSERT: usize = 1;

/// Enqueue throughput per number of producer connections, each statement of
/// [`PRODUCER_STATEMENTS`] in turn (autocommit: one message per transaction).
async fn enqueue_rates(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    let payload = serde_json::json!({ "pad": "x".repeat(240) })
        .to_string()
        .into_bytes();
    for &connections in &o.enqueue_connections {
        let mut rates = Vec::new();
        for (what, statement) in PRODUCER_STATEMENTS {
            progress(&format!(
                "{what}: {connections} connections for {} s",
                o.enqueue_secs
            ));
            let mut producers = Vec::new();
            let until = Instant::now() + Duration::from_secs(o.enqueue_secs);
            for _ in 0..connections {
                let (url, payload) = (url.to_owned(), payload.clone());
                producers.push(tokio::spawn(async move {
                    let c = connect(&url).await?;
                    let stmt = c.prepare(statement).await?;
                    let mut n = 0_u64;
                    while Instant::now() < until {
                        c.execute(&stmt, &[&payload]).await?;
                        n += 1;
                    }
                    anyhow::Ok(n)
                }));
            }
            let mut n = 0;
            for p in producers {
                n += p.await??;
            }
            rates.push(per_sec(n, Duration::from_secs(o.enqueue_secs)));
            sql.batch_execute("TRUNCATE outbox.messages").await?;
        }
        progress("");
        let plain = rates[PLAIN_INSERT];
        let figures: Vec<String> = PRODUCER_STATEMENTS
            .iter()
            .zip(&rates)
            .map(|((what, _), rate)| format!("{what} {rate:.0}/s ({:.2}x)", rate / plain))
            .collect();
        println!(
            "enqueue, {connections} connections, one message per transaction, against the plain \
             INSERT: {}",
            figures.join(", ")
        );
    }
    Ok(())
}

/// VmHWM of this process, in MiB.
fn peak_rss_mib() -> f64 {
    rss_mib("VmHWM:")
}

/// A memory figure of this process from /proc/self/status (`VmRSS:`, `VmHWM:`), in MiB.
fn rss_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

async fn connect(url: &str) -> Result<tokio_postgres::Client> {
    let target = Target::parse(url).map_err(StoreError::InvalidUrl)?;
    Ok(target
        .connect()
        .await
        .map_err(|e| StoreError::connect_failed(&target, e))?)
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_is_of_the_rounds_that_finished() {
        assert_eq!(
            median([Some(3.0), None, Some(1.0), Some(2.0)].into_iter()),
            Some(2.0)
        );
        assert_eq!(median([Some(4.0), Some(1.0), None].into_iter()), Some(2.5));
        assert_eq!(median([None, None].into_iter()), None);
    }
}

//! `outbox-relay bench` (a module of the binary, not of the library): measures the relayer
//! against the Postgres in `DATABASE_URL`, in a database of its own that it creates and
//! drops. It prints figures; it judges nothing. One program per shape, chosen by its flag:
//!
//! - `drain.rs`, the default: floor (bare SQL), relay drain, flatness against a big
//!   backlog, latency under a steady rate, peak memory; into a server with `--destination`
//!   (`brokers.rs` prepares it);
//! - `memory.rs` (`--memory-messages`): memory stays flat while delivering;
//! - `producer_cost.rs` (`--enqueue-connections`): what a producer pays per transaction;
//! - `hot_key.rs` (`--hot-key`): one hot key beside other traffic;
//! - `fleet.rs` (`--fleet`): the drain with more and more relays;
//! - `sustained.rs` (`--sustained-secs`): a long run under a steady producer;
//! - `peers.rs` (`--peers`): against graphile-worker, pg-boss and pgmq;
//! - `many_sources.rs` (`--sources`): one fleet draining many outbox databases, and its
//!   fairness.
//! - `quiet.rs` (`--quiet-sources`): the latency of quiet sources beside a deep backlog;
//! - `stall.rs` (`--stall-secs`): the duplicates a stall of the destination leaves;
//! - `keyed.rs` (`--keyed-drain`): 10 % keyed traffic against unkeyed into a destination
//!   server, and both against a one-process client of the service's batch API.
//!
//! This file holds the options and what the shapes share: relays started and stopped,
//! messages filled and drained into the [`Recorder`] (`recorder.rs`), figures reported.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokio_util::sync::CancellationToken;

use outbox_relay::config::{RawConfig, Settings};
use outbox_relay::connection::Target;
use outbox_relay::dispatch::Dispatcher;
use outbox_relay::relay::Relay;
use outbox_relay::store::{Store, StoreError, fill_messages, with_database};

mod brokers;
mod console_pages;
mod drain;
mod fleet;
mod hot_key;
mod keyed;
mod many_sources;
mod memory;
mod peers;
mod producer_cost;
mod quiet;
mod recorder;
mod stall;
mod sustained;

use drain::bare_drain;
use recorder::{Recorder, progress};

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
    /// (127.0.0.1:6379), kafka (127.0.0.1:9092), mqtt (127.0.0.1:1883), pubsub (the Pub/Sub
    /// emulator at $PUBSUB_EMULATOR_HOST, default 127.0.0.1:8085), sqs, sns, eventbridge,
    /// kinesis (a moto server at $AWS_ENDPOINT_URL, default http://127.0.0.1:5000). With a
    /// server, only the drain and latency figures are measured.
    #[arg(long, default_value = "null", value_parser = ["null", "http", "nats", "amqp", "redis", "kafka", "mqtt", "pubsub", "sqs", "sns", "eventbridge", "kinesis"])]
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
    /// The sustained run with the MVCC horizon held for this many seconds, from the end of
    /// its first window: a REPEATABLE READ session keeps its snapshot, as a long report, a
    /// lagging replication slot or a standby's feedback would. Each window then shows the
    /// mean claim time (from pg_stat_user_functions) and the outbox's table and index sizes.
    #[arg(long, default_value_t = 0)]
    pub hold_horizon_secs: u64,
    /// Instead of the other measurements: the relayer against graphile-worker, pg-boss and
    /// pgmq (see `scripts/bench-peers.sh`, which prepares this directory: Node packages in
    /// DIR/node_modules, pgmq's SQL-only install in DIR/pgmq.sql).
    #[arg(long, value_name = "DIR")]
    pub peers: Option<std::path::PathBuf>,
    /// Rounds of the peers comparison (each drains once with every contender) and of the
    /// hot-key shape.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// How the relays send their leasing statements: auto, named or unnamed (the cost of
    /// unnamed statements, for transaction poolers, against named ones).
    #[arg(long, default_value = "auto")]
    pub statements: outbox_relay::store::Statements,
    /// Instead of the other measurements: drain `--messages`, split evenly over each of
    /// these numbers of outbox databases (comma-separated, e.g. 1,10,50), with `--workers`
    /// fleets serving them (many sources); prints the rate and Jain's fairness index.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=500))]
    pub sources: Vec<u32>,
    /// With --sources and --quiet-sources: the leasing calls each fleet runs at once on the server
    /// (`source_calls_per_server`; 0: no cap).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub calls_per_server: u32,
    /// With --sources and --quiet-sources: of those, the calls of backlogged sources
    /// (`source_backlogged_calls_per_server`; 0: the default, adaptive turns).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub backlogged_calls_per_server: u32,
    /// With --sources and --quiet-sources: each fleet's discovery interval
    /// (`sources_discover_interval_secs`), which is also how often it polls each source it
    /// does not serve.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub discover_interval_secs: u32,
    /// With --sources and --quiet-sources: the fleets' cap on connections to the server
    /// (`max_connections_per_server`; 0: no cap). Within it, each fleet keeps the poll
    /// sessions of the sources it does not serve open between polls; without it, each poll
    /// opens a new session.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub max_connections_per_server: u32,
    /// Instead of the other measurements: this many quiet outbox databases and one heavy
    /// one, served by `--workers` fleets; the quiet sources' commit-to-ack latency at
    /// `--rate` (in all) for `--latency-secs`, with the heavy source empty and then while it
    /// drains a backlog of `--messages`.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=500))]
    pub quiet_sources: u32,
    /// Instead of the other measurements: an HTTP receiver of the bench's own answers nothing
    /// for this many seconds in the middle of a steady stream, then processes what it held;
    /// prints the duplicates of the messages enqueued before, during and after the stall, and
    /// the attempts recorded.
    #[arg(long, default_value_t = 0)]
    pub stall_secs: u64,
    /// The stall shape's steady traffic before the stall and again after it, seconds.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub stall_steady_secs: u64,
    /// The stall shape's enqueue rate, messages per second.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub stall_rate: u64,
    /// The stall shape's `timeout_ms` of the HTTP destination (its dispatch deadline).
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub stall_timeout_ms: u64,
    /// Instead of the other measurements: the console's page times (median, p99) with this
    /// many pending messages and `--console-attempts` attempts, served in this process.
    #[arg(long, default_value_t = 0)]
    pub console_pages: u64,
    /// Attempts in the log for `--console-pages` [default: 5 × --console-pages].
    #[arg(long)]
    pub console_attempts: Option<u64>,
    /// Instead of the other measurements, with `--destination` pubsub, kinesis, sqs, sns,
    /// eventbridge or mqtt: `--rounds` times, `--messages` unkeyed and then as many with 10 % keyed
    /// (ten keys) drained into a fresh target, the keyed ones again with one message of a
    /// key per call (the control), and a one-process client sending as many payloads with
    /// the service's batch API, one request at a time (MQTT: publishes pipelined up to the
    /// destination's in-flight limit); prints each rate and the ratios.
    #[arg(long)]
    pub keyed_drain: bool,
}

/// The span maker of the relays when the `OTEL_*` variables turn export on (to measure
/// what a span per delivery attempt costs); `None`, as in a relayer by default, otherwise.
static SPANS: std::sync::OnceLock<Option<outbox_relay::traces::Spans>> = std::sync::OnceLock::new();

fn spans() -> Option<outbox_relay::traces::Spans> {
    SPANS.get().cloned().flatten()
}

pub async fn run(database_url: &str, o: &Options) -> Result<()> {
    outbox_relay::logging::init(outbox_relay::config::LogFormat::Human);
    outbox_relay::telemetry::install();
    let traces =
        outbox_relay::traces::TraceSettings::from_raw(None, |name| std::env::var(name).ok())?;
    let exporting = outbox_relay::traces::install(&traces)?;
    if let Some(e) = &exporting {
        outln!(
            "span export on: a send span per message attempt to {} ({:?})",
            e.endpoint(),
            traces.export.as_ref().map(|x| x.sampler)
        );
    }
    let _ = SPANS.set(
        exporting
            .as_ref()
            .map(outbox_relay::traces::Exporting::spans),
    );
    let result = run_shapes(database_url, o).await;
    if let Some(e) = exporting {
        e.shutdown().await;
    }
    result
}

async fn run_shapes(database_url: &str, o: &Options) -> Result<()> {
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
    outln!(
        "outbox-relay bench: {} messages per drain, {} workers, batch {}, 256-byte JSON payloads, 10% keyed, Postgres {}",
        o.messages,
        o.workers,
        o.batch_size,
        sql.query_one("SHOW server_version", &[])
            .await?
            .get::<_, String>(0)
    );

    if o.memory_messages > 0 {
        return memory::run(url, o, &sql).await;
    }
    if !o.enqueue_connections.is_empty() {
        return producer_cost::run(url, o, &sql).await;
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
    if !o.sources.is_empty() {
        return many_sources::run(url, o, &sql).await;
    }
    if o.quiet_sources > 0 {
        return quiet::run(url, o, &sql).await;
    }
    if o.stall_secs > 0 {
        return stall::run(url, o, &sql).await;
    }
    if o.console_pages > 0 {
        return console_pages::run(url, o, &sql).await;
    }
    if o.keyed_drain {
        return keyed::run(url, o, &sql).await;
    }

    drain::run(url, o, &sql).await
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
        let store = Store::connect(url, settings.pool_size)?.with_statements(o.statements);
        let dispatcher = Dispatcher::single(
            "bench",
            sink.clone(),
            settings.dispatch.circuit,
            BENCH_DEADLINE,
            settings.relay.max_batches_in_flight,
        )
        .traced(spans());
        let relay = Relay::new(settings.relay, store, Arc::new(dispatcher));
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

/// Inserts `n` messages: 256-byte JSON payloads, every tenth with one of 100 keys.
async fn fill(sql: &tokio_postgres::Client, n: u64) -> Result<()> {
    progress(&format!("enqueueing {n} messages"));
    fill_messages(sql, "bench", i64::try_from(n)?, Some(10), 1000, 256).await?;
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The dispatch deadline of the benchmarked destinations.
const BENCH_DEADLINE: Duration = Duration::from_secs(30);

/// Checkpoints the server has started, timed or requested (`pg_stat_checkpointer` from
/// PostgreSQL 17, `pg_stat_bgwriter` before).
async fn checkpoints_started(sql: &tokio_postgres::Client) -> Result<i64> {
    let version: i32 = sql
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await?
        .get(0);
    let query = if version >= 170_000 {
        "SELECT num_timed + num_requested FROM pg_stat_checkpointer"
    } else {
        "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"
    };
    Ok(sql.query_one(query, &[]).await?.get(0))
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
/// Nearest-rank percentile of `sorted`: the value below which `p` of the samples fall
/// (NaN without samples).
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss
)]
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted
        .get(rank.saturating_sub(1))
        .copied()
        .unwrap_or(f64::NAN)
}

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
    outln!(
        "{what}: {n} messages in {:.2} s = {:.0} msg/s (backlog {backlog}, {workers} workers)",
        t.as_secs_f64(),
        per_sec(n, t)
    );
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

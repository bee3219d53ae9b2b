//! `bench --sources 1,10,50`: one fleet serving many outbox databases. For each count, the
//! same total backlog (`--messages`) is split evenly over that many databases and drained
//! by `--workers` in-process fleets (each a `sources` supervisor with its own worker id,
//! one process at a time per source), into the null recorder. Prints the drain rate, the
//! WAL the server wrote a message and the checkpoints that fell in the drain, and Jain's
//! fairness index of the sources' deliveries per ten-second window (1.0: every source got
//! the same share), over the windows in which every source still had a backlog.
//! The fleets start together: the time each takes to learn the fleet's size (one
//! discovery interval, 1 s here) is part of the drain.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Result;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use outbox_relay::config::{RawConfig, Settings};
use outbox_relay::dispatch::Dispatcher;
use outbox_relay::sources::{Fleet, SourcesSettings};
use outbox_relay::store::{Store, fill_messages_returning_ids, with_database};

use super::{
    BENCH_DEADLINE, Options, Recorder, checkpoints_started, connect, lock, median, progress,
    report, settle,
};

pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    let (bench_db, template) = migrated_template(url, sql).await?;
    let result = async {
        for &n in &o.sources {
            measure(url, o, sql, &bench_db, &template, n).await?;
        }
        Ok(())
    }
    .await;
    drop_database(sql, &template).await;
    result
}

async fn measure(
    url: &str,
    o: &Options,
    sql: &tokio_postgres::Client,
    bench_db: &str,
    template: &str,
    n: u32,
) -> Result<()> {
    let per_source = o.messages / u64::from(n);
    let mut listed = BTreeMap::new();
    let mut source_of: HashMap<Uuid, usize> = HashMap::new();
    for i in 0..n as usize {
        let name = format!("{bench_db}_s{i}");
        progress(&format!("sources {n}: creating and filling {name}"));
        create_from(sql, &name, template).await?;
        let source_url = with_database(url, &name);
        let c = connect(&source_url).await?;
        let ids = fill_messages_returning_ids(
            &c,
            "bench",
            i64::try_from(per_source)?,
            Some(10),
            1000,
            256,
        )
        .await?;
        c.batch_execute("VACUUM ANALYZE outbox.messages").await?;
        source_of.extend(ids.into_iter().map(|id| (id, i)));
        listed.insert(name, source_url);
    }
    let checkpoints = checkpoints_started(sql).await.ok();
    settle(sql).await;
    Wal::checkpoint_counted(sql, checkpoints).await;
    let total = per_source * u64::from(n);
    let recorder = Recorder::new(None);
    lock(&recorder.acks).clear();
    recorder.recording.store(true, Ordering::SeqCst);
    let target = recorder.target(total);
    let shutdown = CancellationToken::new();
    let wal_before = Wal::read(sql).await;
    let started = Instant::now();
    let fleets = start_fleets(o, &listed, &recorder, &shutdown)?;
    recorder.reached(target, "draining").await?;
    let took = started.elapsed();
    recorder.recording.store(false, Ordering::SeqCst);
    shutdown.cancel();
    for f in fleets {
        let _ = f.await;
    }
    // The WAL of the drain's last calls: a backend publishes its counts when it exits.
    sessions_gone(sql, &listed).await;
    let wal_after = Wal::read(sql).await;
    report(
        &format!("sources {n}: {per_source} messages each"),
        total,
        total,
        took,
        o.workers,
    );
    let acks = std::mem::take(&mut *lock(&recorder.acks));
    // The same drain without the fleets' start (joining, the first polls, the first
    // claims): from the first delivery to the last.
    if let (Some(first), Some(last)) = (
        acks.iter().map(|(_, at)| *at).min(),
        acks.iter().map(|(_, at)| *at).max(),
    ) {
        let span = last.duration_since(first).as_secs_f64();
        outln!(
            "  from its first delivery to its last: {span:.2} s = {:.0} msg/s (the first \
             delivery {:.2} s after the fleets started)",
            total as f64 / span,
            first.duration_since(started).as_secs_f64()
        );
    }
    match (wal_before, wal_after) {
        (Ok(before), Ok(after)) => before.report(&after, total),
        (Err(e), _) | (_, Err(e)) => outln!("  WAL: not read ({e})"),
    }
    let fairness = jain_per_window(&acks, &source_of, n as usize, started, FAIRNESS_WINDOW);
    match median(fairness.iter().copied().map(Some)) {
        Some(mid) => outln!(
            "  Jain's fairness index over {} {}-second windows with every source backlogged: \
             median {mid:.3}, lowest {:.3}",
            fairness.len(),
            FAIRNESS_WINDOW.as_secs(),
            fairness.iter().copied().fold(f64::INFINITY, f64::min)
        ),
        None => outln!(
            "  Jain's fairness index: no full {}-second window with every source backlogged \
             (the drain took {:.1} s; give more --messages)",
            FAIRNESS_WINDOW.as_secs(),
            took.as_secs_f64()
        ),
    }
    for name in listed.keys() {
        drop_database(sql, name).await;
    }
    Ok(())
}

/// The server's WAL and checkpoint counters, read before and after a drain. The first
/// change of a page after a checkpoint writes the whole page to the WAL, and sources
/// drained side by side change more pages between two checkpoints than one source does: a
/// drain that the server's `max_wal_size` interrupts with checkpoints measures them too, so
/// the bench says how many there were. The counters are the whole server's: what else runs
/// on it counts too.
struct Wal {
    bytes: f64,
    full_pages: i64,
    checkpoints: i64,
    max_wal_size: String,
}

impl Wal {
    async fn read(sql: &tokio_postgres::Client) -> Result<Wal, String> {
        let row = sql
            .query_one(
                "SELECT wal_bytes::float8, wal_fpi, current_setting('max_wal_size') \
                   FROM pg_stat_wal",
                &[],
            )
            .await
            .map_err(|e| format!("pg_stat_wal: {e}"))?;
        Ok(Wal {
            bytes: row.get(0),
            full_pages: row.get(1),
            checkpoints: checkpoints_started(sql)
                .await
                .map_err(|e| format!("checkpoint counts: {e}"))?,
            max_wal_size: row.get(2),
        })
    }

    /// Waits (at most 2 s) until the checkpoint run before the drain is counted, so that
    /// it does not count as one during the drain.
    async fn checkpoint_counted(sql: &tokio_postgres::Client, before: Option<i64>) {
        let Some(before) = before else { return };
        for _ in 0..20 {
            if checkpoints_started(sql).await.is_ok_and(|now| now > before) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    #[allow(clippy::cast_precision_loss)]
    fn report(&self, after: &Wal, messages: u64) {
        let per = |x: f64| x / messages.max(1) as f64;
        let checkpoints = after.checkpoints - self.checkpoints;
        outln!(
            "  WAL: {:.0} bytes and {:.3} full-page images a message; {checkpoints} \
             checkpoint(s) during the drain (max_wal_size {}){}",
            per(after.bytes - self.bytes),
            per((after.full_pages - self.full_pages) as f64),
            after.max_wal_size,
            if checkpoints > 0 {
                ": the figures include what they cost, more with more sources \
                 (docs/performance.md)"
            } else {
                ""
            }
        );
    }
}

/// Waits (at most 5 s) until the sessions of the drained databases have ended.
async fn sessions_gone(sql: &tokio_postgres::Client, listed: &BTreeMap<String, String>) {
    let names: Vec<&str> = listed.keys().map(String::as_str).collect();
    for _ in 0..50 {
        let left = sql
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = ANY ($1)",
                &[&names],
            )
            .await
            .map_or(0, |row| row.get::<_, i64>(0));
        if left == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The bench database's name, and a migrated database beside it named after it, to copy
/// the sources from: one migration, however many sources.
pub(super) async fn migrated_template(
    url: &str,
    sql: &tokio_postgres::Client,
) -> Result<(String, String)> {
    let bench_db: String = sql
        .query_one("SELECT current_database()::text", &[])
        .await?
        .get(0);
    let template = format!("{bench_db}_tmpl");
    sql.batch_execute(&format!("CREATE DATABASE {template}"))
        .await?;
    Store::connect(&with_database(url, &template), 1)?
        .migrate()
        .await?;
    Ok((bench_db, template))
}

/// Starts `--workers` in-process fleets (each a `sources` supervisor with its own worker
/// id) serving the `listed` sources into `recorder`, until `shutdown`.
pub(super) fn start_fleets(
    o: &Options,
    listed: &BTreeMap<String, String>,
    recorder: &Arc<Recorder>,
    shutdown: &CancellationToken,
) -> Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut fleets = Vec::new();
    for w in 0..o.workers {
        let settings = Settings::from_raw(RawConfig {
            worker_id: Some(format!("bench-{w}")),
            batch_size: Some(i64::from(o.batch_size)),
            poll_interval_ms: Some(100),
            max_batches_in_flight: Some(i64::from(o.in_flight)),
            ..RawConfig::default()
        })?;
        let sources = SourcesSettings {
            listed: listed.clone(),
            discover_interval: Duration::from_secs(u64::from(o.discover_interval_secs)),
            lease: Duration::from_secs(15),
            pool_size: 3,
            max_connections_per_server: (o.max_connections_per_server > 0)
                .then(|| usize::try_from(o.max_connections_per_server).expect("at most 100000")),
            calls_per_server: (o.calls_per_server > 0)
                .then(|| usize::try_from(o.calls_per_server).expect("at most 1024")),
            backlogged_calls_per_server: (o.backlogged_calls_per_server > 0)
                .then(|| usize::try_from(o.backlogged_calls_per_server).expect("at most 1024")),
            ..SourcesSettings::default()
        };
        let dispatcher = Dispatcher::single(
            "bench",
            recorder.clone(),
            settings.dispatch.circuit,
            BENCH_DEADLINE,
            settings.relay.max_batches_in_flight,
        );
        let fleet = Arc::new(Fleet::new(
            sources,
            settings.relay,
            o.statements,
            Arc::new(dispatcher),
        ));
        fleets.push(tokio::spawn(outbox_relay::sources::run(
            fleet,
            shutdown.clone(),
        )));
    }
    Ok(fleets)
}

/// Jain's index (Σx)² / (n·Σx²) of the deliveries per source in each whole window from
/// `start`, up to the first window in which some source had no more to deliver.
fn jain_per_window(
    acks: &[(Uuid, Instant)],
    source_of: &HashMap<Uuid, usize>,
    sources: usize,
    start: Instant,
    window: Duration,
) -> Vec<f64> {
    if sources < 2 {
        return Vec::new();
    }
    let mut last_of = vec![Duration::ZERO; sources];
    let mut per_window: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for (id, at) in acks {
        let Some(&s) = source_of.get(id) else {
            continue;
        };
        let since = at.saturating_duration_since(start);
        last_of[s] = last_of[s].max(since);
        let w = u64::try_from(since.as_nanos() / window.as_nanos().max(1)).unwrap_or(u64::MAX);
        per_window.entry(w).or_insert_with(|| vec![0.0; sources])[s] += 1.0;
    }
    // A window counts while every source still delivers after it ends.
    let first_done = last_of.iter().copied().min().unwrap_or_default();
    per_window
        .into_iter()
        .filter(|(w, _)| u128::from(*w + 1) * window.as_nanos() <= first_done.as_nanos())
        .map(|(_, x)| {
            let sum: f64 = x.iter().sum();
            let squares: f64 = x.iter().map(|v| v * v).sum();
            if squares == 0.0 {
                1.0
            } else {
                sum * sum / (x.len() as f64 * squares)
            }
        })
        .collect()
}

/// The window of the fairness index: long enough for every source to get several batches.
const FAIRNESS_WINDOW: Duration = Duration::from_secs(10);

pub(super) async fn create_from(
    sql: &tokio_postgres::Client,
    name: &str,
    template: &str,
) -> Result<()> {
    for tries in 0.. {
        match sql
            .batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {template}"))
            .await
        {
            Ok(()) => return Ok(()),
            // The template's last session may still be closing.
            Err(e) if tries < 100 && e.code().is_some_and(|c| c.code() == "55006") => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    unreachable!("the loop returns")
}

pub(super) async fn drop_database(sql: &tokio_postgres::Client, name: &str) {
    if let Err(e) = sql
        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await
    {
        eprintln!("bench: could not drop {name}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_is_one_for_equal_shares_and_falls_for_unequal_ones() {
        let start = Instant::now();
        let ids: Vec<Uuid> = (0..40).map(|_| Uuid::new_v4()).collect();
        // Window 0: 10 and 10; window 1: 15 and 5; then source 1 keeps going in window 2.
        let mut source_of = HashMap::new();
        let mut acks = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let (source, at) = match i {
                0..10 => (0, 0.5),
                10..20 => (1, 0.5),
                20..35 => (0, 1.5),
                _ => (1, if i < 39 { 1.5 } else { 2.5 }),
            };
            source_of.insert(*id, source);
            acks.push((*id, start + Duration::from_secs_f64(at)));
        }
        let j = jain_per_window(&acks, &source_of, 2, start, Duration::from_secs(1));
        assert_eq!(
            j.len(),
            1,
            "only the windows before source 0 finished: {j:?}"
        );
        assert!((j[0] - 1.0).abs() < 1e-9);
    }
}

//! `bench --sustained-secs N`: a relayer under a steady producer for minutes, not a drain of
//! a backlog. What goes wrong over time in a Postgres queue (dead tuples piling up, the
//! attempt log's retention stalling the hot path, throughput drifting) only shows in a long
//! run; this prints per 30-second window what would show it.
//!
//! With `--hold-horizon-secs H`, a session holds its snapshot (REPEATABLE READ, one read,
//! then idle in transaction) from the end of the first window for H seconds: no row
//! version deleted meanwhile can be vacuumed, and each window prints the mean time of the
//! claim function (counted by Postgres itself, `track_functions`) and the outbox's sizes,
//! before, during and after the hold.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use outbox_relay::store::fill_messages_numbered;
use tokio_util::sync::CancellationToken;

use super::{
    Options, Recorder, checkpoints_started, connect, drain, per_sec, progress, report,
    shutdown_relays, start_relays,
};

/// Length of a reported window.
const WINDOW: Duration = Duration::from_secs(30);

/// The producer's rate as a share of the measured drain rate, unless given.
const LOAD: f64 = 0.8;

/// Attempts older than this are pruned while the relays run.
const RETENTION: &str = "60 seconds";

/// How often the attempt log is pruned. Often, so that each pass is small: one pass per
/// 30 s window (300,000 attempts at 10,000 msg/s) stalled the relays for 10–30 s at a
/// time on the 2-core machine, while the same run without pruning held its rate.
const PRUNE_EVERY: Duration = Duration::from_secs(3);

/// The most attempts one `prune_attempts` call deletes; a pass calls again while calls
/// come back full, so no transaction of the pass is long.
const PRUNE_CHUNK: i64 = 10_000;

/// The most messages one producer statement (one transaction) enqueues. A producer that
/// fell behind catches up in statements of this size, as a fleet of application
/// transactions would: one statement of everything due holds the MVCC horizon while it
/// runs, so no delivered row can be vacuumed meanwhile, every probe of its key triggers
/// steps over more dead entries, and the statement slows down further (at 25,000 msg/s
/// one such catch-up ran for minutes with nothing committed).
const PRODUCE_CHUNK: u64 = 1_000;

#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss
)]
pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    let autovacuum: String = sql.query_one("SHOW autovacuum", &[]).await?.get(0);
    if autovacuum != "on" {
        outln!(
            "sustained: autovacuum is {autovacuum} on this server: dead tuples will pile up \
             whatever the relayer does (run it against a server with autovacuum on)"
        );
    }
    // Postgres counts the calls and time of each function of the relays' sessions (set
    // before they connect): the claim's mean time per window, measured by the server.
    let database: String = sql
        .query_one("SELECT current_database()::text", &[])
        .await?
        .get(0);
    sql.batch_execute(&format!(
        "ALTER DATABASE \"{database}\" SET track_functions = 'pl'"
    ))
    .await?;
    let recorder = Recorder::new(None);
    let shutdown = CancellationToken::new();
    let relays = start_relays(url, o, &recorder, &shutdown)?;
    let t = drain(sql, &recorder, o.messages).await?;
    report(
        "drain of a backlog (sets the producer's rate)",
        o.messages,
        o.messages,
        t,
        o.workers,
    );
    let drained = per_sec(o.messages, t);
    let rate = o.sustained_rate.unwrap_or((drained * LOAD) as u64);
    let pruning = if o.sustained_no_prune {
        "the attempt log not pruned".to_owned()
    } else {
        format!(
            "attempts older than {RETENTION} pruned every {} s alongside",
            PRUNE_EVERY.as_secs()
        )
    };
    outln!(
        "sustained: a producer at {rate} msg/s ({:.0} % of that) for {} s, {pruning}",
        100.0 * rate as f64 / drained,
        o.sustained_secs,
    );

    let stop = CancellationToken::new();
    let enqueued = Arc::new(AtomicU64::new(0));
    let producer = tokio::spawn(produce(
        url.to_owned(),
        rate,
        Arc::clone(&enqueued),
        stop.clone(),
    ));
    let started = Instant::now();
    let pruner =
        (!o.sustained_no_prune).then(|| tokio::spawn(prune(url.to_owned(), started, stop.clone())));
    let hold = (o.hold_horizon_secs > 0).then(|| {
        let from = started + WINDOW;
        let until = from + Duration::from_secs(o.hold_horizon_secs);
        outln!(
            "sustained: the MVCC horizon held from {} s to {} s",
            WINDOW.as_secs(),
            WINDOW.as_secs() + o.hold_horizon_secs
        );
        (
            from,
            until,
            tokio::spawn(hold_horizon(url.to_owned(), from, until, stop.clone())),
        )
    });
    let mut claims = claim_calls(sql).await?;
    let mut windows_seen: Vec<Window> = Vec::new();
    let mut lsn = wal_lsn(sql).await?;
    let windows = o.sustained_secs.div_ceil(WINDOW.as_secs()).max(1);
    let mut rates = Vec::new();
    let mut most_dead = 0_i64;
    let mut last = recorder.delivered.load(Ordering::SeqCst);
    let mut last_enqueued = 0;
    for w in 1..=windows {
        tokio::time::sleep_until((started + WINDOW * u32::try_from(w)?).into()).await;
        let now = recorder.delivered.load(Ordering::SeqCst);
        let delivered = now - last;
        let r = per_sec(delivered, WINDOW);
        last = now;
        let now_enqueued = enqueued.load(Ordering::SeqCst);
        let produced = per_sec(now_enqueued - last_enqueued, WINDOW);
        last_enqueued = now_enqueued;
        let row = sql
            .query_one(
                "SELECT (SELECT count(*) FROM outbox.messages),
                        sum(s.n_dead_tup)::bigint, sum(s.autovacuum_count)::bigint,
                        (SELECT count(*) FROM outbox.attempts)
                   FROM pg_stat_user_tables AS s
                  WHERE s.relid IN (SELECT p.relid
                                      FROM pg_partition_tree('outbox.messages') AS p
                                     WHERE p.isleaf)",
                &[],
            )
            .await?;
        let (backlog, dead, vacuums, attempts): (i64, i64, i64, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let checkpoints = checkpoints_started(sql).await?;
        let wal = wal_lsn(sql).await?;
        let wal_per_msg = (wal - lsn) as f64 / delivered.max(1) as f64;
        lsn = wal;
        most_dead = most_dead.max(dead);
        let now_claims = claim_calls(sql).await?;
        let claim_ms = (now_claims.1 - claims.1) / (now_claims.0 - claims.0).max(1) as f64;
        claims = now_claims;
        let sizes = sizes(sql).await?;
        let end = started + WINDOW * u32::try_from(w)?;
        let held = hold
            .as_ref()
            .is_some_and(|(from, until, _)| end > *from && end - WINDOW < *until);
        progress("");
        outln!(
            "  window {w:>2} ({:>3}-{:>3} s){}: {r:>7.0} msg/s delivered, {produced:.0} \
             enqueued, backlog {backlog}, claim {claim_ms:.1} ms, \
             n_dead_tup {dead} (autovacuums so far {vacuums}), messages {} + indexes {} MB, \
             attempt log {attempts} rows ({} MB), \
             WAL {wal_per_msg:.0} bytes/msg (checkpoints so far {checkpoints})",
            (w - 1) * WINDOW.as_secs(),
            w * WINDOW.as_secs(),
            if held { " held" } else { "" },
            sizes.0 >> 20,
            sizes.1 >> 20,
            sizes.2 >> 20,
        );
        rates.push(r);
        windows_seen.push(Window {
            held,
            backlog,
            claim_ms,
            messages_bytes: sizes.0 + sizes.1,
            attempts_bytes: sizes.2,
        });
    }
    if let Some((_, _, holder)) = hold {
        holder.await??;
        summarize_hold(&windows_seen, rate);
    }
    stop.cancel();
    let produced = producer.await??;
    let prunes = match pruner {
        Some(pruner) => pruner.await??,
        None => Vec::new(),
    };
    shutdown_relays(&shutdown, relays).await;

    let mean = rates.iter().sum::<f64>() / rates.len() as f64;
    let (low, high) = rates
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), r| (l.min(*r), h.max(*r)));
    outln!(
        "sustained: {produced} produced; per-window throughput {low:.0}-{high:.0} msg/s, mean \
         {mean:.0}, spread (max-min)/mean {:.1} %; most dead tuples in outbox.messages {most_dead}",
        100.0 * (high - low) / mean
    );
    let slowest = prunes.iter().map(|p| p.1).max().unwrap_or_default();
    outln!(
        "sustained: {} prune_attempts passes deleted {} attempts, the slowest took {:.2} s",
        prunes.len(),
        prunes.iter().map(|p| p.0).sum::<i64>(),
        slowest.as_secs_f64()
    );
    Ok(())
}

/// Enqueues at `rate` per second (in the bench's mix of payloads and keys) until stopped,
/// catching up every 20 ms in statements of at most `PRODUCE_CHUNK`, and counts what
/// committed in `enqueued`; returns how many it enqueued.
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss
)]
async fn produce(
    url: String,
    rate: u64,
    enqueued: Arc<AtomicU64>,
    stop: CancellationToken,
) -> Result<u64> {
    let c = connect(&url).await?;
    let started = Instant::now();
    let mut produced = 0_u64;
    while !stop.is_cancelled() {
        let due = (started.elapsed().as_secs_f64() * rate as f64) as u64;
        while due > produced && !stop.is_cancelled() {
            let n = (due - produced).min(PRODUCE_CHUNK);
            let first = i64::try_from(produced)? + 1;
            fill_messages_numbered(&c, "bench", first, i64::try_from(n)?, Some(10), 1000, 256)
                .await?;
            produced += n;
            enqueued.store(produced, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(produced)
}

/// What a window of a held-horizon run is summarized by.
struct Window {
    held: bool,
    backlog: i64,
    claim_ms: f64,
    /// outbox.messages and its indexes.
    messages_bytes: i64,
    /// outbox.attempts and its indexes.
    attempts_bytes: i64,
}

/// The figures of the held-horizon target: the claim's time held against unheld, the
/// backlog against 5 s of traffic, the outbox's size before, at its largest and at the end.
#[allow(clippy::cast_precision_loss)]
fn summarize_hold(windows: &[Window], rate: u64) {
    let held: Vec<&Window> = windows.iter().filter(|w| w.held).collect();
    let after = windows
        .iter()
        .skip_while(|w| !w.held)
        .filter(|w| !w.held)
        .count();
    let (Some(unheld), Some(last)) = (windows.first().filter(|w| !w.held), windows.last()) else {
        return;
    };
    let worst_claim = held.iter().map(|w| w.claim_ms).fold(0.0, f64::max);
    let worst_backlog = held.iter().map(|w| w.backlog).max().unwrap_or_default();
    let largest = windows
        .iter()
        .map(|w| w.messages_bytes)
        .max()
        .unwrap_or_default();
    let largest_log = windows
        .iter()
        .map(|w| w.attempts_bytes)
        .max()
        .unwrap_or_default();
    outln!(
        "held horizon: claim {:.1} ms unheld, at most {worst_claim:.1} ms held ({:.1} ×); \
         backlog at most {worst_backlog} while held ({:.1} s of traffic at {rate} msg/s); \
         messages and indexes {} MB before, {} MB at most, {} MB at the end; attempt log \
         {} MB before, {} MB at most, {} MB at the end ({} windows after the hold, claim \
         {:.1} ms in the last)",
        unheld.claim_ms,
        worst_claim / unheld.claim_ms.max(0.001),
        worst_backlog as f64 / rate.max(1) as f64,
        unheld.messages_bytes >> 20,
        largest >> 20,
        last.messages_bytes >> 20,
        unheld.attempts_bytes >> 20,
        largest_log >> 20,
        last.attempts_bytes >> 20,
        after,
        last.claim_ms,
    );
}

/// Calls of the claim function so far and their total time in ms (pg_stat_user_functions).
async fn claim_calls(sql: &tokio_postgres::Client) -> Result<(i64, f64)> {
    let row = sql
        .query_one(
            "SELECT coalesce(sum(calls), 0)::bigint, coalesce(sum(total_time), 0)::float8 \
               FROM pg_stat_user_functions \
              WHERE schemaname = 'outbox' AND funcname = 'claim_outbox_batch_seq'",
            &[],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// Bytes of outbox.messages (its slots), of its indexes, and of outbox.attempts (its slots)
/// with its indexes.
async fn sizes(sql: &tokio_postgres::Client) -> Result<(i64, i64, i64)> {
    let row = sql
        .query_one(
            "SELECT sum(pg_relation_size(p.relid))::bigint, sum(pg_indexes_size(p.relid))::bigint, \
                    (SELECT sum(pg_total_relation_size(a.relid))::bigint \
                       FROM pg_partition_tree('outbox.attempts') AS a WHERE a.isleaf) \
               FROM pg_partition_tree('outbox.messages') AS p WHERE p.isleaf",
            &[],
        )
        .await?;
    Ok((row.get(0), row.get(1), row.get(2)))
}

/// Holds the MVCC horizon from `from` to `until` (or until stopped): one REPEATABLE READ
/// transaction that reads once and stays open, idle in transaction.
async fn hold_horizon(
    url: String,
    from: Instant,
    until: Instant,
    stop: CancellationToken,
) -> Result<()> {
    tokio::time::sleep_until(from.into()).await;
    let c = connect(&url).await?;
    c.batch_execute(
        "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM outbox.dead_letters",
    )
    .await?;
    tokio::select! {
        () = stop.cancelled() => {}
        () = tokio::time::sleep_until(until.into()) => {}
    }
    c.batch_execute("COMMIT").await?;
    Ok(())
}

/// The server's current WAL position, in bytes.
async fn wal_lsn(sql: &tokio_postgres::Client) -> Result<i64> {
    let row = sql
        .query_one("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint", &[])
        .await?;
    Ok(row.get(0))
}

/// Runs a pass of `prune_attempts` (in calls of `PRUNE_CHUNK`) every `PRUNE_EVERY` until
/// stopped, printing the slow passes; returns (deleted, took) per pass.
async fn prune(
    url: String,
    started: Instant,
    stop: CancellationToken,
) -> Result<Vec<(i64, Duration)>> {
    let c = connect(&url).await?;
    let mut passes = Vec::new();
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok(passes),
            () = tokio::time::sleep(PRUNE_EVERY) => {}
        }
        let began = Instant::now();
        let mut deleted = 0;
        loop {
            let chunk: i64 = c
                .query_one(
                    &format!("SELECT outbox.prune_attempts(interval '{RETENTION}', $1)"),
                    &[&PRUNE_CHUNK],
                )
                .await?
                .get(0);
            deleted += chunk;
            if chunk < PRUNE_CHUNK {
                break;
            }
        }
        let took = began.elapsed();
        if took >= Duration::from_secs(1) {
            outln!(
                "  prune_attempts at {:>3} s: {deleted} attempts deleted in {:.2} s",
                began.duration_since(started).as_secs(),
                took.as_secs_f64()
            );
        }
        passes.push((deleted, took));
    }
}

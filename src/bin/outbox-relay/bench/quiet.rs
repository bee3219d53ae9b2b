//! `bench --quiet-sources N`: what one source's deep backlog costs the other sources of a
//! fleet. N quiet outbox databases and one heavy one are served by `--workers` in-process
//! fleets; producers enqueue into the quiet sources at `--rate` in all (one transaction per
//! message) for `--latency-secs`, twice: with the heavy source empty, then while it drains
//! a backlog of `--messages`. Prints the percentiles of the quiet sources' time from the
//! producer's commit to the destination's acknowledgement in both runs, their ratio, and
//! how much of the heavy backlog was still left when the second run ended (it must not have
//! run dry, or the run did not measure what it says).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use outbox_relay::store::{fill_messages_returning_ids, with_database};

use super::many_sources::{create_from, drop_database, migrated_template, start_fleets};
use super::{Options, Recorder, connect, lock, percentile, progress, settle};

pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    if o.rate == 0 || o.latency_secs == 0 {
        bail!("--quiet-sources needs a --rate and --latency-secs above 0");
    }
    let (bench_db, template) = migrated_template(url, sql).await?;
    let mut listed = BTreeMap::new();
    let result = async {
        let heavy = format!("{bench_db}_heavy");
        for name in std::iter::once(heavy.clone())
            .chain((0..o.quiet_sources).map(|i| format!("{bench_db}_quiet{i}")))
        {
            progress(&format!("quiet sources: creating {name}"));
            create_from(sql, &name, &template).await?;
            listed.insert(name.clone(), with_database(url, &name));
        }
        let quiet: Vec<String> = listed.keys().filter(|n| **n != heavy).cloned().collect();
        let alone = measure(o, &listed, &quiet, None).await?;
        let heavy_url = listed[&heavy].clone();
        progress(&format!(
            "quiet sources: filling {heavy} with {}",
            o.messages
        ));
        let c = connect(&heavy_url).await?;
        fill_messages_returning_ids(&c, "bench", i64::try_from(o.messages)?, Some(10), 1000, 256)
            .await?;
        c.batch_execute("VACUUM ANALYZE outbox.messages").await?;
        settle(sql).await;
        let beside = measure(o, &listed, &quiet, Some(&c)).await?;
        let ratio = |a: f64, b: f64| b / a;
        outln!(
            "quiet sources ({} sources at {} msg/s in all for {} s, {} fleets, batch {}): \
             alone p50 {:.2} ms, p99 {:.2} ms; beside a backlog of {} in another source \
             p50 {:.2} ms, p99 {:.2} ms ({:.2} x the p99 alone; {} of the backlog left at the end)",
            o.quiet_sources,
            o.rate,
            o.latency_secs,
            o.workers,
            o.batch_size,
            alone.p50,
            alone.p99,
            o.messages,
            beside.p50,
            beside.p99,
            ratio(alone.p99, beside.p99),
            beside.heavy_left.unwrap_or_default(),
        );
        if beside.heavy_left == Some(0) {
            bail!(
                "the heavy source ran dry before the measurement ended: give more --messages \
                 or fewer --latency-secs"
            );
        }
        Ok(())
    }
    .await;
    for name in listed.keys() {
        drop_database(sql, name).await;
    }
    drop_database(sql, &template).await;
    result
}

struct Latency {
    p50: f64,
    p99: f64,
    /// Messages of the heavy source not delivered yet when the producers stopped.
    heavy_left: Option<i64>,
}

/// Starts the fleets, waits until every quiet source is served, runs the producers and
/// stops the fleets.
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss
)]
async fn measure(
    o: &Options,
    listed: &BTreeMap<String, String>,
    quiet: &[String],
    heavy: Option<&tokio_postgres::Client>,
) -> Result<Latency> {
    let recorder = Recorder::new(None);
    recorder.recording.store(true, Ordering::SeqCst);
    let shutdown = CancellationToken::new();
    let fleets = start_fleets(o, listed, &recorder, &shutdown)?;
    let result = async {
        // One message per quiet source, acknowledged: every quiet source is served.
        let mut warm = Vec::new();
        for name in quiet {
            let c = connect(&listed[name]).await?;
            let id: Uuid = c
                .query_one(
                    "SELECT outbox.enqueue('warm-up', convert_to('{}', 'UTF8'))",
                    &[],
                )
                .await?
                .get(0);
            warm.push(id);
        }
        progress(if heavy.is_some() {
            "quiet sources beside the backlog: waiting until every source is served"
        } else {
            "quiet sources alone: waiting until every source is served"
        });
        acked_all(
            &recorder,
            &warm,
            Duration::from_secs(120),
            "a warm-up message",
        )
        .await?;

        let total = o.rate * o.latency_secs;
        lock(&recorder.acks).clear();
        let commits: Arc<Mutex<Vec<(Uuid, Instant)>>> = Arc::default();
        progress(&format!(
            "quiet sources: enqueueing {} msg/s for {} s{}",
            o.rate,
            o.latency_secs,
            if heavy.is_some() {
                " beside the backlog"
            } else {
                ""
            }
        ));
        let per_source = (o.rate as f64 / quiet.len() as f64).max(f64::MIN_POSITIVE);
        let interval = Duration::from_secs_f64(1.0 / per_source);
        let mut producers = Vec::new();
        for (p, name) in quiet.iter().enumerate() {
            let url = listed[name].clone();
            let commits = commits.clone();
            let count =
                total / quiet.len() as u64 + u64::from((p as u64) < total % quiet.len() as u64);
            let offset = interval.mul_f64(p as f64 / quiet.len() as f64);
            producers.push(tokio::spawn(async move {
                let c = connect(&url).await?;
                let stmt = c
                    .prepare(
                        "SELECT outbox.enqueue('quiet', convert_to(json_build_object('pad', \
                         repeat('x', 240))::text, 'UTF8'))",
                    )
                    .await?;
                let t0 = tokio::time::Instant::now() + offset;
                for i in 0..count {
                    tokio::time::sleep_until(t0 + interval.mul_f64(i as f64)).await;
                    let id: Uuid = c.query_one(&stmt, &[]).await?.get(0);
                    lock(&commits).push((id, Instant::now()));
                }
                anyhow::Ok(())
            }));
        }
        for p in producers {
            p.await??;
        }
        let heavy_left = match heavy {
            Some(c) => Some(
                c.query_one("SELECT count(*) FROM outbox.messages", &[])
                    .await?
                    .get::<_, i64>(0),
            ),
            None => None,
        };
        let commits = std::mem::take(&mut *lock(&commits));
        // Every quiet message acknowledged (the heavy source's are acknowledged alongside).
        let ids: Vec<Uuid> = commits.iter().map(|(id, _)| *id).collect();
        acked_all(&recorder, &ids, Duration::from_secs(60), "a quiet message").await?;
        let acked: HashMap<Uuid, Instant> = std::mem::take(&mut *lock(&recorder.acks))
            .into_iter()
            .collect();
        let mut l: Vec<f64> = commits
            .iter()
            .filter_map(|(id, committed)| {
                acked
                    .get(id)
                    .map(|ack| ack.saturating_duration_since(*committed).as_secs_f64() * 1000.0)
            })
            .collect();
        l.sort_by(f64::total_cmp);
        anyhow::Ok(Latency {
            p50: percentile(&l, 0.50),
            p99: percentile(&l, 0.99),
            heavy_left,
        })
    }
    .await;
    recorder.recording.store(false, Ordering::SeqCst);
    shutdown.cancel();
    for f in fleets {
        let _ = f.await;
    }
    result
}

/// Waits until the recorder has acknowledged every one of `ids`; fails after `limit`. Reads
/// only the acknowledgements noted since its last look, so that it costs the relays beside
/// it little however many the heavy source adds.
async fn acked_all(recorder: &Recorder, ids: &[Uuid], limit: Duration, what: &str) -> Result<()> {
    let deadline = Instant::now() + limit;
    let mut missing: std::collections::HashSet<Uuid> = ids.iter().copied().collect();
    let mut seen = 0;
    loop {
        {
            let acks = lock(&recorder.acks);
            for (id, _) in acks.iter().skip(seen) {
                missing.remove(id);
            }
            seen = acks.len();
        }
        if missing.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{what}: {} of {} not acknowledged within {} s",
                missing.len(),
                ids.len(),
                limit.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

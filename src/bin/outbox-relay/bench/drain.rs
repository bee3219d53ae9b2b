//! The default shape of `outbox-relay bench`: the floor (a bare SQL drain, the most any
//! relayer could do here), the relayer's drain, flatness (a small backlog against a big
//! one), latency under a steady enqueue rate and the peak memory; into a destination
//! server (`--destination`), the drain and the latency only.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::brokers::destination;
use super::memory::peak_rss_mib;
use super::{
    Options, Recorder, connect, drain, fill, lock, per_sec, percentile, progress, report, settle,
    shutdown_relays, start_relays,
};

/// The default shape: the floor (bare SQL), the relayer's drain, flatness against a big
/// backlog, latency under a steady rate and the peak memory; or, with a destination server,
/// the drain and latency into it.
pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    if o.destination != "null" {
        let (destination, cleanup) = destination(&o.destination).await?;
        let recorder = Recorder::new(Some(destination));
        let shutdown = CancellationToken::new();
        let relays = start_relays(url, o, &recorder, &shutdown)?;
        let t = drain(sql, &recorder, o.messages).await?;
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
    fill(sql, o.messages).await?;
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
    let rate = drain(sql, &recorder, o.messages).await?;
    report(
        "relay drain (null destination)",
        o.messages,
        o.messages,
        rate,
        o.workers,
    );

    // 3. Flatness: a small backlog against a big one.
    let small = 20_000;
    let t_small = drain(sql, &recorder, small).await?;
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
        fill(sql, o.big_backlog).await?;
        sql.batch_execute("VACUUM ANALYZE outbox.messages").await?;
        settle(sql).await;
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
        outln!(
            "  flatness: throughput at {} backlog / at {} backlog = {:.2}",
            o.big_backlog,
            small,
            per_sec(measured, t_big) / small_rate
        );
        shutdown_relays(&shutdown, relays).await;
        sql.batch_execute("TRUNCATE outbox.messages").await?;
        sql.batch_execute("VACUUM ANALYZE outbox.messages").await?;
        settle(sql).await;
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
    outln!(
        "peak RSS of this process (relays + bench harness): {:.1} MiB",
        peak_rss_mib()
    );
    Ok(())
}

/// Claims and completes in one statement per batch until nothing is left (no leases, no
/// per-key order, in primary-key order: the cost of just consuming and recording).
pub(super) async fn bare_drain(url: &str, batch: i64, worker: &str) -> Result<()> {
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
    let pct = |p: f64| percentile(&l, p);
    outln!(
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

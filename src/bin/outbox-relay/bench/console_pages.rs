//! `bench --console-pages N`: how long each page of the console takes to serve with N
//! pending messages (10 % keyed over 1,000 keys), `--console-attempts` attempts spread
//! over the last hour and 1,000 dead letters, while `--workers` relays drain the backlog.
//! The messages and attempts are written straight into the slot tables by
//! `generate_series` in statements of a million rows (not through enqueue, so that ten
//! million messages and fifty million attempts take minutes), then the fleet's
//! observation is refreshed once, as the relayers would have kept it. The console runs in
//! this process on a loopback port; each page is asked for 50 times after two warm-up
//! requests, and the table gives the median, the 99th percentile and the maximum of the
//! time to the whole answer, with how many answers carried a cancelled query (the
//! statement timeout, 5 s here), and the load average before and after.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use outbox_relay::console::{self, ConsoleSettings};
use outbox_relay::store::fill_messages_numbered;
use tokio_util::sync::CancellationToken;

use super::recorder::{Recorder, progress};
use super::{Options, shutdown_relays, start_relays};

const REQUESTS: usize = 50;

/// Rows written by one statement of the fill.
const CHUNK: i64 = 1_000_000;

/// The three load averages of /proc/loadavg, as they read ("" where there is none).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    let n = i64::try_from(o.console_pages)?;
    let attempts = i64::try_from(o.console_attempts.unwrap_or(o.console_pages * 5))?;
    let started = Instant::now();
    let mut first = 1;
    while first <= n {
        progress(&format!("filling messages: {} of {n}", first - 1));
        let rows = CHUNK.min(n - first + 1);
        fill_messages_numbered(sql, "orders", first, rows, Some(10), 1000, 256).await?;
        first += rows;
    }
    // The bench's own database, as its owner: attempts written directly into the attempt
    // ring (the current slot, as the relayers' completions would have), in time order over
    // the last hour, one every 3,600 s / attempts.
    let mut done = 0;
    while done < attempts {
        progress(&format!("filling attempts: {done} of {attempts}"));
        let rows = CHUNK.min(attempts - done);
        sql.execute(
            "INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token, \
                                          created_at) \
             SELECT outbox.uuid_v7(), 1, \
                    (CASE WHEN g % 20 = 0 THEN 'RETRYABLE' ELSE 'DISPATCHED' END)::outbox.attempt_state, \
                    'bench-' || (g % 4), '00000000-0000-7000-8000-000000000001', \
                    now() - interval '1 hour' + g * (interval '1 hour' / $2::bigint) \
               FROM generate_series($1::bigint, $1::bigint + $3::bigint - 1) AS g",
            &[&done, &attempts, &rows],
        )
        .await
        .context("fill the attempt log")?;
        done += rows;
    }
    progress("");
    fill_messages_numbered(sql, "refused", 1, 1000, None, 1, 256).await?;
    sql.batch_execute(
        "SELECT outbox.complete_outbox_attempt(c.outbox_id, c.lease_token, 'bench-dl', 'FAILED', \
                                               'HTTP 400: refused') \
           FROM outbox.claim_outbox_batch(1000, 'bench-dl', 60, ARRAY['refused']) AS c; \
         ANALYZE",
    )
    .await
    .context("make dead letters")?;
    // The newest message: the drain delivers the oldest first, so it stays pending.
    let pending: uuid::Uuid = sql
        .query_one(
            "SELECT outbox_id FROM outbox.messages WHERE topic = 'orders' \
              ORDER BY outbox_id DESC LIMIT 1",
            &[],
        )
        .await?
        .get(0);
    let dead: uuid::Uuid = sql
        .query_one("SELECT outbox_id FROM outbox.dead_letters LIMIT 1", &[])
        .await?
        .get(0);
    let filled = started.elapsed();
    // What the fleet's relayers keep up to date: the observation, and the attempts of each
    // minute of the last hour (counted here once, all of them).
    let t = Instant::now();
    sql.batch_execute("SELECT outbox.observe(10, interval '0')")
        .await
        .context("refresh the observation")?;
    let observed = t.elapsed();
    let server_settings: String = sql
        .query_one(
            "SELECT string_agg(name || ' ' || current_setting(name), ', ' ORDER BY name) \
               FROM pg_settings \
              WHERE name IN ('shared_buffers', 'work_mem', 'fsync', 'synchronous_commit', \
                             'max_wal_size', 'effective_cache_size')",
            &[],
        )
        .await?
        .get(0);
    outln!(
        "console pages: {n} pending messages, {attempts} attempts, 1000 dead letters \
         (filled in {:.0} s; the first observation with the hour of attempt minutes took \
         {:.1} s); {REQUESTS} requests a page while {} relays (batch {}) drain; Postgres: {}",
        filled.as_secs_f64(),
        observed.as_secs_f64(),
        o.workers,
        o.batch_size,
        server_settings,
    );
    let recorder = Recorder::new(None);
    let drain_stop = CancellationToken::new();
    let relays = start_relays(url, o, &recorder, &drain_stop)?;
    // Measured once the drain delivers.
    let target = recorder.target(1);
    recorder.reached(target, "starting the drain").await?;
    let drained_before = recorder.delivered.load(Ordering::SeqCst);
    let measuring = Instant::now();
    outln!("load average before: {}", load_average());

    let settings = ConsoleSettings {
        listen: "127.0.0.1:0".parse()?,
        statement_timeout: Duration::from_secs(5),
        refresh: Duration::ZERO,
        ..ConsoleSettings::default()
    };
    let stores =
        console::connect_sources(&[("bench".to_owned(), url.to_owned())].into(), &settings)?;
    let shutdown = CancellationToken::new();
    let (addr, server) = console::serve(settings, stores, shutdown.clone()).await?;
    let addr = addr.to_string();
    let pages = [
        ("overview", "/?source=bench".to_owned()),
        ("messages", "/messages?source=bench".to_owned()),
        (
            "messages, topic",
            "/messages?source=bench&topic=orders".to_owned(),
        ),
        (
            "messages, key",
            "/messages?source=bench&key=key-7".to_owned(),
        ),
        (
            "messages, waiting",
            "/messages?source=bench&state=waiting".to_owned(),
        ),
        (
            "messages, id",
            format!("/messages?source=bench&id={pending}"),
        ),
        ("message", format!("/messages/{pending}?source=bench")),
        ("find by id", format!("/find?source=bench&id={dead}")),
        ("dead letters", "/dead-letters?source=bench".to_owned()),
        (
            "replay dry run",
            "/dead-letters/replay?source=bench&topic=refused".to_owned(),
        ),
        ("sources", "/sources?source=bench".to_owned()),
        ("destinations", "/destinations?source=bench".to_owned()),
    ];
    outln!(
        "{:<20} {:>10} {:>10} {:>10} {:>10}",
        "page",
        "median ms",
        "p99 ms",
        "max ms",
        "cancelled"
    );
    for (name, path) in &pages {
        let mut times = Vec::with_capacity(REQUESTS);
        let mut cancelled = 0;
        for i in 0..REQUESTS + 2 {
            let t = Instant::now();
            let (status, body) = outbox_relay::probes::probe(&addr, path).await?;
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            anyhow::ensure!(status == 200 || status == 303, "{path}: {status}");
            if i >= 2 {
                times.push(ms);
                cancelled += usize::from(body.contains("cancelled:"));
            }
        }
        times.sort_by(f64::total_cmp);
        // Nearest rank: the value with `percent` % of the others at or below it.
        let at = |percent: usize| times[(times.len() - 1) * percent / 100];
        outln!(
            "{name:<20} {:>10.1} {:>10.1} {:>10.1} {cancelled:>10}",
            at(50),
            at(99),
            times[times.len() - 1]
        );
    }
    let drained = recorder.delivered.load(Ordering::SeqCst) - drained_before;
    outln!(
        "load average after: {}; the drain delivered {drained} messages during the \
         measurement ({:.0} msg/s)",
        load_average(),
        drained as f64 / measuring.elapsed().as_secs_f64()
    );
    shutdown.cancel();
    let _ = server.await;
    shutdown_relays(&drain_stop, relays).await;
    Ok(())
}

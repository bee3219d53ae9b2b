//! `bench --console-pages N`: how long each page of the console takes to serve with N
//! pending messages (10 % keyed over 1,000 keys), `--console-attempts` attempts spread
//! over the last hour and 1,000 dead letters. The console runs in this process on a
//! loopback port; each page is asked for 50 times after two warm-up requests, and the
//! table gives the median, the 99th percentile and the maximum of the time to the whole
//! answer, with how many answers carried a cancelled query (the statement timeout, 5 s
//! here). No relay drains during the measurement.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use outbox_relay::console::{self, ConsoleSettings};
use outbox_relay::store::fill_messages;
use tokio_util::sync::CancellationToken;

use super::Options;

const REQUESTS: usize = 50;

pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    let n = i64::try_from(o.console_pages)?;
    let attempts = i64::try_from(o.console_attempts.unwrap_or(o.console_pages * 5))?;
    let started = Instant::now();
    fill_messages(sql, "orders", n, Some(10), 1000, 256).await?;
    // The bench's own database, as its owner: attempts written directly, as the relayers'
    // completions would have, spread over the last hour.
    sql.batch_execute(&format!(
        "INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token, \
                                      created_at) \
         SELECT outbox.uuid_v7(), 1, \
                (CASE WHEN g % 20 = 0 THEN 'RETRYABLE' ELSE 'DISPATCHED' END)::outbox.attempt_state, \
                'bench-' || (g % 4), gen_random_uuid(), \
                now() - (g % 3600) * interval '1 second' \
           FROM generate_series(1, {attempts}) AS g"
    ))
    .await
    .context("fill the attempt log")?;
    fill_messages(sql, "refused", 1000, None, 1, 256).await?;
    sql.batch_execute(
        "SELECT outbox.complete_outbox_attempt(c.outbox_id, c.lease_token, 'bench-dl', 'FAILED', \
                                               'HTTP 400: refused') \
           FROM outbox.claim_outbox_batch(1000, 'bench-dl', 60, ARRAY['refused']) AS c; \
         ANALYZE",
    )
    .await
    .context("make dead letters")?;
    let pending: uuid::Uuid = sql
        .query_one(
            "SELECT outbox_id FROM outbox.messages WHERE topic = 'orders' \
              ORDER BY outbox_id LIMIT 1 OFFSET $1",
            &[&(n / 2)],
        )
        .await?
        .get(0);
    let dead: uuid::Uuid = sql
        .query_one("SELECT outbox_id FROM outbox.dead_letters LIMIT 1", &[])
        .await?
        .get(0);
    outln!(
        "console pages: {n} pending messages, {attempts} attempts, 1000 dead letters \
         (filled in {:.0} s); {REQUESTS} requests a page, no drain running",
        started.elapsed().as_secs_f64()
    );

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
    shutdown.cancel();
    let _ = server.await;
    Ok(())
}

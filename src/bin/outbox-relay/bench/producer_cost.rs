//! `bench --enqueue-connections 1,16,64`: what a producer pays per transaction for
//! `outbox.enqueue`, against a plain INSERT with and without a notification, and with a
//! trace context given as arguments or by the transaction's settings.

use std::time::{Duration, Instant};

use anyhow::Result;

use super::{Options, connect, per_sec, progress};

/// What a producer runs per transaction, measured by `--enqueue-connections`; each is
/// compared with the plain INSERT (at `PLAIN_INSERT`).
const PRODUCER_STATEMENTS: [(&str, &str); 6] = [
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
    (
        "outbox.enqueue with a trace context",
        "SELECT outbox.enqueue('bench', $1::bytea, NULL, '{}', NULL, NULL, 10, 'application/json', \
         '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01', \
         'congo=t61rcWkgMzE,rojo=00f067aa0ba902b7')",
    ),
    // The producer's SET LOCAL, made in the same statement (a producer makes it a statement
    // of its own, one more round trip): the subquery's settings are made before the call.
    (
        "outbox.enqueue under SET LOCAL outbox.traceparent",
        "SELECT outbox.enqueue('bench', $1::bytea, NULL, '{}', NULL, NULL, 10, 'application/json') \
         FROM (SELECT set_config('outbox.traceparent', \
                 '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01', true), \
               set_config('outbox.tracestate', 'congo=t61rcWkgMzE,rojo=00f067aa0ba902b7', true)) \
              AS producer_context",
    ),
];

const PLAIN_INSERT: usize = 1;

/// Enqueue throughput per number of producer connections, each statement of
/// [`PRODUCER_STATEMENTS`] in turn (autocommit: one message per transaction).
pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
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
        outln!(
            "enqueue, {connections} connections, one message per transaction, against the plain \
             INSERT: {}",
            figures.join(", ")
        );
    }
    Ok(())
}

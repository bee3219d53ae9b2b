//! `bench --peers DIR`: the relayer against its peers on one Postgres, with the same
//! no-op workload: `--messages` pre-enqueued messages with 256-byte JSON payloads, drained
//! by a handler that does nothing. Each round drains once with every contender, each in a
//! database of its own; the table gives each one's median over the rounds, the relayer's
//! median against it, and the median of the relayer's rate against it round by round.
//!
//! Contenders: the relayer (`--workers` relays, `--in-flight` batches each); the SQL
//! functions it calls (`claim_outbox_batch_seq` + `complete_outbox_batch` in a loop from
//! `--workers` clients, no relayer); the bare floor (one `DELETE … RETURNING` + attempt
//! insert per batch, no leases); graphile-worker and pg-boss (`--workers` Node processes
//! each, from DIR/node_modules); pgmq's read + delete (4 clients, at the run's batch and
//! at batch 100, the configuration the design's performance budget quotes pgmq at), when
//! DIR/pgmq.sql holds its SQL-only install. `scripts/bench-peers.sh` prepares DIR and a
//! throwaway Postgres.
//!
//! The clock starts when the contender's workers are connected and ready, and stops when
//! the last message is handled and its completion is visible in the database. The WAL
//! written in between (the cluster's, read from its insert position: nothing else runs
//! on the throwaway cluster) is given per message: it is most of what a drain costs.
//!
//! Why one file of a little over 500 lines: it is one program, and each contender's part
//! (its setup, its drain loop) is short; what they share (the clock, WAL per message, the
//! table of medians) would only be scattered by splitting it per contender.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use outbox_relay::message::{AttemptState, Completion, WorkerId};
use outbox_relay::store::{ClaimSizes, Store, TopicFilter, fill_messages, with_database};

use super::{
    Options, Recorder, bare_drain, connect, median, per_sec, progress, settle, shutdown_relays,
    start_relays,
};

/// The Node side of the peers, written into DIR at the start of a run.
const NODE_PEERS: &str = include_str!("../../../../scripts/peers/peers.mjs");
/// pgmq's consumers: 4 clients, each reading a batch and deleting it by id.
const PGMQ_CLIENTS: u32 = 4;
/// pgmq's second batch size, beside the run's: the one the design's performance budget
/// and its throughput target were measured at (named in [`Contender::name`]).
const PGMQ_SMALL_BATCH: i32 = 100;
/// A contender that has not drained by then is reported as not finishing.
const DRAIN_LIMIT: Duration = Duration::from_secs(900);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Contender {
    Relayer,
    SqlFunctions,
    BareFloor,
    GraphileWorker,
    PgBoss,
    Pgmq,
    PgmqSmallBatch,
}

impl Contender {
    fn name(self) -> &'static str {
        match self {
            Contender::Relayer => "outbox-relay",
            Contender::SqlFunctions => "outbox SQL functions, no relayer",
            Contender::BareFloor => "bare floor (DELETE + attempt, no leases)",
            Contender::GraphileWorker => "graphile-worker (batched)",
            Contender::PgBoss => "pg-boss (batched fetch)",
            Contender::Pgmq => "pgmq read + delete",
            Contender::PgmqSmallBatch => "pgmq read + delete (batch 100)",
        }
    }

    fn node_name(self) -> Option<&'static str> {
        match self {
            Contender::GraphileWorker => Some("graphile-worker"),
            Contender::PgBoss => Some("pg-boss"),
            _ => None,
        }
    }

    /// How many messages are not yet done, as the contender's own tables say.
    fn remaining_sql(self) -> &'static str {
        match self {
            Contender::Relayer | Contender::SqlFunctions | Contender::BareFloor => {
                "SELECT count(*) FROM outbox.messages"
            }
            Contender::GraphileWorker => "SELECT count(*) FROM graphile_worker._private_jobs",
            Contender::PgBoss => {
                "SELECT count(*) FROM pgboss.job WHERE state IN ('created', 'retry', 'active')"
            }
            Contender::Pgmq | Contender::PgmqSmallBatch => "SELECT count(*) FROM pgmq.q_noop",
        }
    }
}

pub(super) async fn run(database_url: &str, dir: &Path, o: &Options) -> Result<()> {
    let dir = dir
        .canonicalize()
        .with_context(|| format!("--peers {}: no such directory", dir.display()))?;
    if !dir.join("node_modules").is_dir() {
        bail!(
            "--peers {}: no node_modules there; scripts/bench-peers.sh installs graphile-worker and pg-boss into it",
            dir.display()
        );
    }
    std::fs::write(dir.join("peers.mjs"), NODE_PEERS)
        .with_context(|| format!("write {}", dir.join("peers.mjs").display()))?;
    let pgmq = dir.join("pgmq.sql");
    let mut contenders = vec![
        Contender::Relayer,
        Contender::SqlFunctions,
        Contender::BareFloor,
        Contender::GraphileWorker,
        Contender::PgBoss,
    ];
    if pgmq.is_file() {
        contenders.extend([Contender::Pgmq, Contender::PgmqSmallBatch]);
    } else {
        outln!(
            "pgmq: skipped ({} is missing; scripts/bench-peers.sh takes it from the pgmq wheel on PyPI)",
            pgmq.display()
        );
    }
    let admin = connect(database_url).await?;
    let settings: Vec<String> = admin
        .query(
            "SELECT name || '=' || setting || coalesce(unit, '') FROM pg_settings \
              WHERE name IN ('server_version', 'shared_buffers', 'synchronous_commit', \
                             'max_wal_size', 'autovacuum', 'fsync')
              ORDER BY name",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    outln!(
        "peers: {} messages of 256-byte JSON, no-op handlers, {} rounds, batch {}; Postgres: {}",
        o.messages,
        o.rounds,
        o.batch_size,
        settings.join(", ")
    );

    let mut rates: Vec<Vec<Option<Drained>>> = vec![Vec::new(); contenders.len()];
    for round in 1..=o.rounds {
        for (i, &c) in contenders.iter().enumerate() {
            let db = format!("outbox_peers_{}_{round}_{i}", std::process::id());
            admin
                .batch_execute(&format!("CREATE DATABASE {db}"))
                .await?;
            let url = with_database(database_url, &db);
            let measured = measure(c, &url, &dir, o).await;
            admin
                .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
                .await?;
            let rate = match measured {
                Ok((took, wal)) => {
                    let drained = Drained {
                        rate: per_sec(o.messages, took),
                        wal_per_message: wal as f64 / o.messages as f64,
                    };
                    outln!(
                        "round {round}: {}: {} messages in {:.2} s = {:.0} msg/s, {:.0} WAL bytes per message",
                        c.name(),
                        o.messages,
                        took.as_secs_f64(),
                        drained.rate,
                        drained.wal_per_message
                    );
                    Some(drained)
                }
                Err(e) => {
                    outln!("round {round}: {}: did not finish: {e:#}", c.name());
                    None
                }
            };
            rates[i].push(rate);
        }
    }
    table(&contenders, &rates, o);
    Ok(())
}

/// One contender's drain in one round.
#[derive(Clone, Copy)]
struct Drained {
    rate: f64,
    wal_per_message: f64,
}

fn table(contenders: &[Contender], rates: &[Vec<Option<Drained>>], o: &Options) {
    let medians: Vec<Option<f64>> = rates
        .iter()
        .map(|r| median(r.iter().map(|d| d.map(|d| d.rate))))
        .collect();
    let relayer = medians[0];
    outln!();
    outln!(
        "| contender | workers | rounds (msg/s) | median msg/s | outbox-relay / this | same round, median | WAL bytes per message (median) |"
    );
    outln!("| --- | --- | --- | --- | --- | --- | --- |");
    for (i, &c) in contenders.iter().enumerate() {
        let workers = match c {
            Contender::Relayer => format!("{} relays x {} in flight", o.workers, o.in_flight),
            Contender::SqlFunctions | Contender::BareFloor => format!("{} clients", o.workers),
            Contender::GraphileWorker => format!("{} processes x 24 jobs", o.workers),
            Contender::PgBoss => format!("{} processes x 4 workers", o.workers),
            Contender::Pgmq | Contender::PgmqSmallBatch => format!("{PGMQ_CLIENTS} clients"),
        };
        let rounds: Vec<String> = rates[i]
            .iter()
            .map(|r| r.map_or_else(|| "-".to_owned(), |r| format!("{:.0}", r.rate)))
            .collect();
        let wal = median(rates[i].iter().map(|d| d.map(|d| d.wal_per_message)));
        let ratio = match (relayer, medians[i]) {
            (Some(a), Some(b)) if i > 0 => format!("{:.2}x", a / b),
            _ => "-".to_owned(),
        };
        // The machine's speed drifts between rounds more than the contenders differ within
        // one: the relayer against this contender in the same round, as a median.
        let paired = median(rates[0].iter().zip(&rates[i]).map(|(a, b)| match (a, b) {
            (Some(a), Some(b)) if i > 0 => Some(a.rate / b.rate),
            _ => None,
        }))
        .map_or_else(|| "-".to_owned(), |r| format!("{r:.2}x"));
        let shown = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
        outln!(
            "| {} | {workers} | {} | {} | {ratio} | {paired} | {} |",
            c.name(),
            rounds.join(" / "),
            shown(medians[i]),
            shown(wal)
        );
    }
}

/// Sets `c` up in the empty database at `url`, enqueues the messages and times the drain;
/// returns its time and the WAL bytes written meanwhile.
async fn measure(c: Contender, url: &str, dir: &Path, o: &Options) -> Result<(Duration, u64)> {
    let sql = connect(url).await?;
    progress(&format!("{}: enqueueing {} messages", c.name(), o.messages));
    let n = i64::try_from(o.messages)?;
    match c {
        Contender::Relayer | Contender::SqlFunctions | Contender::BareFloor => {
            Store::connect(url, 2)?.migrate().await?;
            fill_messages(&sql, "bench", n, None, 1, 256).await?;
        }
        Contender::Pgmq | Contender::PgmqSmallBatch => {
            let install = std::fs::read_to_string(dir.join("pgmq.sql"))?;
            sql.batch_execute(&install).await.context("load pgmq.sql")?;
            sql.execute("SELECT pgmq.create('noop')", &[]).await?;
            sql.execute(
                "SELECT count(*) FROM generate_series(1, $1::bigint, 10000) AS s, \
                 LATERAL pgmq.send_batch('noop', ARRAY(\
                   SELECT json_build_object('pad', repeat('x', 246))::jsonb \
                     FROM generate_series(s, least(s + 9999, $1::bigint))))",
                &[&n],
            )
            .await?;
        }
        Contender::GraphileWorker | Contender::PgBoss => {
            node(
                dir,
                &[
                    "setup",
                    c.node_name().unwrap_or_default(),
                    url,
                    &o.messages.to_string(),
                ],
            )
            .status()
            .await?
            .success()
            .then_some(())
            .context("the Node peer's setup failed")?;
        }
    }
    sql.batch_execute("VACUUM ANALYZE").await?;
    settle(&sql).await;
    progress(&format!("{}: draining", c.name()));
    let wal_from: String = sql
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await?
        .get(0);
    let took = tokio::time::timeout(DRAIN_LIMIT, drain(c, url, &sql, dir, o))
        .await
        .with_context(|| format!("not drained within {} s", DRAIN_LIMIT.as_secs()))??;
    let left = left(c, &sql).await?;
    if left != 0 {
        bail!("{left} messages left after the drain");
    }
    let wal: i64 = sql
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::text::pg_lsn)::bigint",
            &[&wal_from],
        )
        .await?
        .get(0);
    progress("");
    Ok((took, u64::try_from(wal)?))
}

async fn drain(
    c: Contender,
    url: &str,
    sql: &tokio_postgres::Client,
    dir: &Path,
    o: &Options,
) -> Result<Duration> {
    match c {
        Contender::Relayer => {
            let recorder = Recorder::new(None);
            let target = recorder.target(o.messages);
            let shutdown = CancellationToken::new();
            let started = Instant::now();
            let relays = start_relays(url, o, &recorder, &shutdown)?;
            recorder.reached(target, "draining").await?;
            until_done(c, sql).await?;
            let took = started.elapsed();
            shutdown_relays(&shutdown, relays).await;
            Ok(took)
        }
        Contender::SqlFunctions => {
            clients(o.workers, |w| {
                let url = url.to_owned();
                let batch = i32::try_from(o.batch_size).unwrap_or(i32::MAX);
                async move { function_drain(&url, batch, w).await }
            })
            .await
        }
        Contender::BareFloor => {
            clients(o.workers, |w| {
                let url = url.to_owned();
                let batch = i64::from(o.batch_size);
                async move { bare_drain(&url, batch, &format!("floor-{w}")).await }
            })
            .await
        }
        Contender::Pgmq | Contender::PgmqSmallBatch => {
            clients(PGMQ_CLIENTS, |_| {
                let url = url.to_owned();
                let batch = if c == Contender::Pgmq {
                    i32::try_from(o.batch_size).unwrap_or(i32::MAX)
                } else {
                    PGMQ_SMALL_BATCH
                };
                async move { pgmq_drain(&url, batch).await }
            })
            .await
        }
        Contender::GraphileWorker | Contender::PgBoss => node_drain(c, url, sql, dir, o).await,
    }
}

/// Runs `n` copies of `client` at once and times them all.
async fn clients<F, Fut>(n: u32, client: F) -> Result<Duration>
where
    F: Fn(u32) -> Fut,
    Fut: std::future::Future<Output = Result<()>> + Send + 'static,
{
    let started = Instant::now();
    let tasks: Vec<_> = (0..n).map(|w| tokio::spawn(client(w))).collect();
    for t in tasks {
        t.await??;
    }
    Ok(started.elapsed())
}

/// The relayer's SQL path without the relayer: claim a batch, complete it as delivered.
async fn function_drain(url: &str, batch: i32, w: u32) -> Result<()> {
    let store = Store::connect(url, 1)?;
    let check = connect(url).await?;
    let worker = WorkerId::new(format!("functions-{w}"));
    let mut empty = 0;
    loop {
        let claimed = store
            .claim(
                batch,
                &worker,
                30,
                None,
                TopicFilter::default(),
                ClaimSizes::default(),
            )
            .await?;
        if claimed.is_empty() {
            // Another client may hold the turn of every shard with messages left.
            empty += 1;
            if empty > 3 && left(Contender::SqlFunctions, &check).await? == 0 {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        empty = 0;
        let done: Vec<Completion> = claimed
            .iter()
            .map(|m| Completion {
                id: m.id,
                lease_token: m.lease_token,
                state: AttemptState::Dispatched,
                error: None,
                retry_at: None,
            })
            .collect();
        store.complete(&worker, &done).await?;
    }
}

/// pgmq's consumer loop: read a batch (30 s visibility timeout), delete it by id.
async fn pgmq_drain(url: &str, batch: i32) -> Result<()> {
    let c = connect(url).await?;
    let read = c
        .prepare("SELECT array_agg(msg_id) FROM pgmq.read('noop', 30, $1)")
        .await?;
    let delete = c
        .prepare("SELECT pgmq.delete('noop'::text, $1::bigint[])")
        .await?;
    loop {
        let ids: Option<Vec<i64>> = c.query_one(&read, &[&batch]).await?.get(0);
        match ids {
            Some(ids) => {
                c.query(&delete, &[&ids]).await?;
            }
            None => return Ok(()),
        }
    }
}

fn node(dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new("node");
    cmd.arg(dir.join("peers.mjs"))
        .args(args)
        .env("PEERS_DIR", dir)
        .current_dir(dir)
        .kill_on_drop(true);
    cmd
}

/// Starts `--workers` Node processes of the peer, waits until each says it is ready, then
/// lets them go and adds up the jobs they report handled.
async fn node_drain(
    c: Contender,
    url: &str,
    sql: &tokio_postgres::Client,
    dir: &Path,
    o: &Options,
) -> Result<Duration> {
    let name = c.node_name().unwrap_or_default();
    let handled = Arc::new(AtomicU64::new(0));
    let mut children: Vec<Child> = Vec::new();
    let mut readers = Vec::new();
    for _ in 0..o.workers {
        let mut child = node(dir, &["work", name, url])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .env("PEERS_BATCH", o.batch_size.to_string())
            .spawn()
            .context("start node (is Node.js installed?)")?;
        let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
        match lines.next_line().await? {
            Some(line) if line == "ready" => {}
            other => bail!("the {name} worker did not start: {other:?}"),
        }
        let handled = handled.clone();
        readers.push(tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                handled.fetch_add(line.trim().parse().unwrap_or(0), Ordering::Relaxed);
            }
        }));
        children.push(child);
    }
    let started = Instant::now();
    for child in &mut children {
        child
            .stdin
            .as_mut()
            .context("no stdin")?
            .write_all(b"go\n")
            .await?;
    }
    while handled.load(Ordering::Relaxed) < o.messages {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    until_done(c, sql).await?;
    let took = started.elapsed();
    for child in &mut children {
        drop(child.stdin.take());
    }
    for mut child in children {
        if tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .is_err()
        {
            child.kill().await?;
        }
    }
    for r in readers {
        r.abort();
    }
    Ok(took)
}

/// Waits until the contender's tables show every message done (its last completions may
/// still be on their way after the handler ran).
async fn until_done(c: Contender, sql: &tokio_postgres::Client) -> Result<()> {
    loop {
        if left(c, sql).await? == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How many messages `c`'s own tables say are not yet done.
async fn left(c: Contender, sql: &tokio_postgres::Client) -> Result<i64> {
    Ok(sql.query_one(c.remaining_sql(), &[]).await?.get(0))
}

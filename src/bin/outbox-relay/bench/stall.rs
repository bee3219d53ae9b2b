//! `bench --stall-secs N`: how many duplicates a stall of the destination costs. Delivery
//! is at least once, so a call that timed out is sent again although the destination may
//! have accepted it; this shape measures how many such duplicates a stall of a given length
//! leaves, for the figure in docs/destinations.md.
//!
//! An HTTP receiver of the bench's own takes a steady stream of messages; for N seconds in
//! the middle of the run it answers nothing, as a frozen server (SIGSTOP, a long GC pause, a
//! stalled load balancer) does: every request it gets then is held, and processed (counted)
//! when the stall ends, whether or not the relayer still waits for the answer. The relayer
//! runs with the destination's `timeout_ms` of `--stall-timeout-ms`, so the calls of the
//! stall time out, are recorded as unanswered attempts and are sent again. Printed: the
//! messages of each phase (before, during, after the stall), how many arrived more than
//! once and how often, and the attempts recorded.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use axum::extract::State;
use axum::http::HeaderMap;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use outbox_relay::config::{RawConfig, Settings};
use outbox_relay::destination::DestinationConfig;
use outbox_relay::dispatch::Dispatcher;
use outbox_relay::relay::Relay;
use outbox_relay::store::Store;

use super::recorder::progress;
use super::{Options, connect, lock, shutdown_relays};

/// How long the drain may take once the producer has stopped.
const DRAIN_LIMIT: Duration = Duration::from_secs(600);

/// The receiver's state, shared by its requests.
struct Receiver {
    /// `true` while the receiver is stalled.
    stalled: watch::Sender<bool>,
    /// How many times each outbox id (its `Idempotency-Key`) arrived.
    received: Mutex<HashMap<String, u32>>,
}

/// One delivery: counted once the receiver runs, in a task of its own, so that a request
/// the relayer gave up on is still counted, as a frozen server that has read a request
/// processes it when it runs again.
async fn hook(State(r): State<Arc<Receiver>>, headers: HeaderMap) -> &'static str {
    let id = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let mut stalled = r.stalled.subscribe();
    let counted = tokio::spawn(async move {
        let _ = stalled.wait_for(|s| !*s).await;
        *lock(&r.received).entry(id).or_default() += 1;
    });
    let _ = counted.await;
    "ok"
}

#[allow(clippy::cast_precision_loss)]
pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    let stall = Duration::from_secs(o.stall_secs);
    let steady = Duration::from_secs(o.stall_steady_secs);
    let receiver = Arc::new(Receiver {
        stalled: watch::Sender::new(false),
        received: Mutex::default(),
    });
    let app = axum::Router::new()
        .route("/hooks/{topic}", axum::routing::post(hook))
        .with_state(receiver.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let hooks = format!("http://{}/hooks/{{topic}}", listener.local_addr()?);
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });

    let shutdown = CancellationToken::new();
    let relays = start_relays(url, o, &hooks, &shutdown)?;

    outln!(
        "stall: the destination (HTTP) answers nothing for {} s in the middle of {} s of steady traffic \
         at {} msg/s; timeout_ms {}, {} workers, batch {}, {} batches in flight each",
        o.stall_secs,
        (steady + stall + steady).as_secs(),
        o.stall_rate,
        o.stall_timeout_ms,
        o.workers,
        o.batch_size,
        o.in_flight
    );
    let producing = Instant::now();
    let produced = produce(url, o, &receiver, steady, stall).await?;
    let took = producing.elapsed();

    let drained = Instant::now();
    loop {
        let pending: i64 = sql
            .query_one("SELECT count(*) FROM outbox.messages", &[])
            .await?
            .get(0);
        if pending == 0 {
            break;
        }
        if drained.elapsed() > DRAIN_LIMIT {
            bail!("{pending} messages still pending {DRAIN_LIMIT:?} after the producer stopped");
        }
        progress(&format!("stall: {pending} messages still pending"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    progress("");
    // Calls the relayer gave up on may still be held by the receiver's tasks for a moment.
    tokio::time::sleep(Duration::from_secs(1)).await;
    shutdown_relays(&shutdown, relays).await;
    server.abort();

    let received = std::mem::take(&mut *lock(&receiver.received));
    let dead: i64 = sql
        .query_one("SELECT count(*) FROM outbox.dead_letters", &[])
        .await?
        .get(0);
    for (phase, ids) in [
        ("before the stall", &produced.before),
        ("during the stall", &produced.during),
        ("after the stall", &produced.after),
    ] {
        let mut times: HashMap<u32, u64> = HashMap::new();
        let mut missing = 0;
        for id in ids {
            match received.get(&id.to_string()) {
                Some(n) => *times.entry(*n).or_default() += 1,
                None => missing += 1,
            }
        }
        let duplicates: u64 = times
            .iter()
            .map(|(n, count)| u64::from(n - 1) * count)
            .sum();
        let mut more: Vec<_> = times.iter().filter(|(n, _)| **n > 1).collect();
        more.sort();
        let shape = more
            .iter()
            .map(|(n, count)| format!("{count} × {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        outln!(
            "  enqueued {phase}: {} messages, {} arrived, {duplicates} duplicates ({:.1} %){}",
            ids.len(),
            ids.len() - missing,
            100.0 * duplicates as f64 / ids.len().max(1) as f64,
            if shape.is_empty() {
                String::new()
            } else {
                format!(": {shape}")
            }
        );
    }
    outln!(
        "  the producer took {:.1} s for the planned {} s (a longer time stretches the stall too)",
        took.as_secs_f64(),
        (steady + stall + steady).as_secs()
    );
    let attempts = sql
        .query(
            "SELECT state::text, count(*), max(attempt_no) FROM outbox.attempts GROUP BY 1 ORDER BY 1",
            &[],
        )
        .await?;
    outln!(
        "  attempts recorded: {}; dead letters: {dead}",
        attempts
            .iter()
            .map(|r| format!(
                "{} {} (up to attempt {})",
                r.get::<_, String>(0),
                r.get::<_, i64>(1),
                r.get::<_, i32>(2)
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// The ids enqueued in each phase.
struct Produced {
    before: Vec<Uuid>,
    during: Vec<Uuid>,
    after: Vec<Uuid>,
}

/// Enqueues at `--stall-rate` per second (one transaction each) for the three phases,
/// stalling the receiver for the middle one: `steady` before it, so that the relayer runs
/// at its usual pace when it begins, and `steady` after it, whose messages show whether
/// duplicates go on once the destination answers again.
#[allow(clippy::cast_precision_loss)]
async fn produce(
    url: &str,
    o: &Options,
    receiver: &Receiver,
    steady: Duration,
    stall: Duration,
) -> Result<Produced> {
    let c = connect(url).await?;
    let stmt = c
        .prepare(
            "SELECT outbox.enqueue('stall', convert_to(json_build_object('pad', repeat('x', 240))::text, 'UTF8'), \
             NULL, '{}', NULL, NULL, 100, 'application/json')",
        )
        .await?;
    let interval = Duration::from_secs_f64(1.0 / o.stall_rate.max(1) as f64);
    let mut produced = Produced {
        before: Vec::new(),
        during: Vec::new(),
        after: Vec::new(),
    };
    let started = tokio::time::Instant::now();
    let end = steady + stall + steady;
    let mut i = 0u32;
    loop {
        let at = interval * i;
        if at >= end {
            break;
        }
        tokio::time::sleep_until(started + at).await;
        let phase = if at < steady {
            &mut produced.before
        } else if at < steady + stall {
            receiver
                .stalled
                .send_if_modified(|s| !std::mem::replace(s, true));
            &mut produced.during
        } else {
            receiver
                .stalled
                .send_if_modified(|s| std::mem::replace(s, false));
            &mut produced.after
        };
        let id: Uuid = c.query_one(&stmt, &[]).await?.get(0);
        phase.push(id);
        if i.is_multiple_of(100) {
            progress(&format!("stall: {} s of {} s", at.as_secs(), end.as_secs()));
        }
        i += 1;
    }
    receiver.stalled.send_replace(false);
    Ok(produced)
}

/// `--workers` relays delivering to the receiver at `hooks` with the stall's timeout.
fn start_relays(
    url: &str,
    o: &Options,
    hooks: &str,
    shutdown: &CancellationToken,
) -> Result<Vec<tokio::task::JoinHandle<outbox_relay::relay::Summary>>> {
    let deadline = Duration::from_millis(o.stall_timeout_ms);
    let config: DestinationConfig =
        toml::from_str(&format!("type = \"http\"\nurl = \"{hooks}\"\n"))
            .context("the stall's HTTP destination")?;
    let mut relays = Vec::new();
    for w in 0..o.workers {
        let settings = Settings::from_raw(RawConfig {
            database_url: Some(url.to_owned()),
            worker_id: Some(format!("stall-{w}")),
            batch_size: Some(i64::from(o.batch_size)),
            max_batches_in_flight: Some(i64::from(o.in_flight)),
            pool_size: Some(i64::from(o.in_flight.max(2)) + 2),
            ..RawConfig::default()
        })?;
        let store = Store::connect(url, settings.pool_size)?;
        let dispatcher = Dispatcher::single(
            "stall",
            config.build("stall", deadline)?,
            settings.dispatch.circuit,
            deadline,
            settings.relay.max_batches_in_flight,
        );
        let relay = Relay::new(settings.relay, store, Arc::new(dispatcher));
        relays.push(tokio::spawn(relay.run(shutdown.clone())));
    }
    Ok(relays)
}

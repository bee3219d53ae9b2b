//! The operator's run of a short connection budget: `examples/sources-discover.toml` run as
//! it documents itself, by 3 processes, against one server holding 20 outbox databases of
//! 300 messages each (every tenth keyed), with `OUTBOX_MAX_CONNECTIONS_PER_SERVER` set and
//! one process killed with SIGKILL 3 s in. Every message is delivered; the longest time a
//! message waited, from the fleet's start to its first attempt, is printed and stays
//! within the bound docs/sources.md states (the turns' bound with a start's joining time
//! and a kill's lapse); the relayers' sessions, sampled from `pg_stat_activity` every
//! second, never exceed the budget; and once delivered, each idle source holds what the
//! docs say (its `LISTEN` session and at most one other when served).
//!
//! The example serves every outbox database of its server, so the run has a throwaway
//! cluster of its own. `make chaos` runs it (scenario `fleet-acceptance`) with budgets of
//! 40 and 60.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use crate::common::cluster::Cluster;
use crate::common::{TestDb, connect, free_port};
use crate::fleet_turns::delivered;
use outbox_relay::store::with_database;
use uuid::Uuid;

const SOURCES: usize = 20;
const MESSAGES: i64 = 300;
/// The example's discovery interval and the defaults of the slot lease and the pool.
const INTERVAL: Duration = Duration::from_secs(10);
const LEASE: Duration = Duration::from_secs(15);
const POOL: i64 = 3;

/// One run with `budget` as `OUTBOX_MAX_CONNECTIONS_PER_SERVER`; Ok: its figures.
pub async fn run(budget: i64) -> Result<String, String> {
    let cluster = Cluster::start(&[("max_connections", "200")]);
    let db = TestDb::new_in(&cluster).await;
    // The run's own database is not a source.
    db.client()
        .await
        .batch_execute("DROP SCHEMA outbox CASCADE")
        .await
        .map_err(|e| e.to_string())?;
    let template = db.migrated_template().await;
    let mut ids: BTreeMap<String, Vec<Uuid>> = BTreeMap::new();
    for i in 0..SOURCES {
        let name = db.sibling_from(&format!("s{i}"), &template).await;
        let c = connect(&with_database(&db.base, &name))
            .await
            .map_err(|e| e.to_string())?;
        let filled = outbox_relay::store::fill_messages_returning_ids(
            &c,
            "orders",
            MESSAGES,
            Some(10),
            10,
            0,
        )
        .await
        .map_err(|e| e.to_string())?;
        ids.insert(name, filled);
    }
    // Nobody connects to the template: discovery does not list it.
    let admin = connect(&db.base).await.map_err(|e| e.to_string())?;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {template} ALLOW_CONNECTIONS false"
        ))
        .await
        .map_err(|e| e.to_string())?;

    // Every session of the relayers on the server, every second.
    let most = Arc::new(AtomicI64::new(0));
    let samples = Arc::new(AtomicI64::new(0));
    let sampler = {
        let (most, samples) = (most.clone(), samples.clone());
        let admin = connect(&db.base).await.map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            loop {
                if let Ok(row) = admin
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity \
                          WHERE application_name LIKE 'outbox-relay%'",
                        &[],
                    )
                    .await
                {
                    most.fetch_max(row.get(0), Ordering::Relaxed);
                    samples.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };

    let file = db.scratch_dir().join("acceptance.jsonl");
    let start: f64 = admin
        .query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[])
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    let started = Instant::now();
    let mut workers: Vec<std::process::Child> =
        (0..3).map(|i| example(&db, i, &file, budget)).collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    workers[0].kill().map_err(|e| e.to_string())?;
    let _ = workers[0].wait();

    let joining = INTERVAL * 11 / 10 + LEASE / 3 + Duration::from_secs(2);
    let bound = joining + turns_bound(budget) + INTERVAL * 2 + LEASE;
    let all: HashSet<Uuid> = ids.values().flatten().copied().collect();
    let delivered_in = loop {
        if delivered(&file).is_superset(&all) {
            break Ok(started.elapsed());
        }
        if started.elapsed() > bound + Duration::from_secs(60) {
            let got = delivered(&file);
            break Err(format!(
                "{} of {} messages delivered {:.0} s after the start",
                all.iter().filter(|id| got.contains(id)).count(),
                all.len(),
                started.elapsed().as_secs_f64()
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };

    // Idle: a source's observation, up to I old, may still show the ready messages of a
    // source just drained, which is then queued and taken in turn and found empty; once
    // every observation is newer than the drain, the sources served keep still, and their
    // pools' connections idle for L/3 are closed at their next renewal (every L/3).
    tokio::time::sleep(INTERVAL + LEASE * 2 / 3 + Duration::from_secs(2)).await;
    // Per source: the fewest and the most sessions of a serving process (its pool and
    // LISTEN, `outbox-relay`) over five samples a second apart, the most poll sessions of
    // the others (`outbox-relay standby` kept, or `outbox-relay poll`), and whether it is
    // served.
    let mut idle: BTreeMap<String, Idle> = ids
        .keys()
        .map(|name| (name.clone(), Idle::default()))
        .collect();
    for _ in 0..5 {
        let rows = admin
            .query(
                "SELECT datname::text, \
                        count(*) FILTER (WHERE application_name = 'outbox-relay'), \
                        count(*) FILTER (WHERE application_name <> 'outbox-relay') \
                   FROM pg_stat_activity \
                  WHERE application_name LIKE 'outbox-relay%' AND datname IS NOT NULL \
                  GROUP BY datname",
                &[],
            )
            .await
            .map_err(|e| e.to_string())?;
        let mut seen: BTreeMap<String, (i64, i64)> = BTreeMap::new();
        for row in rows {
            seen.insert(row.get(0), (row.get(1), row.get(2)));
        }
        for (name, e) in &mut idle {
            let (serving, polls) = seen.get(name).copied().unwrap_or((0, 0));
            e.fewest = if e.samples == 0 {
                serving
            } else {
                e.fewest.min(serving)
            };
            e.most = e.most.max(serving);
            e.polls = e.polls.max(polls);
            e.samples += 1;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    for (name, e) in &mut idle {
        let c = connect(&with_database(&db.base, name))
            .await
            .map_err(|e| e.to_string())?;
        e.served = c
            .query_one("SELECT count(*) FROM outbox.source_holders", &[])
            .await
            .map_err(|e| e.to_string())?
            .get::<_, i64>(0)
            > 0;
    }
    // What each session of the served sources last ran, and when.
    let sessions: Vec<String> = admin
        .query(
            "SELECT format('%s: %s ago, %s ago: %s', datname, \
                    date_trunc('second', clock_timestamp() - backend_start), \
                    date_trunc('second', clock_timestamp() - state_change), \
                    left(query, 70)) \
               FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
              ORDER BY datname",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?
        .iter()
        .map(|r| r.get(0))
        .collect();
    sampler.abort();

    // The longest a message waited for its source to be served: from the start (every
    // message was in before it) to its first attempt.
    let mut longest = 0f64;
    let mut longest_source = String::new();
    for name in ids.keys() {
        let c = connect(&with_database(&db.base, name))
            .await
            .map_err(|e| e.to_string())?;
        let first: f64 = c
            .query_one(
                "SELECT coalesce(max(extract(epoch FROM created_at)), 0)::float8 \
                   FROM outbox.attempts WHERE attempt_no = 1",
                &[],
            )
            .await
            .map_err(|e| e.to_string())?
            .get(0);
        if first - start > longest {
            longest = first - start;
            longest_source.clone_from(name);
        }
    }
    for w in &mut workers[1..] {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &w.id().to_string()])
            .status();
    }
    for w in &mut workers[1..] {
        let _ = w.wait();
    }
    let delivered_in = delivered_in?;
    let most = most.load(Ordering::Relaxed);
    let samples = samples.load(Ordering::Relaxed);
    let served: Vec<&Idle> = idle.values().filter(|e| e.served).collect();
    let unserved: Vec<&Idle> = idle.values().filter(|e| !e.served).collect();
    let figures = format!(
        "budget {budget}: {} messages in {SOURCES} sources delivered {:.1} s after the start; \
         longest wait {longest:.1} s ({longest_source}), bound {:.0} s; relayers' sessions at \
         most {most} ({samples} samples); idle: {} served sources holding at most {} sessions \
         of their process ({} in every sample), {} unserved holding none of a serving process \
         and at most {} poll sessions, as served ones at most {}",
        all.len(),
        delivered_in.as_secs_f64(),
        bound.as_secs_f64(),
        served.len(),
        served.iter().map(|e| e.most).max().unwrap_or(0),
        served.iter().map(|e| e.fewest).max().unwrap_or(0),
        unserved.len(),
        unserved.iter().map(|e| e.polls).max().unwrap_or(0),
        served.iter().map(|e| e.polls).max().unwrap_or(0),
    );
    println!("fleet-acceptance {figures}");
    if most > budget {
        return Err(format!("sessions above the budget: {figures}"));
    }
    if longest > bound.as_secs_f64() {
        return Err(format!("a message waited past the bound: {figures}"));
    }
    if served.iter().any(|e| e.fewest > 2) {
        return Err(format!(
            "an idle served source held more than its LISTEN session and one other: {figures}; \
             sessions:\n{}",
            sessions.join("\n")
        ));
    }
    // A poll session at most of each live process that does not serve it.
    if idle.values().any(|e| e.polls > 2) || unserved.iter().any(|e| e.most > 0) {
        return Err(format!(
            "an idle source held more than a poll session of each other process: {figures}"
        ));
    }
    db.finish().await;
    drop(cluster);
    Ok(figures)
}

/// What one source held once idle (see its sampling in [`run`]).
#[derive(Default)]
struct Idle {
    samples: usize,
    fewest: i64,
    most: i64,
    polls: i64,
    served: bool,
}

/// The turns' bound (docs/sources.md) for the worst room of the run: two processes serve
/// while the killed one still counts, each with its part of a budget divided by three.
fn turns_bound(budget: i64) -> Duration {
    let room = (budget / 3 - 1) / (POOL + 1);
    let at_once = usize::try_from(room * 2).unwrap_or(0).max(1);
    let rounds = u32::try_from(SOURCES.saturating_sub(at_once).div_ceil(at_once)).unwrap();
    INTERVAL * 3 + LEASE / 3 + (LEASE * 2 + LEASE / 3 + INTERVAL * 2) * rounds
}

/// A process of the example as documented: its two variables, and the budget.
fn example(db: &TestDb, i: usize, file: &Path, budget: i64) -> std::process::Child {
    let log = db.scratch_dir().join(format!("acceptance-{i}.log"));
    std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["run", "--config"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/sources-discover.toml"))
        .args(["--worker-id", &format!("a{i}"), "--telemetry-addr"])
        .arg(format!("127.0.0.1:{}", free_port()))
        .env("OUTBOX_SOURCES_SERVER_URL", &db.base)
        .env("OUTBOX_SINK_FILE", file)
        .env("OUTBOX_MAX_CONNECTIONS_PER_SERVER", budget.to_string())
        .env("RUST_LOG", "info")
        .stderr(std::fs::File::create(&log).expect("the log file"))
        .spawn()
        .expect("start the example")
}

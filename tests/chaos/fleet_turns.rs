//! A fleet on a connection budget too short for its sources, under faults: 50 databases on
//! one server, 3 processes, `max_connections_per_server` below sources × (pool + 1), messages
//! arriving in every source over time, one process killed with SIGKILL and another started,
//! a source dropped and one added. Every message is delivered, the longest a message
//! waited from its enqueue to its delivery is printed and stays within the bound the
//! turns promise (docs/sources.md), and the relayers' sessions, sampled from
//! `pg_stat_activity` every second, never exceed the budget.
//!
//! Run by `make chaos` (scenario `fleet-turns`) and by `make test` (tests/sources, smaller).

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use crate::common::{Relayer, TestDb, connect};
use outbox_relay::store::with_database;
use uuid::Uuid;

/// The sizes of one run.
#[derive(Clone, Copy, Debug)]
pub struct Turns {
    /// Databases at the start (one more is added, one dropped).
    pub sources: usize,
    /// How long messages keep arriving, one wave a second in every source.
    pub arriving: Duration,
    /// Messages per source and wave (every tenth keyed).
    pub per_wave: i64,
    /// `max_connections_per_server`.
    pub budget: i64,
}

/// The slot lease and discovery interval of the run, in seconds.
const LEASE: u64 = 3;
const INTERVAL: u64 = 1;
/// `--source-pool-size`: a served source holds 3 sessions with its LISTEN.
const POOL: i64 = 2;

struct Source {
    name: String,
    url: String,
    ids: Vec<Uuid>,
}

async fn add_source(db: &TestDb, template: &str, name: &str) -> Source {
    let database = db.sibling_from(name, template).await;
    let url = with_database(&db.base, &database);
    db.client()
        .await
        .execute(
            "INSERT INTO public.sources (name, url) VALUES ($1, $2)",
            &[&database, &url],
        )
        .await
        .unwrap();
    Source {
        name: database,
        url,
        ids: Vec::new(),
    }
}

fn worker(db: &TestDb, name: &str, file: &Path, budget: &str) -> Relayer {
    let file = file.display().to_string();
    Relayer::start(
        db,
        name,
        &[
            "--sink",
            "file",
            "--sink-file",
            &file,
            "--sink-file-fsync",
            "false",
            "--no-telemetry",
            "--sources-catalogue-url",
            &db.url,
            "--sources-catalogue-query",
            "SELECT name, url FROM public.sources",
            "--sources-discover-interval-secs",
            &INTERVAL.to_string(),
            "--source-lease-secs",
            &LEASE.to_string(),
            "--source-pool-size",
            &POOL.to_string(),
            "--max-connections-per-server",
            budget,
            "--batch-size",
            "50",
        ],
    )
}

/// The ids in a sink file (the file destination's JSON lines).
pub fn delivered(file: &Path) -> HashSet<Uuid> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["outbox_id"].as_str()?.parse().ok())
        .collect()
}

/// Runs the scenario on `db`'s server; Ok: its figures in one line. The bound is
/// `Share::wait_bound`'s for the worst room of the run (two live processes while the
/// killed one still counts), with the fleet's joining time and a kill's lapse.
pub async fn run(db: &TestDb, turns: Turns) -> Result<String, String> {
    let c = db.client().await;
    c.batch_execute("CREATE TABLE public.sources (name text PRIMARY KEY, url text NOT NULL)")
        .await
        .unwrap();
    let template = db.migrated_template().await;
    let mut sources = Vec::new();
    for i in 0..turns.sources {
        sources.push(add_source(db, &template, &format!("t{i}")).await);
    }

    // Every session of the relayers on this test's databases, every second.
    let most = Arc::new(AtomicI64::new(0));
    let samples = Arc::new(AtomicI64::new(0));
    let sampler = {
        let (most, samples) = (most.clone(), samples.clone());
        let pattern = format!("{}%", db.name.replace('_', "\\_"));
        let admin = connect(&db.base).await.unwrap();
        tokio::spawn(async move {
            loop {
                if let Ok(row) = admin
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity \
                          WHERE application_name LIKE 'outbox-relay%' AND datname::text LIKE $1",
                        &[&pattern],
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

    let file = db.scratch_dir().join("turns.jsonl");
    let budget = turns.budget.to_string();
    let mut workers: Vec<Relayer> = (0..3)
        .map(|i| worker(db, &format!("w{i}"), &file, &budget))
        .collect();

    // Messages arrive in every source, a wave a second; the faults come meanwhile.
    let started = Instant::now();
    let mut wave = 0u64;
    let mut killed = false;
    let mut restarted = false;
    let mut dropped: Option<Source> = None;
    let mut added = false;
    while started.elapsed() < turns.arriving {
        for s in &mut sources {
            let sc = connect(&s.url)
                .await
                .map_err(|e| format!("{}: {e}", s.name))?;
            let ids = outbox_relay::store::fill_messages_returning_ids(
                &sc,
                "orders",
                turns.per_wave,
                Some(10),
                10,
                0,
            )
            .await
            .map_err(|e| e.to_string())?;
            s.ids.extend(ids);
        }
        wave += 1;
        let t = started.elapsed();
        if !killed && t > Duration::from_secs(3) {
            workers[0].signal("KILL");
            killed = true;
        }
        if !restarted && t > Duration::from_secs(15) {
            workers.push(worker(db, "w3", &file, &budget));
            restarted = true;
        }
        if dropped.is_none() && t > Duration::from_secs(10) {
            // Dropped: out of the catalogue, then the database itself.
            let gone = sources.remove(1);
            c.execute("DELETE FROM public.sources WHERE name = $1", &[&gone.name])
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_secs(INTERVAL * 2)).await;
            connect(&db.base)
                .await
                .unwrap()
                .batch_execute(&format!("DROP DATABASE {} WITH (FORCE)", gone.name))
                .await
                .unwrap();
            dropped = Some(gone);
        }
        if !added && t > Duration::from_secs(12) {
            sources.push(add_source(db, &template, "t_added").await);
            added = true;
        }
        tokio::time::sleep(
            Duration::from_secs(1)
                .saturating_sub(started.elapsed().saturating_sub(Duration::from_secs(wave))),
        )
        .await;
    }
    let arrived = started.elapsed();
    let total: usize = sources.iter().map(|s| s.ids.len()).sum();
    let limit = Duration::from_secs(240);
    let all_in = loop {
        let got = delivered(&file);
        if sources
            .iter()
            .all(|s| s.ids.iter().all(|id| got.contains(id)))
        {
            break Ok(started.elapsed());
        }
        if started.elapsed() > arrived + limit {
            let missing: Vec<String> = sources
                .iter()
                .map(|s| (s, s.ids.iter().filter(|id| !got.contains(id)).count()))
                .filter(|(_, n)| *n > 0)
                .map(|(s, n)| format!("{}: {n}", s.name))
                .collect();
            break Err(format!(
                "not delivered {limit:?} after the last wave: {}",
                missing.join(", ")
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    sampler.abort();
    let most = most.load(Ordering::Relaxed);
    let samples = samples.load(Ordering::Relaxed);

    // The longest a message waited, enqueue (its UUIDv7's time) to its first attempt.
    let mut longest = 0f64;
    let mut longest_source = String::new();
    for s in &sources {
        let sc = connect(&s.url).await.map_err(|e| e.to_string())?;
        let row = sc
            .query_one(
                "SELECT coalesce(max(extract(epoch FROM a.created_at) - \
                        ('x' || substr(replace(a.outbox_id::text, '-', ''), 1, 12))::bit(48)::bigint \
                        / 1000.0), 0)::float8 \
                   FROM outbox.attempts AS a WHERE a.attempt_no = 1",
                &[],
            )
            .await
            .map_err(|e| e.to_string())?;
        let waited: f64 = row.get(0);
        if waited > longest {
            longest = waited;
            longest_source.clone_from(&s.name);
        }
    }
    for w in &mut workers[1..] {
        w.signal("TERM");
    }
    for w in &mut workers[1..] {
        w.exit_code(Duration::from_secs(30)).await;
    }
    let all_in = all_in?;
    // The worst: two processes (the killed one's membership not lapsed yet counts three for
    // the room, two serve).
    let sources_n = turns.sources + 1;
    let room = |p: i64| ((turns.budget / p - 1) / (POOL + 1)) * 2;
    let at_once = usize::try_from(room(3)).unwrap_or(0).max(1);
    let rounds = u32::try_from(sources_n.saturating_sub(at_once).div_ceil(at_once)).unwrap();
    let (i, l) = (Duration::from_secs(INTERVAL), Duration::from_secs(LEASE));
    // The fleet starts, joining (1.1 I + L/3 + 2 s), and one process is killed (2I + L).
    let joining = i * 11 / 10 + l / 3 + Duration::from_secs(2);
    let bound = joining + i * 3 + l / 3 + (l * 2 + l / 3 + i * 2) * rounds + i * 2 + l;
    let figures = format!(
        "{total} messages in {} sources delivered {:.1} s after the start ({wave} waves); \
         longest wait {longest:.1} s ({longest_source}), bound {:.0} s; relayers' sessions at \
         most {most} of a budget of {} ({samples} samples)",
        sources.len(),
        all_in.as_secs_f64(),
        bound.as_secs_f64(),
        turns.budget
    );
    if most > turns.budget {
        return Err(format!("sessions above the budget: {figures}"));
    }
    if samples < 10 {
        return Err(format!("too few samples: {figures}"));
    }
    if longest > bound.as_secs_f64() {
        return Err(format!("a message waited past the bound: {figures}"));
    }
    Ok(figures)
}

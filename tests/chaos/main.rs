//! `make chaos`: the relayer's fault-injection suite. Real processes of the built binary,
//! real kills, freezes and outages, against the throwaway Postgres that `scripts/chaos.sh`
//! starts (so that it may restart it) and a real HTTP server. Each scenario prints one line
//! of figures and fails when a guarantee breaks; the process exits non-zero if any did.
//!
//!   chaos [--short] [--only NAME,NAME] [--messages N] [--outage-secs S] [--horizon-secs S]
//!         [--hostile N] [--previous REF]
//!
//! Scenarios: kill-storm, pg-restart, freeze, slow-freeze, destination-outage, poison,
//! big-payloads, hot-key, horizon, hostile, fleet-turns (tests/chaos/fleet_turns.rs),
//! fleet-acceptance (tests/chaos/fleet_acceptance.rs, on a throwaway cluster of its own),
//! rolling-upgrade (`--previous REF`: the build upgraded from; see
//! tests/chaos/rolling_upgrade.rs). `--short` is the CI size (kill-storm, freeze,
//! slow-freeze, horizon with a 180 s hold, hostile and fleet-turns only, small sizes):
//! rolling-upgrade is left out of it because its first run builds a previous release from
//! source.
//! Not part of `make test` (`test = false` in Cargo.toml).

#[path = "../common/mod.rs"]
mod common;
mod fleet_acceptance;
mod fleet_turns;
mod hook;
mod rolling_upgrade;
mod slow_freeze;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Relayer, TestDb, connect, fill, pending};
use tokio_postgres::Client;
use uuid::Uuid;

type Outcome = Result<String, String>;

#[derive(Clone, Debug)]
struct Sizes {
    messages: i64,
    kills: usize,
    outage: Duration,
    horizon: Duration,
    hostile: usize,
    window: Duration,
    /// The commit rolling-upgrade upgrades from (`--previous`); `None`: its default.
    previous: Option<String>,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| -> Option<String> {
        args.iter()
            .position(|a| a == name)
            .map(|i| args.get(i + 1).cloned().unwrap_or_default())
    };
    let short = args.iter().any(|a| a == "--short");
    let mut sizes = if short {
        Sizes {
            messages: 10_000,
            kills: 4,
            outage: Duration::from_secs(10),
            // Three minutes: the ring of slots goes round six times under the hold, which
            // the bounds below need (before the slots, a 600 s hold reached 12-150 × the
            // claim's time). `make chaos` holds it 600 s.
            horizon: Duration::from_secs(180),
            hostile: 1_000,
            window: Duration::from_secs(10),
            previous: None,
        }
    } else {
        Sizes {
            messages: 100_000,
            kills: 20,
            outage: Duration::from_secs(60),
            horizon: Duration::from_secs(600),
            hostile: 10_000,
            window: Duration::from_secs(30),
            previous: None,
        }
    };
    let number = |name: &str| flag(name).map(|v| v.parse::<u64>().expect(name));
    if let Some(n) = number("--messages") {
        sizes.messages = i64::try_from(n).expect("--messages");
    }
    if let Some(s) = number("--outage-secs") {
        sizes.outage = Duration::from_secs(s);
    }
    if let Some(s) = number("--horizon-secs") {
        sizes.horizon = Duration::from_secs(s);
    }
    if let Some(n) = number("--hostile") {
        sizes.hostile = usize::try_from(n).expect("--hostile");
    }
    sizes.previous = flag("--previous");
    let all = [
        "kill-storm",
        "pg-restart",
        "freeze",
        "slow-freeze",
        "destination-outage",
        "poison",
        "big-payloads",
        "hot-key",
        "horizon",
        "hostile",
        "fleet-turns",
        "fleet-acceptance",
        "rolling-upgrade",
    ];
    let chosen: Vec<String> = match flag("--only") {
        Some(list) => list.split(',').map(str::to_owned).collect(),
        None if short => vec![
            "kill-storm".into(),
            "freeze".into(),
            "slow-freeze".into(),
            "horizon".into(),
            "hostile".into(),
            "fleet-turns".into(),
        ],
        None => all.iter().map(|s| (*s).to_owned()).collect(),
    };
    for name in &chosen {
        assert!(
            all.contains(&name.as_str()),
            "unknown scenario {name}; known: {all:?}"
        );
    }

    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let mut failed = 0;
    for name in chosen {
        let started = Instant::now();
        let result = runtime.block_on(run(&name, &sizes));
        let secs = started.elapsed().as_secs_f64();
        match result {
            Ok(figures) => println!("chaos {name}: ok in {secs:.1} s: {figures}"),
            Err(broken) => {
                failed += 1;
                println!("chaos {name}: FAILED in {secs:.1} s: {broken}");
            }
        }
    }
    std::process::exit(i32::from(failed > 0));
}

async fn run(name: &str, sizes: &Sizes) -> Outcome {
    match name {
        "kill-storm" => kill_storm(sizes).await,
        "pg-restart" => pg_restart(sizes).await,
        "freeze" => freeze(sizes).await,
        "slow-freeze" => slow_freeze::slow_freeze(sizes).await,
        "destination-outage" => destination_outage(sizes).await,
        "poison" => poison().await,
        "big-payloads" => big_payloads(sizes).await,
        "hot-key" => hot_key(sizes).await,
        "horizon" => horizon(sizes).await,
        "hostile" => hostile(sizes).await,
        "fleet-turns" => fleet_turns(sizes).await,
        "fleet-acceptance" => fleet_acceptance().await,
        "rolling-upgrade" => rolling_upgrade::rolling_upgrade(sizes).await,
        _ => unreachable!(),
    }
}

/// 50 sources on a budget of 45 (room for 12 at once), messages arriving for a minute
/// (`--short`: 20 s), a kill, a start, a source dropped and one added.
async fn fleet_turns(sizes: &Sizes) -> Outcome {
    let db = TestDb::new().await;
    let arriving = if sizes.kills < 10 { 20 } else { 60 };
    let result = fleet_turns::run(
        &db,
        fleet_turns::Turns {
            sources: 50,
            arriving: Duration::from_secs(arriving),
            per_wave: 10,
            budget: 45,
        },
    )
    .await;
    if result.is_ok() {
        db.finish().await;
    }
    result
}

/// `examples/sources-discover.toml` by 3 processes over 20 databases of 300 messages, one
/// killed: with a budget of 40, then of 60.
async fn fleet_acceptance() -> Outcome {
    let mut figures = Vec::new();
    for budget in [40, 60] {
        figures.push(fleet_acceptance::run(budget).await?);
    }
    Ok(figures.join("; "))
}

/// Fails the scenario with `why` unless `ok`.
fn check(ok: bool, why: impl FnOnce() -> String) -> Result<(), String> {
    if ok { Ok(()) } else { Err(why()) }
}

async fn wait_for(
    limit: Duration,
    what: &str,
    mut done: impl AsyncFnMut() -> bool,
) -> Result<Duration, String> {
    let started = Instant::now();
    while !done().await {
        if started.elapsed() > limit {
            return Err(format!("timed out after {limit:?} waiting for {what}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(started.elapsed())
}

/// A worker appending to the shared `file` (one `write` per batch with O_APPEND, so the
/// file is one timeline across processes).
fn file_worker(db: &TestDb, name: &str, file: &Path, extra: &[&str]) -> Relayer {
    let file = file.display().to_string();
    let mut args = vec![
        "--sink",
        "file",
        "--sink-file",
        &file,
        "--sink-file-fsync",
        "false",
        "--no-telemetry",
        "--repair-interval-secs",
        "1",
    ];
    args.extend_from_slice(extra);
    Relayer::start(db, name, &args)
}

/// Enqueue order and key of every pending message (taken before relaying starts).
async fn order_of(c: &Client) -> HashMap<Uuid, (i64, Option<String>)> {
    c.query(
        "SELECT outbox_id, seq, message_key FROM outbox.messages",
        &[],
    )
    .await
    .expect("read messages")
    .iter()
    .map(|r| (r.get(0), (r.get(1), r.get(2))))
    .collect()
}

/// The ids in the shared file, in the order written.
fn written(file: &Path) -> Vec<Uuid> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            v["outbox_id"]
                .as_str()
                .expect("outbox_id")
                .parse()
                .expect("a uuid")
        })
        .collect()
}

/// What the timeline in `file` shows against the enqueue order.
struct Audit {
    lost: usize,
    duplicates: usize,
    /// A message written for the first time after a later message of its key had been
    /// written: per-key first-delivery order is the guarantee.
    order_violations: usize,
    /// A message written again after a later message of its key: the redelivery of a run
    /// from its head after its holder was killed, which the guarantees allow (consumers
    /// drop it by `outbox_id` or by the per-key `seq`).
    rewinds: usize,
}

async fn audit(c: &Client, file: &Path, order: &HashMap<Uuid, (i64, Option<String>)>) -> Audit {
    let lines = written(file);
    let seen: HashSet<Uuid> = lines.iter().copied().collect();
    let dead: HashSet<Uuid> = common::dead_letters(c)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let lost = order
        .keys()
        .filter(|id| !seen.contains(id) && !dead.contains(id))
        .count();
    let mut newest: HashMap<&str, i64> = HashMap::new();
    let mut delivered: HashSet<Uuid> = HashSet::new();
    let (mut order_violations, mut rewinds) = (0, 0);
    for id in &lines {
        let first = delivered.insert(*id);
        if let Some((seq, Some(key))) = order.get(id) {
            let top = newest.entry(key.as_str()).or_insert(*seq);
            if *seq < *top {
                if first {
                    order_violations += 1;
                } else {
                    rewinds += 1;
                }
            }
            *top = (*top).max(*seq);
        }
    }
    Audit {
        lost,
        duplicates: lines.len() - seen.len(),
        order_violations,
        rewinds,
    }
}

/// Messages whose attempt numbers are not 1, 2, 3 … without a gap.
async fn broken_histories(c: &Client) -> i64 {
    broken_histories_in(c, "outbox.attempts").await
}

/// [`broken_histories`] in `log`, a table with the attempt log's outbox_id and attempt_no.
async fn broken_histories_in(c: &Client, log: &str) -> i64 {
    c.query_one(
        &format!(
            "SELECT count(*) FROM (SELECT min(attempt_no) AS lo, max(attempt_no) AS hi, count(*) AS n \
             FROM {log} GROUP BY outbox_id) AS h WHERE lo <> 1 OR hi <> n"
        ),
        &[],
    )
    .await
    .expect("histories")
    .get(0)
}

fn guarantees(a: &Audit, broken: i64) -> Result<(), String> {
    check(a.lost == 0, || format!("{} messages lost", a.lost))?;
    check(a.order_violations == 0, || {
        format!(
            "{} first deliveries after a later message of their key",
            a.order_violations
        )
    })?;
    check(broken == 0, || {
        format!("{broken} attempt histories with gaps")
    })
}

async fn kill_storm(sizes: &Sizes) -> Outcome {
    let db = TestDb::new().await;
    let c = db.client().await;
    fill(&c, "storm", sizes.messages, Some(10)).await;
    let order = order_of(&c).await;
    let file = db.scratch_dir().join("storm.jsonl");
    let started = Instant::now();
    let mut workers: Vec<Relayer> = (0..4)
        .map(|i| file_worker(&db, &format!("storm-{i}-0"), &file, &["--lease-secs", "5"]))
        .collect();
    let mut kills = 0;
    while kills < sizes.kills {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let victim = rand::random_range(0..workers.len());
        workers[victim].signal("KILL");
        kills += 1;
        workers[victim] = file_worker(
            &db,
            &format!("storm-{victim}-{kills}"),
            &file,
            &["--lease-secs", "5"],
        );
    }
    wait_for(
        Duration::from_secs(600),
        "the storm backlog to drain",
        async || pending(&c).await == 0,
    )
    .await?;
    let took = started.elapsed();
    let a = audit(&c, &file, &order).await;
    let broken = broken_histories(&c).await;
    // A duplicate is only allowed for a message whose lease a killed worker held.
    let unexplained = unexplained_duplicates(&c, &file, "outbox.attempts").await;
    drop(workers);
    guarantees(&a, broken)?;
    check(unexplained == 0, || {
        format!("{unexplained} duplicates of messages no killed worker held")
    })?;
    db.finish().await;
    Ok(format!(
        "{} messages, 4 processes, {kills} kill -9 with restarts, drained in {:.1} s ({:.0} msg/s); \
         lost 0, duplicates {} (all among killed leases), first deliveries out of key order 0, \
         redeliveries after a later message of their key {} (a run redelivered from its head), \
         gapless histories",
        sizes.messages,
        took.as_secs_f64(),
        sizes.messages as f64 / took.as_secs_f64(),
        a.duplicates,
        a.rewinds
    ))
}

/// `pg_ctl` of the throwaway cluster, from `scripts/chaos.sh`.
fn pg_ctl(action: &[&str]) -> Result<(), String> {
    let command = std::env::var("CHAOS_PG_CTL")
        .map_err(|_| "needs the throwaway cluster of scripts/chaos.sh (CHAOS_PG_CTL is not set); run `make chaos`".to_owned())?;
    let mut words = command.split_whitespace();
    let status = std::process::Command::new(words.next().unwrap_or("pg_ctl"))
        .args(words)
        .args(action)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| format!("{command}: {e}"))?;
    check(status.success(), || format!("{command} {action:?} failed"))
}

async fn pg_restart(sizes: &Sizes) -> Outcome {
    pg_ctl(&["status"])?;
    let db = TestDb::new().await;
    let file = db.scratch_dir().join("restart.jsonl");
    let workers: Vec<Relayer> = (0..2)
        .map(|i| file_worker(&db, &format!("restart-{i}"), &file, &["--lease-secs", "5"]))
        .collect();
    // A producer enqueues steadily through the restarts; only committed rows count.
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (url, stop) = (db.url.clone(), stop.clone());
        let per_tick = (sizes.messages / 500).max(50);
        tokio::spawn(async move {
            let mut sent: Vec<(Uuid, i64, Option<String>)> = Vec::new();
            let mut refused = 0_u64;
            let mut client: Option<Client> = None;
            while !stop.load(Ordering::Relaxed) {
                if client.as_ref().is_none_or(Client::is_closed) {
                    client = connect(&url).await.ok();
                }
                if let Some(c) = &client {
                    match c
                        .query(
                            "INSERT INTO outbox.messages (topic, message_key, payload) \
                             SELECT 'restart', CASE WHEN i % 10 = 0 THEN 'k' || (i % 500) END, \
                                    convert_to(json_build_object('n', i)::text, 'UTF8') \
                             FROM generate_series(1, $1::bigint) AS i RETURNING outbox_id, seq, message_key",
                            &[&per_tick],
                        )
                        .await
                    {
                        Ok(rows) => sent.extend(rows.iter().map(|r| (r.get(0), r.get(1), r.get(2)))),
                        Err(_) => refused += 1,
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (sent, refused)
        })
    };
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(3)).await;
        pg_ctl(&["restart", "-m", "immediate", "-w"])?;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    pg_ctl(&["stop", "-m", "immediate", "-w"])?;
    tokio::time::sleep(sizes.outage.min(Duration::from_secs(30))).await;
    pg_ctl(&["start", "-w"])?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let (sent, refused) = producer.await.map_err(|e| e.to_string())?;
    let c = db.client().await;
    let drained = wait_for(
        Duration::from_secs(600),
        "the backlog to drain after the outage",
        async || pending(&c).await == 0,
    )
    .await?;
    let order: HashMap<Uuid, (i64, Option<String>)> = sent
        .into_iter()
        .map(|(id, seq, key)| (id, (seq, key)))
        .collect();
    let a = audit(&c, &file, &order).await;
    let broken = broken_histories(&c).await;
    drop(workers);
    guarantees(&a, broken)?;
    db.finish().await;
    Ok(format!(
        "{} messages committed by a steady producer ({refused} enqueue calls failed during the outages), \
         2 processes, 3 immediate restarts and a {} s outage; drained {:.1} s after the database was back; \
         lost 0, duplicates {}, first deliveries out of key order 0, \
         redeliveries after a later message of their key {} (a run redelivered from its head), \
         gapless histories",
        order.len(),
        sizes.outage.min(Duration::from_secs(30)).as_secs(),
        drained.as_secs_f64(),
        a.duplicates,
        a.rewinds
    ))
}

async fn freeze(sizes: &Sizes) -> Outcome {
    let db = TestDb::new().await;
    let c = db.client().await;
    let n = (sizes.messages / 5).max(2_000);
    fill(&c, "freeze", n, Some(1)).await;
    let order = order_of(&c).await;
    let file = db.scratch_dir().join("freeze.jsonl");
    let lease = ["--lease-secs", "2", "--batch-size", "50"];
    let sleeper = file_worker(&db, "sleeper", &file, &lease);
    let steady = file_worker(&db, "steady", &file, &lease);
    let freezes = if sizes.kills > 4 { 3 } else { 2 };
    for _ in 0..freezes {
        tokio::time::sleep(Duration::from_millis(700)).await;
        sleeper.signal("STOP");
        tokio::time::sleep(Duration::from_secs(4)).await;
        sleeper.signal("CONT");
    }
    wait_for(
        Duration::from_secs(600),
        "the freeze backlog to drain",
        async || pending(&c).await == 0,
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let a = audit(&c, &file, &order).await;
    let broken = broken_histories(&c).await;
    let given_back = sleeper
        .log_text()
        .matches("not publishing a batch whose leases may have expired")
        .count();
    drop((sleeper, steady));
    guarantees(&a, broken)?;
    db.finish().await;
    Ok(format!(
        "{n} keyed messages (50 keys), 2 processes, {freezes} SIGSTOP of 4 s past a 2 s lease; \
         stale batches given back on waking {given_back}, first deliveries out of key order 0, lost 0, \
         duplicates {} (written within their lease, completion refused after the freeze)",
        a.duplicates
    ))
}

/// An HTTP destination whose availability the scenario switches.
async fn switchable_hook() -> (String, Arc<AtomicBool>, Arc<std::sync::Mutex<u64>>) {
    let down = Arc::new(AtomicBool::new(false));
    let received = Arc::new(std::sync::Mutex::new(0_u64));
    let (d, r) = (down.clone(), received.clone());
    let app = axum::Router::new().route(
        "/hooks/{topic}",
        axum::routing::post(move || {
            let (d, r) = (d.clone(), r.clone());
            async move {
                if d.load(Ordering::Relaxed) {
                    axum::http::StatusCode::SERVICE_UNAVAILABLE
                } else {
                    *r.lock().unwrap() += 1;
                    axum::http::StatusCode::OK
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!(
        "http://{}/hooks/{{topic}}",
        listener.local_addr().expect("addr")
    );
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    (url, down, received)
}

async fn destination_outage(sizes: &Sizes) -> Outcome {
    let db = TestDb::new().await;
    let c = db.client().await;
    let (url, down, _received) = switchable_hook().await;
    let config = db.scratch_dir().join("outage.toml");
    std::fs::write(
        &config,
        format!("[destinations.hook]\ntype = \"http\"\nurl = \"{url}\"\n\n[[routes]]\ntopic = \"*\"\ndestination = \"hook\"\n"),
    )
    .map_err(|e| e.to_string())?;
    let n = (sizes.messages / 2).max(10_000);
    down.store(true, Ordering::Relaxed);
    let outage_started = Instant::now();
    // Defaults: batch 500, 3 batches in flight, 5 failures to open, 5 s cool-down.
    let w = Relayer::start(
        &db,
        "outage",
        &["--config", &config.display().to_string(), "--no-telemetry"],
    );
    fill(&c, "orders", n, None).await;
    tokio::time::sleep(sizes.outage).await;
    let outage = outage_started.elapsed();
    let r = c
        .query_one(
            "SELECT count(*), coalesce(max(n), 0)::bigint FROM (SELECT outbox_id, count(*) AS n \
             FROM outbox.attempts GROUP BY outbox_id) AS a",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    let attempted_messages: i64 = r.get(0);
    let most: i64 = r.get(1);
    let attempts: i64 = c
        .query_one("SELECT count(*) FROM outbox.attempts", &[])
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    let log = w.log_text();
    let opened = log.matches("circuit open").count();
    let probes = log.matches("circuit half-open").count();
    down.store(false, Ordering::Relaxed);
    let back = Instant::now();
    wait_for(
        Duration::from_secs(600),
        "the backlog to drain after the outage",
        async || pending(&c).await == 0,
    )
    .await?;
    let drained = back.elapsed();
    drop(w);
    let allowed = 5 + i64::try_from(outage.as_secs() / 5 + 1).unwrap_or(i64::MAX);
    check(attempts <= allowed, || {
        format!(
            "{attempts} attempts in a {} s outage; at most {allowed} (5 to open + one per probe)",
            outage.as_secs()
        )
    })?;
    check(most <= 1, || {
        format!("a message got {most} attempts from one outage")
    })?;
    db.finish().await;
    Ok(format!(
        "{n} messages, HTTP destination down {:.0} s (batch 500, 3 in flight, 5 failures to open, 5 s cool-down): \
         {attempts} attempts recorded on {attempted_messages} messages (most per message {most}), circuit opened {opened} times, \
         {probes} half-open probes; drained {:.1} s after it came back",
        outage.as_secs_f64(),
        drained.as_secs_f64()
    ))
}

async fn poison() -> Outcome {
    let db = TestDb::new().await;
    let c = db.client().await;
    // Two kinds of poison at the head of a key: a payload over max_message_bytes, and a
    // payload that claims to be JSON and is not (the file sink refuses it for good).
    c.batch_execute(
        "SELECT outbox.enqueue('poison', decode(repeat('ab', 100000), 'hex'), 'big'); \
         SELECT outbox.enqueue('poison', '\\x7b6e6f74206a736f6e'::bytea, 'broken', p_content_type => 'application/json'); \
         INSERT INTO outbox.messages (topic, message_key, payload) \
         SELECT 'poison', CASE WHEN i % 2 = 0 THEN 'big' ELSE 'broken' END, convert_to(json_build_object('n', i)::text, 'UTF8') \
         FROM generate_series(1, 200) AS i; \
         INSERT INTO outbox.messages (topic, payload) \
         SELECT 'other', convert_to(json_build_object('n', i)::text, 'UTF8') FROM generate_series(1, 2000) AS i;",
    )
    .await
    .map_err(|e| e.to_string())?;
    let order = order_of(&c).await;
    let file = db.scratch_dir().join("poison.jsonl");
    let w = file_worker(&db, "poison", &file, &["--max-message-bytes", "65536"]);
    let took = wait_for(
        Duration::from_secs(120),
        "the keys behind the poison to drain",
        async || pending(&c).await == 0,
    )
    .await?;
    let dead = common::dead_letters(&c).await;
    let a = audit(&c, &file, &order).await;
    drop(w);
    check(dead.len() == 2, || {
        format!("expected the 2 poison messages dead-lettered, got {dead:?}")
    })?;
    check(
        dead.iter().any(|(_, e)| e.contains("max_message_bytes")),
        || format!("no dead letter names max_message_bytes: {dead:?}"),
    )?;
    guarantees(&a, broken_histories(&c).await)?;
    db.finish().await;
    Ok(format!(
        "2 poison heads (200 KB over a 64 KiB limit; invalid JSON) in front of 200 keyed and 2,000 other messages: \
         both dead-lettered with the reason, everything behind them delivered in order in {:.1} s",
        took.as_secs_f64()
    ))
}

/// Peak resident memory of a process (`VmHWM`), in MiB.
fn peak_rss_mib(pid: u32) -> Result<f64, String> {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or("no VmHWM in /proc/PID/status")?;
    Ok(kib / 1024.0)
}

async fn big_payloads(sizes: &Sizes) -> Outcome {
    let db = TestDb::new().await;
    let c = db.client().await;
    let n: i64 = if sizes.kills > 4 { 500 } else { 100 };
    // 5 MiB each (stored compressed; the relayer receives them whole), plus 10 over the
    // 8 MiB limit that must be dead-lettered without being loaded.
    c.execute(
        "INSERT INTO outbox.messages (topic, payload) \
         SELECT 'big', decode(repeat(lpad(to_hex(i), 8, '0'), 5 * 1024 * 1024 / 4), 'hex') \
         FROM generate_series(1, $1::bigint) AS i",
        &[&n],
    )
    .await
    .map_err(|e| e.to_string())?;
    c.execute(
        "INSERT INTO outbox.messages (topic, payload) \
         SELECT 'huge', decode(repeat('ab', 9 * 1024 * 1024), 'hex') FROM generate_series(1, 10)",
        &[],
    )
    .await
    .map_err(|e| e.to_string())?;
    // Defaults otherwise: batch 500, 3 in flight, max_batch_bytes 16 MiB.
    let w = Relayer::start(
        &db,
        "big",
        &[
            "--sink",
            "null",
            "--no-telemetry",
            "--max-message-bytes",
            "8388608",
        ],
    );
    let took = wait_for(
        Duration::from_secs(600),
        "the big payloads to drain",
        async || pending(&c).await == 0,
    )
    .await?;
    let peak = peak_rss_mib(w.pid())?;
    drop(w);
    let dead = common::dead_letters(&c).await;
    check(
        dead.len() == 10 && dead.iter().all(|(_, e)| e.contains("max_message_bytes")),
        || {
            format!(
                "expected the 10 payloads over 8 MiB dead-lettered by size, got {}",
                dead.len()
            )
        },
    )?;
    check(peak < 128.0, || {
        format!("peak RSS {peak:.1} MiB with {n} × 5 MiB payloads; the bound is 128 MiB")
    })?;
    db.finish().await;
    Ok(format!(
        "{n} × 5 MiB payloads + 10 × 9 MiB over an 8 MiB max_message_bytes, 1 process, null destination, \
         batch 500, max_batch_bytes 16 MiB, 3 in flight: drained in {:.1} s ({:.0} MiB/s), peak RSS {peak:.1} MiB, \
         the 10 oversized dead-lettered unloaded",
        took.as_secs_f64(),
        (n * 5) as f64 / took.as_secs_f64()
    ))
}

/// Messages delivered per second by two null-destination processes over `window`.
async fn drain_rate(db: &TestDb, c: &Client, window: Duration, topic: &str) -> f64 {
    let left = async || -> i64 {
        c.query_one(
            "SELECT count(*) FROM outbox.messages WHERE topic = $1",
            &[&topic],
        )
        .await
        .expect("count")
        .get(0)
    };
    let before = left().await;
    let workers: Vec<Relayer> = (0..2)
        .map(|i| {
            Relayer::start(
                db,
                &format!("{topic}-{i}"),
                &["--sink", "null", "--no-telemetry"],
            )
        })
        .collect();
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let after = left().await;
    let secs = started.elapsed().as_secs_f64();
    drop(workers);
    (before - after) as f64 / secs
}

async fn hot_key(sizes: &Sizes) -> Outcome {
    let n = (sizes.messages / 2).max(5_000);
    // Baseline: the same number of unkeyed messages alone.
    let base = TestDb::new().await;
    let bc = base.client().await;
    fill(&bc, "plain", 2 * n, None).await;
    let baseline = drain_rate(&base, &bc, sizes.window, "plain").await;
    base.finish().await;

    let db = TestDb::new().await;
    let c = db.client().await;
    c.execute(
        "INSERT INTO outbox.messages (topic, message_key, payload) \
         SELECT 'mixed', 'hot', convert_to(json_build_object('n', i)::text, 'UTF8') FROM generate_series(1, $1::bigint) AS i",
        &[&n],
    )
    .await
    .map_err(|e| e.to_string())?;
    fill(&c, "mixed", n, None).await;
    let hot: HashMap<Uuid, i64> = order_of(&c)
        .await
        .into_iter()
        .filter(|(_, (_, key))| key.as_deref() == Some("hot"))
        .map(|(id, (seq, _))| (id, seq))
        .collect();
    let left_hot = async || -> i64 {
        c.query_one(
            "SELECT count(*) FROM outbox.messages WHERE message_key = 'hot'",
            &[],
        )
        .await
        .expect("count")
        .get(0)
    };
    let hot_before = left_hot().await;
    let mixed = drain_rate(&db, &c, sizes.window, "mixed").await;
    let hot_rate = (hot_before - left_hot().await) as f64 / sizes.window.as_secs_f64();
    // Per-key order of what the hot key delivered: completion order against enqueue order.
    // A run's attempts are written by one statement, in the run's order, and two of them
    // may carry the same microsecond: within one, the enqueue order stands.
    let mut dispatched: Vec<(i64, i64, Uuid)> = c
        .query(
            "SELECT a.outbox_id, (extract(epoch FROM a.created_at) * 1000000)::bigint \
               FROM outbox.attempts AS a \
              WHERE a.state = 'DISPATCHED' AND a.outbox_id = ANY ($1)",
            &[&hot.keys().copied().collect::<Vec<Uuid>>()],
        )
        .await
        .map_err(|e| e.to_string())?
        .iter()
        .map(|r| {
            let id: Uuid = r.get(0);
            (r.get(1), hot[&id], id)
        })
        .collect();
    dispatched.sort();
    let dispatched: Vec<Uuid> = dispatched.into_iter().map(|(_, _, id)| id).collect();
    let out_of_order = dispatched
        .windows(2)
        .filter(|w| hot[&w[0]] > hot[&w[1]])
        .count();
    check(out_of_order == 0, || {
        format!("{out_of_order} hot-key messages delivered out of order")
    })?;
    db.finish().await;
    Ok(format!(
        "{n} messages of one key + {n} unkeyed, 2 null-destination processes, {} s window: \
         {:.0} msg/s overall ({:.0} % of the {:.0} msg/s of {} unkeyed alone), hot key {hot_rate:.1} msg/s, in order",
        sizes.window.as_secs(),
        mixed,
        100.0 * mixed / baseline.max(1.0),
        baseline,
        2 * n
    ))
}

/// The outbox's size while the horizon is held: outbox.messages' table (every slot) and
/// indexes, in bytes, its dead tuples, and the attempt log (every slot) with its indexes.
async fn outbox_size(c: &Client) -> Result<(i64, i64, i64, i64), String> {
    let row = c
        .query_one(
            "SELECT sum(pg_table_size(p.relid))::bigint, sum(pg_indexes_size(p.relid))::bigint, \
                    coalesce(sum(s.n_dead_tup), 0)::bigint, \
                    (SELECT sum(pg_total_relation_size(a.relid))::bigint \
                       FROM pg_partition_tree('outbox.attempts') AS a WHERE a.isleaf) \
             FROM pg_partition_tree('outbox.messages') AS p \
             LEFT JOIN pg_stat_user_tables AS s ON s.relid = p.relid \
             WHERE p.isleaf",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok((row.get(0), row.get(1), row.get(2), row.get(3)))
}

/// Every 3 s until `stop`, retention as an operator's job runs it: `prune_attempts` of what
/// is older than 60 s, in calls of 10,000 while calls come back full; returns the attempts
/// it removed.
async fn prune_every_3s(c: Client, stop: Arc<AtomicBool>) -> Result<i64, String> {
    let mut pruned = 0;
    while !stop.load(Ordering::SeqCst) {
        loop {
            let n: i64 = c
                .query_one(
                    "SELECT outbox.prune_attempts(interval '60 seconds', 10000)",
                    &[],
                )
                .await
                .map_err(|e| e.to_string())?
                .get(0);
            pruned += n;
            if n < 10_000 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    Ok(pruned)
}

/// Calls of the claim function and their total time in ms, as Postgres counts them
/// (`track_functions`).
async fn claim_time(c: &Client) -> Result<(i64, f64), String> {
    c.batch_execute("SELECT pg_stat_clear_snapshot()")
        .await
        .map_err(|e| e.to_string())?;
    let row = c
        .query_one(
            "SELECT coalesce(sum(calls), 0)::bigint, coalesce(sum(total_time), 0)::float8 \
             FROM pg_stat_user_functions \
             WHERE schemaname = 'outbox' AND funcname = 'claim_outbox_batch_seq'",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok((row.get(0), row.get(1)))
}

/// One window of the horizon scenario.
struct HorizonWindow {
    phase: &'static str,
    delivered_per_sec: f64,
    backlog: i64,
    claim_ms: f64,
    bytes: i64,
    dead: i64,
    /// the attempt log with its indexes
    log_bytes: i64,
}

/// A snapshot held for `sizes.horizon`, and for its first third a transaction holding a
/// transaction id (which holds the claim floors' bound back), while a producer offers about
/// 2,000 msg/s (a tenth keyed, and now and then a message dated in the past, which lowers
/// its shard's floor) and one of two relayers is killed with -9 and restarted every window.
/// Retention runs as an operator's job would (`prune_attempts` of what is older than 60 s,
/// every 3 s), so the audit reads the attempts from the scenario's own record of them: a
/// trigger copies each appended attempt to a table outside the outbox.
/// Checked window by window against the windows before the hold: the backlog under 5 s of
/// traffic, the claim's time within 2 × in the hold's last third, the outbox's size (the
/// attempt log's too) bounded and back a minute after; fails as well on a lost message, a
/// first delivery out of key order, a duplicate no killed worker explains or a gap in an
/// attempt history.
async fn horizon(sizes: &Sizes) -> Outcome {
    const RATE: i64 = 2_000;
    const TICK: Duration = Duration::from_millis(100);
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(&format!(
        "ALTER DATABASE {} SET track_functions = 'pl'",
        db.name
    ))
    .await
    .map_err(|e| e.to_string())?;
    // Appended attempts, not the histories retention copies to the kept slot (4).
    c.batch_execute(
        "CREATE TABLE public.attempts_seen (outbox_id uuid NOT NULL, attempt_no integer NOT NULL, \
                                            state outbox.attempt_state NOT NULL);
         CREATE FUNCTION public.see_attempt() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO public.attempts_seen VALUES (NEW.outbox_id, NEW.attempt_no, NEW.state);
             RETURN NULL;
         END $$;
         CREATE TRIGGER attempts_seen AFTER INSERT ON outbox.attempts
             FOR EACH ROW WHEN (NEW.slot <> 4) EXECUTE FUNCTION public.see_attempt();",
    )
    .await
    .map_err(|e| e.to_string())?;
    let stop_pruning = Arc::new(AtomicBool::new(false));
    let pruner = tokio::spawn(prune_every_3s(db.client().await, stop_pruning.clone()));
    let file = db.scratch_dir().join("horizon.jsonl");
    let args = ["--lease-secs", "5"];
    let mut workers: Vec<Relayer> = (0..2)
        .map(|i| file_worker(&db, &format!("horizon-{i}-0"), &file, &args))
        .collect();
    let holder = db.client().await;
    let id_holder = db.client().await;
    let mut id_held = false;
    let mut held = false;
    // Long enough for the ring to go round before the hold (a slot is current for 30 s), so
    // that the unheld claim is measured in an outbox whose slots are of every age: in the
    // first 30 s they are young and the claim faster than at any later unheld moment (3.5
    // ms against 4.9-5.5 ms after a hold, in one run with 30 s before it).
    let unheld = Duration::from_secs(90).max(sizes.window * 3);
    let after = Duration::from_secs(60);
    let total = unheld + sizes.horizon + after;
    let mut windows: Vec<HorizonWindow> = Vec::new();
    let mut sent: Vec<(Uuid, i64, Option<String>)> = Vec::new();
    let mut kills = 0;
    let (mut calls, mut claim_ms) = claim_time(&c).await?;
    let started = Instant::now();
    let mut tick = tokio::time::interval(TICK);
    while started.elapsed() < total {
        let window_start = Instant::now();
        let delivered_before = written(&file).len();
        while window_start.elapsed() < sizes.window && started.elapsed() < total {
            tick.tick().await;
            let elapsed = started.elapsed();
            if !held && elapsed >= unheld && elapsed < unheld + sizes.horizon {
                // The culprits: a snapshot held for the whole hold, an id for its first third.
                holder
                    .batch_execute(
                        "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM outbox.dead_letters",
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                id_holder
                    .batch_execute("BEGIN; SELECT txid_current()")
                    .await
                    .map_err(|e| e.to_string())?;
                (held, id_held) = (true, true);
            }
            if id_held && elapsed >= unheld + sizes.horizon / 3 {
                id_holder
                    .batch_execute("ROLLBACK")
                    .await
                    .map_err(|e| e.to_string())?;
                id_held = false;
            }
            if held && elapsed >= unheld + sizes.horizon {
                holder
                    .batch_execute("ROLLBACK")
                    .await
                    .map_err(|e| e.to_string())?;
                held = false;
            }
            let n = RATE * i64::try_from(TICK.as_millis()).expect("tick") / 1000 - 1;
            let rows = c
                .query(
                    "INSERT INTO outbox.messages (topic, message_key, payload) \
                     SELECT 'steady', CASE WHEN i % 10 = 0 THEN 'k' || (i % 50) END, \
                            convert_to(json_build_object('n', i)::text, 'UTF8') \
                     FROM generate_series(1, $1::bigint) AS i RETURNING outbox_id, seq, message_key",
                    &[&n],
                )
                .await
                .map_err(|e| e.to_string())?;
            sent.extend(rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))));
            // Dated 5 s in the past, keyed every other time: it lowers its shard's floor.
            let key = sent
                .len()
                .is_multiple_of(2)
                .then(|| format!("k{}", sent.len() % 50));
            // Read back in its own transaction: once committed it may be delivered at once.
            c.batch_execute("BEGIN").await.map_err(|e| e.to_string())?;
            let row = async {
                let id: Uuid = c
                    .query_one(
                        "SELECT outbox.enqueue('steady', '{\"past\": true}'::jsonb, $1::text, \
                         '{}', clock_timestamp() - interval '5 s')",
                        &[&key],
                    )
                    .await?
                    .get(0);
                c.query_one(
                    "SELECT outbox_id, seq, message_key FROM outbox.messages WHERE outbox_id = $1",
                    &[&id],
                )
                .await
            }
            .await;
            c.batch_execute("COMMIT").await.map_err(|e| e.to_string())?;
            let row = row.map_err(|e| e.to_string())?;
            sent.push((row.get(0), row.get(1), row.get(2)));
        }
        let phase = if held {
            "held"
        } else if started.elapsed() <= unheld + sizes.window / 2 {
            "unheld"
        } else {
            "after"
        };
        let victim = rand::random_range(0..workers.len());
        workers[victim].signal("KILL");
        kills += 1;
        workers[victim] = file_worker(&db, &format!("horizon-{victim}-{kills}"), &file, &args);
        let (table, indexes, dead, log_bytes) = outbox_size(&c).await?;
        let (now_calls, now_ms) = claim_time(&c).await?;
        let window_claim = (now_ms - claim_ms) / (now_calls - calls).max(1) as f64;
        (calls, claim_ms) = (now_calls, now_ms);
        windows.push(HorizonWindow {
            phase,
            delivered_per_sec: (written(&file).len() - delivered_before) as f64
                / window_start.elapsed().as_secs_f64(),
            backlog: pending(&c).await,
            claim_ms: window_claim,
            bytes: table + indexes,
            dead,
            log_bytes,
        });
    }
    if held {
        holder
            .batch_execute("ROLLBACK")
            .await
            .map_err(|e| e.to_string())?;
    }
    if id_held {
        id_holder
            .batch_execute("ROLLBACK")
            .await
            .map_err(|e| e.to_string())?;
    }
    wait_for(
        Duration::from_secs(300),
        "the stream to drain after the horizon moved",
        async || pending(&c).await == 0,
    )
    .await?;
    let order = sent
        .into_iter()
        .map(|(id, seq, key)| (id, (seq, key)))
        .collect();
    let a = audit(&c, &file, &order).await;
    stop_pruning.store(true, Ordering::SeqCst);
    let pruned = pruner.await.map_err(|e| e.to_string())??;
    let unexplained = unexplained_duplicates(&c, &file, "public.attempts_seen").await;
    drop(workers);
    guarantees(&a, broken_histories_in(&c, "public.attempts_seen").await)?;
    check(unexplained == 0, || {
        format!("{unexplained} duplicates of messages no killed worker held")
    })?;

    let report = windows
        .iter()
        .map(|w| {
            format!(
                "{} {:.0} msg/s, backlog {}, claim {:.2} ms, {} MB, {} dead, log {} MB",
                w.phase,
                w.delivered_per_sec,
                w.backlog,
                w.claim_ms,
                w.bytes / 1_000_000,
                w.dead,
                w.log_bytes / 1_000_000
            )
        })
        .collect::<Vec<_>>()
        .join(" | ");
    let of = |phase: &'static str| windows.iter().filter(move |w| w.phase == phase);
    // The unheld baseline leaves out the first 30 s (relayers starting, caches cold, the
    // ring's first round).
    let young = usize::try_from((30 / sizes.window.as_secs().max(1)).max(1)).expect("windows");
    let base: Vec<&HorizonWindow> = of("unheld").skip(young).collect();
    let mean_claim =
        |ws: &[&HorizonWindow]| ws.iter().map(|w| w.claim_ms).sum::<f64>() / ws.len().max(1) as f64;
    let base_claim = mean_claim(&base);
    let base_bytes = base.iter().map(|w| w.bytes).max().unwrap_or(0);
    let held_windows: Vec<&HorizonWindow> = of("held").collect();
    let worst_backlog = held_windows.iter().map(|w| w.backlog).max().unwrap_or(0);
    let late = &held_windows[held_windows.len() * 2 / 3..];
    let late_claim = mean_claim(late);
    let peak_bytes = held_windows.iter().map(|w| w.bytes).max().unwrap_or(0);
    let last_after = windows.iter().rev().find(|w| w.phase == "after");
    let after_bytes = last_after.map_or(0, |w| w.bytes);
    let base_log = base.iter().map(|w| w.log_bytes).max().unwrap_or(0);
    let peak_log = held_windows.iter().map(|w| w.log_bytes).max().unwrap_or(0);
    let after_log = last_after.map_or(0, |w| w.log_bytes);
    // The claim over the minute after the hold, its first window (the catch-up) left out.
    let settling: Vec<&HorizonWindow> = of("after").skip(1).collect();
    let after_claim = mean_claim(&settling);
    let summary = format!(
        "a snapshot held {} s (a transaction id for its first third) while about {RATE} msg/s \
         was offered, 2 processes, {kills} kill -9 with restarts; unheld claim \
         {base_claim:.2} ms, last third of the hold {late_claim:.2} ms ({:.2} ×), the minute \
         after {after_claim:.2} ms ({:.2} ×; target 2 ×); backlog at most {worst_backlog} \
         while held; outbox {} MB unheld, at most {} MB held, {} MB a minute after; attempt \
         log (60 s retention, {pruned} attempts pruned) {} MB unheld, at most {} MB held, {} MB \
         a minute after; lost 0, duplicates {} (all among killed leases), first deliveries out \
         of key order 0, gapless histories; per {} s window: {report}",
        sizes.horizon.as_secs(),
        late_claim / base_claim,
        after_claim / base_claim,
        base_bytes / 1_000_000,
        peak_bytes / 1_000_000,
        after_bytes / 1_000_000,
        base_log / 1_000_000,
        peak_log / 1_000_000,
        after_log / 1_000_000,
        a.duplicates,
        sizes.window.as_secs(),
    );
    check(worst_backlog <= 5 * RATE, || {
        format!("the backlog went over 5 s of traffic while held: {summary}")
    })?;
    // The claim's target is 2 × (the summary prints the ratio; docs/performance.md reports
    // it). A speed target is a benchmark's figure, not a timed check: this fails on what a
    // claim stepping over a held horizon's dead entries shows (12-150 × before the slots),
    // not on the noise of 10 s windows under kill -9 (1.74 and 1.80 × in two runs).
    const CLAIM_BOUND: f64 = 4.0;
    check(late_claim <= CLAIM_BOUND * base_claim, || {
        format!(
            "the claim's time in the last third of the hold is over {CLAIM_BOUND} × its \
             unheld time: {summary}"
        )
    })?;
    // Bounded: the slots hold at most a few periods of traffic, dead or alive.
    check(peak_bytes <= 4 * base_bytes.max(40_000_000), || {
        format!("the outbox grew past its bound while held: {summary}")
    })?;
    // The log's ring holds about twice the retention's attempts, dead or alive (without it
    // the log grew by 8-9 MB per 30 s while held).
    check(
        peak_log <= 3 * base_log.max(20_000_000) && after_log <= 3 * base_log.max(20_000_000),
        || format!("the attempt log grew past its bound while held: {summary}"),
    )?;
    check(
        after_bytes <= 2 * base_bytes.max(40_000_000) && after_claim <= CLAIM_BOUND * base_claim,
        || {
            format!(
                "a minute after the hold, the outbox is not back to its size and speed: {summary}"
            )
        },
    )?;
    db.finish().await;
    Ok(summary)
}

/// Messages written to `file` more than once whose lease no killed worker held (no
/// ZOMBIE_REQUEUE attempt in `log`): the guarantees allow a duplicate only for those.
async fn unexplained_duplicates(c: &Client, file: &Path, log: &str) -> i64 {
    let mut count: HashMap<Uuid, usize> = HashMap::new();
    for id in written(file) {
        *count.entry(id).or_default() += 1;
    }
    let dup: Vec<Uuid> = count
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(id, _)| id)
        .collect();
    c.query_one(
        &format!(
            "SELECT count(*) FROM unnest($1::uuid[]) AS d(id) WHERE NOT EXISTS \
             (SELECT 1 FROM {log} AS a WHERE a.outbox_id = d.id AND a.state = 'ZOMBIE_REQUEUE')"
        ),
        &[&dup],
    )
    .await
    .expect("duplicates")
    .get(0)
}

/// One hostile call's arguments, all as text so that casts happen in the database.
fn hostile_args(i: usize, used: &[Uuid]) -> [Option<String>; 8] {
    let pick =
        |options: &[Option<&str>]| options[rand::random_range(0..options.len())].map(str::to_owned);
    let topic = match rand::random_range(0..8) {
        0 => None,
        1 => Some(String::new()),
        2 => Some("t".repeat(5_000)),
        3 => Some("a/../b?x#y %_\\".to_owned()),
        4 => Some("ünïcødé ✓".to_owned()),
        _ => Some(format!("hostile-{}", i % 7)),
    };
    let key = match rand::random_range(0..6) {
        0 => Some(String::new()),
        1 => Some("k".repeat(3_000)),
        2 | 3 => Some(format!("key-{}", i % 13)),
        _ => None,
    };
    let payload = match rand::random_range(0..6) {
        0 => None,
        1 => Some(String::from("\\x")),
        2 => Some(format!("\\x{}", "ff00".repeat(rand::random_range(1..2000)))),
        3 => Some("not hex".to_owned()),
        _ => Some(format!("\\x{}", hex(format!("{{\"n\": {i}}}").as_bytes()))),
    };
    let headers = pick(&[
        None,
        Some("[]"),
        Some("\"s\""),
        Some("null"),
        Some("{bad json"),
        Some("{\"traceparent\": \"00-x\"}"),
        Some("{}"),
        Some("{}"),
    ]);
    let available_at = pick(&[
        None,
        None,
        None,
        Some("infinity"),
        Some("-infinity"),
        Some("not a time"),
        Some("2999-01-01"),
        Some("1970-01-01"),
    ]);
    let id = match rand::random_range(0..6) {
        0 if !used.is_empty() => Some(used[rand::random_range(0..used.len())].to_string()),
        1 => Some("not-a-uuid".to_owned()),
        2 => Some(Uuid::new_v4().to_string()),
        _ => None,
    };
    let max_attempts = pick(&[
        None,
        Some("0"),
        Some("-1"),
        Some("1"),
        Some("2147483647"),
        Some("99999999999"),
        None,
    ]);
    let content_type = pick(&[
        None,
        Some(""),
        Some("application/json"),
        Some("text/plain; charset=utf-8"),
        None,
    ]);
    [
        topic,
        payload,
        key,
        headers,
        available_at,
        id,
        max_attempts,
        content_type,
    ]
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn hostile(sizes: &Sizes) -> Outcome {
    let db = TestDb::new().await;
    let c = db.client().await;
    let mut accepted: Vec<Uuid> = Vec::new();
    let mut refused: HashMap<String, usize> = HashMap::new();
    for i in 0..sizes.hostile {
        let args = hostile_args(i, &accepted);
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = args
            .iter()
            .map(|a| a as &(dyn tokio_postgres::types::ToSql + Sync))
            .collect();
        match c
            .query_one(
                "SELECT outbox.enqueue($1::text, $2::text::bytea, $3::text, $4::text::jsonb, \
                 $5::text::timestamptz, $6::text::uuid, $7::text::int, $8::text)",
                &params,
            )
            .await
        {
            Ok(row) => accepted.push(row.get(0)),
            Err(e) => {
                let db_error = e
                    .as_db_error()
                    .ok_or_else(|| format!("call {i}: not a database error: {e}"))?;
                let code = db_error.code().code().to_owned();
                // Clear errors: our own (P7001, 23505 naming the id) or Postgres' input
                // checks (22xxx data exceptions, 23xxx constraints). Anything else is not.
                check(
                    code.starts_with("22") || code.starts_with("23") || code == "P7001",
                    || {
                        format!(
                            "call {i} {args:?} failed unclearly: {code} {}",
                            db_error.message()
                        )
                    },
                )?;
                *refused.entry(code).or_default() += 1;
            }
        }
    }
    let held: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE available_at > now() + interval '1 minute'",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    let file = db.scratch_dir().join("hostile.jsonl");
    let w = file_worker(
        &db,
        "hostile",
        &file,
        &["--retry-base-ms", "10", "--retry-cap-ms", "50"],
    );
    // Ready = not delayed and not queued behind a delayed head of its key (per-key order, by
    // the order key enqueue gave it).
    let blocked = async || -> i64 {
        c.query_one(
            "SELECT count(*) FROM outbox.messages AS m WHERE m.available_at <= now() AND NOT EXISTS \
             (SELECT 1 FROM outbox.messages AS e WHERE e.order_key = m.order_key AND e.seq < m.seq)",
            &[],
        )
        .await
        .expect("ready")
        .get(0)
    };
    let took = wait_for(
        Duration::from_secs(300),
        "every deliverable hostile message to settle",
        async || blocked().await == 0,
    )
    .await?;
    let dead: HashSet<Uuid> = common::dead_letters(&c)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let delivered: HashSet<Uuid> = written(&file).into_iter().collect();
    let waiting: HashSet<Uuid> = c
        .query("SELECT outbox_id FROM outbox.messages", &[])
        .await
        .map_err(|e| e.to_string())?
        .iter()
        .map(|r| r.get(0))
        .collect();
    drop(w);
    let lost = accepted
        .iter()
        .filter(|id| !delivered.contains(id) && !dead.contains(id) && !waiting.contains(id))
        .count();
    check(lost == 0, || {
        format!("{lost} accepted messages are neither delivered, dead-lettered nor waiting")
    })?;
    db.finish().await;
    let mut codes: Vec<String> = refused.iter().map(|(c, n)| format!("{c}×{n}")).collect();
    codes.sort();
    Ok(format!(
        "{} hostile enqueue calls: {} refused with a clear error ({}), {} accepted; of those {} delivered, \
         {} dead-lettered by the destination with the reason, {} waiting by design ({held} delayed past a minute \
         and the messages of their keys); nothing stalled (settled in {:.1} s)",
        sizes.hostile,
        refused.values().sum::<usize>(),
        codes.join(" "),
        accepted.len(),
        delivered.len(),
        dead.len(),
        waiting.len(),
        took.as_secs_f64()
    ))
}

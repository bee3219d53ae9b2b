//! `rolling-upgrade`: a fleet upgraded the way docs/upgrades.md says, under load. The
//! previous build (by default the parent of the last commit that changed
//! `schema/migrations/`, so that the upgrade applies a real migration; `--previous REF`
//! chooses another) is built once from a git worktree under `target/rolling-upgrade/` with
//! a target directory of its own there, and kept as `outbox-relay-<commit>` for the next
//! run. A database migrated by the previous build's `migrate`; 4 relayers of the previous
//! build delivering to an HTTP server while a producer enqueues keyed messages through
//! `outbox.enqueue` at a steady rate; this build's `migrate` applied while they run; then the
//! old relayers replaced one at a time (SIGTERM, wait for the exit, start a new one, wait
//! until it delivers); then the producer stops and everything drains. Nothing may be lost
//! or dead-lettered, no enqueue may fail, every relayer must exit cleanly, the first delivery
//! of each key's messages must keep enqueue order, and every message a relayer sent must
//! have had its completion either accepted (a DISPATCHED attempt under its worker id) or
//! fenced (counted in its `lease_lost`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::common::{Relayer, TestDb, connect, pending};
use crate::hook::recording_hook;
use crate::{Outcome, Sizes, check, wait_for};

const KEYS: i64 = 100;
const FLEET: usize = 4;
const TICK: Duration = Duration::from_millis(50);
const TICKS_PER_SECOND: i64 = 20;

/// `git ARGS` in the repository; its trimmed output, or an error naming the command.
fn git(args: &[&str]) -> Result<String, String> {
    let out = Command::new("git")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(args)
        .output()
        .map_err(|e| format!("git {args:?}: {e}"))?;
    check(out.status.success(), || {
        format!(
            "git {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The previous build: its commit, its binary, and how long building it took (`None` when
/// an earlier run had built it).
struct Previous {
    commit: String,
    binary: PathBuf,
    built_in: Option<Duration>,
}

/// Builds (or finds) the release binary of `reference`, by default the parent of the last
/// commit that changed `schema/migrations/`.
fn previous_build(reference: Option<&str>) -> Result<Previous, String> {
    let reference = match reference {
        Some(r) => r.to_owned(),
        None => {
            let last = git(&["log", "-1", "--format=%H", "--", "schema/migrations/"])?;
            check(!last.is_empty(), || {
                "no commit changed schema/migrations/: give --previous REF".to_owned()
            })?;
            format!("{last}^")
        }
    };
    let commit = git(&["rev-parse", "--verify", &format!("{reference}^{{commit}}")])
        .map_err(|e| format!("--previous {reference}: not a commit ({e})"))?;
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target directory")
        .join("rolling-upgrade");
    std::fs::create_dir_all(&base).map_err(|e| format!("{}: {e}", base.display()))?;
    let binary = base.join(format!("outbox-relay-{commit}"));
    if binary.exists() {
        return Ok(Previous {
            commit,
            binary,
            built_in: None,
        });
    }
    let source = base.join(format!("src-{commit}"));
    if !source.join("Cargo.toml").exists() {
        // -f: a worktree registered there before and since deleted with the target dir.
        git(&[
            "worktree",
            "add",
            "-f",
            "--detach",
            &source.display().to_string(),
            &commit,
        ])?;
    }
    let log = base.join(format!("build-{commit}.log"));
    let output = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    eprintln!(
        "chaos rolling-upgrade: building the previous build {commit} in {} (log {})",
        source.display(),
        log.display()
    );
    let started = Instant::now();
    let mut build = Command::new(&cargo);
    // Without the variables cargo sets for this test process (CARGO_PKG_NAME, OUT_DIR …):
    // build scripts that watch them (ring's) would otherwise build again at every change
    // between a build from here and one from a shell.
    for (name, _) in std::env::vars() {
        let injected = [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
        ]
        .iter()
        .any(|p| name.starts_with(p))
            || ["CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR", "OUT_DIR"].contains(&name.as_str());
        if injected {
            build.env_remove(name);
        }
    }
    let status = build
        .current_dir(&source)
        .env("CARGO_TARGET_DIR", base.join("target"))
        .args(["build", "--release", "--bin", "outbox-relay"])
        .stdout(output.try_clone().map_err(|e| e.to_string())?)
        .stderr(output)
        .status()
        .map_err(|e| format!("{cargo}: {e}"))?;
    check(status.success(), || {
        format!(
            "building the previous build {commit} failed: see {}",
            log.display()
        )
    })?;
    let built_in = started.elapsed();
    std::fs::copy(base.join("target/release/outbox-relay"), &binary)
        .map_err(|e| format!("keep the previous binary as {}: {e}", binary.display()))?;
    Ok(Previous {
        commit,
        binary,
        built_in: Some(built_in),
    })
}

/// `BINARY migrate` against `url`, to the end; what it printed, or why it failed.
async fn migrate(db: &TestDb, binary: &Path, tag: &str) -> Result<String, String> {
    let out = db.scratch_dir().join(format!("migrate-{tag}.out"));
    let file = std::fs::File::create(&out).map_err(|e| e.to_string())?;
    let mut child = Command::new(binary)
        .arg("migrate")
        .env("DATABASE_URL", &db.url)
        .stdout(file.try_clone().map_err(|e| e.to_string())?)
        .stderr(file)
        .spawn()
        .map_err(|e| format!("{}: {e}", binary.display()))?;
    let mut status = None;
    wait_for(
        Duration::from_secs(300),
        &format!("`migrate` of the {tag} build"),
        async || {
            status = child.try_wait().expect("try_wait");
            status.is_some()
        },
    )
    .await?;
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    check(status.is_some_and(|s| s.success()), || {
        format!("`migrate` of the {tag} build failed: {}", text.trim())
    })?;
    Ok(text)
}

/// A relayer of `binary` named `name`, delivering to `base/{name}/{topic}`, logging JSON.
fn relayer(db: &TestDb, binary: &Path, base: &str, name: &str) -> Result<Relayer, String> {
    let dir = db.scratch_dir();
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(
        &config,
        format!(
            "[destinations.hook]\ntype = \"http\"\nurl = \"{base}/{name}/{{topic}}\"\n\n\
             [[routes]]\ntopic = \"*\"\ndestination = \"hook\"\n"
        ),
    )
    .map_err(|e| e.to_string())?;
    let log = dir.join(format!("{name}.log"));
    let stderr = std::fs::File::create(&log).map_err(|e| e.to_string())?;
    let child = Command::new(binary)
        .arg("run")
        .args(["--worker-id", name, "--config"])
        .arg(&config)
        .args([
            "--batch-size",
            "100",
            "--log-format",
            "json",
            "--no-telemetry",
        ])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .map_err(|e| format!("{}: {e}", binary.display()))?;
    Ok(Relayer {
        child,
        worker_id: name.to_owned(),
        log,
        telemetry: None,
    })
}

/// What a relayer's JSON log says: its `lease_lost` total (from the summary it logs as it
/// stops; `None` if it logged none) and its ERROR and WARN events by message.
struct LogSummary {
    lease_lost: Option<u64>,
    errors: BTreeMap<String, usize>,
    warnings: BTreeMap<String, usize>,
}

fn read_log(r: &Relayer) -> LogSummary {
    let mut s = LogSummary {
        lease_lost: None,
        errors: BTreeMap::new(),
        warnings: BTreeMap::new(),
    };
    for line in r.log_text().lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let Some(n) = v.get("lease_lost").and_then(serde_json::Value::as_u64) {
            *s.lease_lost.get_or_insert(0) += n;
        }
        let message = v["message"].as_str().unwrap_or_default().to_owned();
        match v["level"].as_str() {
            Some("ERROR") => *s.errors.entry(message).or_default() += 1,
            Some("WARN") => *s.warnings.entry(message).or_default() += 1,
            _ => {}
        }
    }
    s
}

/// The last lines of a log, for an error message.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

/// The schema version `outbox.schema_version()` reports.
async fn version(c: &tokio_postgres::Client) -> Result<i32, String> {
    c.query_one("SELECT outbox.schema_version()", &[])
        .await
        .map(|r| r.get(0))
        .map_err(|e| e.to_string())
}

/// A producer enqueueing `per_second` keyed messages through `outbox.enqueue` until `stop`:
/// what it enqueued (id, its number, its key) in enqueue order, and the calls that failed.
async fn produce(url: String, per_second: i64, stop: Arc<AtomicBool>) -> Produced {
    let c = connect(&url).await.expect("producer connects");
    let per_tick = (per_second / TICKS_PER_SECOND).max(1);
    let mut produced = Produced::default();
    let started = Instant::now();
    let mut next = tokio::time::Instant::now();
    let mut n = 0_i64;
    while !stop.load(Ordering::Relaxed) {
        // One call per message, in the order of i: the ids come back in enqueue order.
        match c
            .query(
                "SELECT outbox.enqueue('upgrade', \
                        convert_to(json_build_object('n', $1::bigint + i)::text, 'UTF8'), \
                        'k' || (($1::bigint + i) % $3::bigint)) \
                   FROM generate_series(1, $2::bigint) AS i ORDER BY i",
                &[&n, &per_tick, &KEYS],
            )
            .await
        {
            Ok(rows) => {
                for (i, r) in (n + 1..).zip(&rows) {
                    produced.sent.push((r.get(0), i, format!("k{}", i % KEYS)));
                }
                n += per_tick;
            }
            Err(e) => produced.failed.push(e.to_string()),
        }
        next += TICK;
        tokio::time::sleep_until(next).await;
    }
    produced.took = started.elapsed();
    produced
}

#[derive(Default)]
struct Produced {
    sent: Vec<(Uuid, i64, String)>,
    failed: Vec<String>,
    took: Duration,
}

pub async fn rolling_upgrade(sizes: &Sizes) -> Outcome {
    let previous = previous_build(sizes.previous.as_deref())?;
    let new_binary = Path::new(env!("CARGO_BIN_EXE_outbox-relay"));
    let short = &previous.commit[..10];
    let db = TestDb::empty().await;
    migrate(&db, &previous.binary, "previous").await?;
    let c = db.client().await;
    let from = version(&c).await?;
    let (base, arrivals) = recording_hook(Duration::ZERO).await;
    let by = |name: &str| {
        arrivals
            .lock()
            .unwrap()
            .iter()
            .filter(|(w, _, _)| w == name)
            .count()
    };
    let rate = (sizes.messages / 200).clamp(100, 1_000);
    let steady = (sizes.window / 3).max(Duration::from_secs(5));

    let mut old = Vec::new();
    for i in 1..=FLEET {
        old.push(relayer(&db, &previous.binary, &base, &format!("old-{i}"))?);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn(produce(db.url.clone(), rate, stop.clone()));
    let started = Instant::now();
    for r in &old {
        wait_for(
            Duration::from_secs(60),
            &format!("{} (previous build) to deliver", r.worker_id),
            async || by(&r.worker_id) > 0,
        )
        .await
        .map_err(|e| format!("{e}; the end of its log: {}", tail(&r.log_text())))?;
    }
    tokio::time::sleep(steady).await;

    // The new schema, applied while the previous build's relayers run.
    let migrating = Instant::now();
    let applied = migrate(&db, new_binary, "new").await?;
    let migrate_took = migrating.elapsed();
    let to = version(&c).await?;
    check(to > from, || {
        format!(
            "the previous build {short} is at schema version {from} like this one: nothing to \
             upgrade; choose an older --previous ({})",
            applied.trim()
        )
    })?;
    // Each old relayer goes on delivering on the new schema.
    let marks: Vec<usize> = old.iter().map(|r| by(&r.worker_id)).collect();
    let migrated_at = arrivals.lock().unwrap().len();
    let carried_on = wait_for(
        Duration::from_secs(60),
        "every old relayer to deliver on the new schema",
        async || old.iter().zip(&marks).all(|(r, m)| by(&r.worker_id) > *m),
    )
    .await?;
    tokio::time::sleep(steady).await;

    // Replaced one at a time.
    let mut new = Vec::new();
    let mut steps = Vec::new();
    let mut exits = Vec::new();
    for (i, mut o) in old.drain(..).enumerate() {
        let stopping = Instant::now();
        o.signal("TERM");
        let code = o.exit_code(Duration::from_secs(60)).await;
        let stopped = stopping.elapsed();
        exits.push((o.worker_id.clone(), code, read_log(&o)));
        let name = format!("new-{}", i + 1);
        new.push(relayer(&db, new_binary, &base, &name)?);
        let delivering = wait_for(
            Duration::from_secs(60),
            &format!("{name} to deliver"),
            async || by(&name) > 0,
        )
        .await?;
        steps.push(format!(
            "{} stopped in {} ms, {name} delivering {} ms after start",
            o.worker_id,
            stopped.as_millis(),
            delivering.as_millis()
        ));
    }
    tokio::time::sleep(steady).await;
    stop.store(true, Ordering::Relaxed);
    let produced = producer.await.map_err(|e| e.to_string())?;
    let stopped_producing = Instant::now();
    wait_for(
        Duration::from_secs(600),
        "the rolling-upgrade backlog to drain",
        async || pending(&c).await == 0,
    )
    .await?;
    let drained = stopped_producing.elapsed();
    let total = started.elapsed();
    for mut n in new.drain(..) {
        n.signal("TERM");
        let code = n.exit_code(Duration::from_secs(60)).await;
        exits.push((n.worker_id.clone(), code, read_log(&n)));
    }

    // What arrived, against what was enqueued.
    let arrivals = arrivals.lock().unwrap().clone();
    let dead = crate::common::dead_letters(&c).await;
    let dead_ids: HashSet<Uuid> = dead.iter().map(|(id, _)| *id).collect();
    let seen: HashSet<Uuid> = arrivals.iter().map(|(_, id, _)| *id).collect();
    let lost = produced
        .sent
        .iter()
        .filter(|(id, _, _)| !seen.contains(id) && !dead_ids.contains(id))
        .count();
    let number: HashMap<Uuid, (i64, &str)> = produced
        .sent
        .iter()
        .map(|(id, n, key)| (*id, (*n, key.as_str())))
        .collect();
    let mut first: HashSet<Uuid> = HashSet::new();
    let mut newest: HashMap<&str, i64> = HashMap::new();
    let mut out_of_order = 0;
    for (_, id, _) in &arrivals {
        if !first.insert(*id) {
            continue;
        }
        if let Some((n, key)) = number.get(id) {
            let top = newest.entry(key).or_insert(*n);
            if n < top {
                out_of_order += 1;
            }
            *top = (*top).max(*n);
        }
    }
    let broken = crate::broken_histories(&c).await;
    let old_after_migrate = arrivals[migrated_at..]
        .iter()
        .filter(|(w, _, _)| w.starts_with("old-"))
        .count();

    // Each relayer's sends against its completions: accepted (an attempt under its worker
    // id) or fenced (lease_lost).
    let mut attempts: HashMap<(String, String), i64> = HashMap::new();
    for r in c
        .query(
            "SELECT worker_id, state::text, count(*) FROM outbox.attempts GROUP BY 1, 2",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?
    {
        attempts.insert((r.get(0), r.get(1)), r.get(2));
    }
    let state_count = |state: &str| -> i64 {
        attempts
            .iter()
            .filter(|((_, s), _)| s == state)
            .map(|(_, n)| n)
            .sum()
    };
    let mut sent_by: HashMap<&str, HashSet<Uuid>> = HashMap::new();
    for (w, id, _) in &arrivals {
        sent_by.entry(w.as_str()).or_default().insert(*id);
    }
    let mut unaccounted = Vec::new();
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    let mut warnings: BTreeMap<String, usize> = BTreeMap::new();
    let (mut old_sent, mut old_accepted, mut old_fenced) = (0, 0, 0);
    let (mut new_sent, mut new_accepted, mut new_fenced) = (0, 0, 0);
    let mut bad_exits = Vec::new();
    for (w, code, log) in &exits {
        if *code != Some(0) {
            bad_exits.push(format!("{w} exited with {code:?}"));
        }
        let sent =
            i64::try_from(sent_by.get(w.as_str()).map_or(0, HashSet::len)).unwrap_or(i64::MAX);
        let accepted = attempts
            .get(&(w.clone(), "DISPATCHED".to_owned()))
            .copied()
            .unwrap_or(0);
        let fenced = log.lease_lost.map(|n| i64::try_from(n).unwrap_or(i64::MAX));
        if fenced.is_none_or(|f| sent != accepted + f) {
            unaccounted.push(format!(
                "{w}: sent {sent}, accepted {accepted}, fenced {}",
                log.lease_lost
                    .map_or("unknown (no stop summary in its log)".to_owned(), |n| {
                        n.to_string()
                    })
            ));
        }
        let fenced = fenced.unwrap_or(0);
        if w.starts_with("old-") {
            (old_sent, old_accepted, old_fenced) = (
                old_sent + sent,
                old_accepted + accepted,
                old_fenced + fenced,
            );
        } else {
            (new_sent, new_accepted, new_fenced) = (
                new_sent + sent,
                new_accepted + accepted,
                new_fenced + fenced,
            );
        }
        for (m, k) in &log.errors {
            *errors.entry(m.clone()).or_default() += k;
        }
        for (m, k) in &log.warnings {
            *warnings.entry(m.clone()).or_default() += k;
        }
    }
    drop(exits);

    check(produced.failed.is_empty(), || {
        format!(
            "{} enqueue calls failed, first: {}",
            produced.failed.len(),
            produced.failed[0]
        )
    })?;
    check(lost == 0, || {
        format!("{lost} enqueued messages neither delivered nor dead-lettered")
    })?;
    check(dead.is_empty(), || {
        format!(
            "{} dead-lettered (the destination accepts everything): {:?}",
            dead.len(),
            &dead[..dead.len().min(3)]
        )
    })?;
    check(state_count("FAILED") == 0, || {
        format!(
            "{} attempts recorded FAILED (the destination accepts everything)",
            state_count("FAILED")
        )
    })?;
    check(bad_exits.is_empty(), || bad_exits.join("; "))?;
    check(out_of_order == 0, || {
        format!("{out_of_order} first deliveries after a later message of their key")
    })?;
    check(broken == 0, || {
        format!("{broken} attempt histories with gaps")
    })?;
    check(unaccounted.is_empty(), || {
        format!(
            "completions neither accepted nor fenced: {}",
            unaccounted.join("; ")
        )
    })?;
    db.finish().await;
    let listed = |m: &BTreeMap<String, usize>| {
        if m.is_empty() {
            "none".to_owned()
        } else {
            m.iter()
                .map(|(text, n)| format!("{n}× \"{text}\""))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let n = produced.sent.len();
    Ok(format!(
        "previous build {short} ({}), schema {from} → {to}; {n} keyed messages ({KEYS} keys) \
         enqueued through outbox.enqueue at {:.0} msg/s over {:.1} s, {FLEET} relayers, HTTP \
         destination, batch 100; new `migrate` under load took {:.2} s, every old relayer \
         delivered on the new schema within {:.1} s ({old_after_migrate} messages sent by old \
         relayers after the migration); replacements: {}; drained {:.1} s after \
         the producer stopped, {:.1} s in all; sent by old relayers {old_sent} (accepted \
         {old_accepted}, fenced {old_fenced}), by new {new_sent} (accepted {new_accepted}, \
         fenced {new_fenced}); retried attempts {}, expired leases requeued {}; lost 0, \
         dead-lettered 0, enqueue errors 0, duplicates {}, first deliveries out of key order 0, \
         gapless histories; relayer errors logged: {}; warnings: {}",
        previous.built_in.map_or("reused".to_owned(), |d| format!(
            "built in {:.0} s",
            d.as_secs_f64()
        )),
        n as f64 / produced.took.as_secs_f64(),
        produced.took.as_secs_f64(),
        migrate_took.as_secs_f64(),
        carried_on.as_secs_f64(),
        steps.join(", "),
        drained.as_secs_f64(),
        total.as_secs_f64(),
        state_count("RETRYABLE"),
        state_count("ZOMBIE_REQUEUE"),
        arrivals.len() - seen.len(),
        listed(&errors),
        listed(&warnings),
    ))
}

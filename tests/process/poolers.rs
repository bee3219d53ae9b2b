//! The relayer, `migrate` and producers behind a real PgBouncer (Debian's, 1.18: named
//! prepared statements are not supported in transaction mode before 1.21), in transaction,
//! session and statement mode. Each test starts PgBouncers of its own in front of the test
//! Postgres and stops them when it ends. `make test` installs PgBouncer when it is missing
//! (scripts/test-services.sh); without it these tests fail, naming the package.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::pgbouncer::PgBouncer;
use common::{Relayer, TestDb, count, eventually, free_port, pending, text, verb};
use outbox_relay::message::NewMessage;
use outbox_relay::store::enqueue;

const MINUTE: Duration = Duration::from_secs(60);

/// The value of the unlabelled gauge `name` on the relayer's /metrics; panics when the
/// relayer does not report it.
async fn gauge(relayer: &Relayer, name: &str) -> f64 {
    let addr = relayer
        .telemetry
        .as_deref()
        .expect("a relayer with telemetry");
    let (_, body) = outbox_relay::probes::probe(addr, "/metrics")
        .await
        .expect("/metrics");
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} is not on /metrics:\n{body}"))
}

/// Advisory locks held or awaited in `db` (by any backend, pooled ones included).
async fn advisory_locks(db: &TestDb) -> i64 {
    count(
        &db.client().await,
        "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database \
          WHERE l.locktype = 'advisory' AND d.datname = current_database()",
    )
    .await
}

fn spawn_migrate(url: &str, log: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .arg("migrate")
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "info")
        .stdout(std::fs::File::create(log).expect("migrate stdout"))
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn migrate")
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_migrates_through_a_transaction_pooler_apply_once_and_leave_no_lock() {
    let db = TestDb::empty().await;
    let bouncer = PgBouncer::start(&db.scratch_dir(), "transaction").await;
    let url = bouncer.url(&db);
    // A migrate is under way (its lock is held): the two that start now both wait for it.
    let mut holder = db.client().await;
    let tx = holder.transaction().await.unwrap();
    tx.batch_execute("SELECT pg_advisory_xact_lock(hashtext('outbox.migrate'))")
        .await
        .unwrap();
    let dir = db.scratch_dir();
    let mut migrates: Vec<(Child, PathBuf)> = (0..2)
        .map(|i| {
            let out = dir.join(format!("migrate-{i}.out"));
            (spawn_migrate(&url, &out), out)
        })
        .collect();
    eventually(
        MINUTE,
        "both migrates to wait for the migration lock",
        || async {
            count(
                &db.client().await,
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
            )
            .await
                == 2
        },
    )
    .await;
    tx.rollback().await.unwrap();
    let mut outputs = Vec::new();
    for (child, out) in &mut migrates {
        let status = child.wait().expect("wait for migrate");
        let printed = std::fs::read_to_string(&*out).unwrap();
        assert!(
            status.success(),
            "migrate failed: {printed}\n{}",
            bouncer.log_text()
        );
        outputs.push(printed);
    }
    let applied: Vec<usize> = outputs
        .iter()
        .map(|o| o.lines().filter(|l| l.starts_with("applied V")).count())
        .collect();
    let version = usize::try_from(outbox_relay::schema::version()).unwrap();
    assert!(
        applied.contains(&version) && applied.contains(&0),
        "one migrate applies all {version} migrations, the other finds nothing to do: {outputs:?}"
    );
    let c = db.client().await;
    assert_eq!(
        count(&c, "SELECT count(*) FROM refinery_schema_history").await,
        i64::try_from(version).unwrap()
    );
    // PgBouncer keeps its server connections; none of them holds the lock.
    assert_eq!(
        advisory_locks(&db).await,
        0,
        "no advisory lock outlives a migrate"
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_migrate_killed_half_way_through_a_transaction_pooler_strands_nothing() {
    let version = outbox_relay::schema::version();
    let db = TestDb::at_version(version - 1).await;
    let bouncer = PgBouncer::start(&db.scratch_dir(), "transaction").await;
    let url = bouncer.url(&db);
    // A session locking refinery's history table stops the migrate half-way through its
    // transaction: after it took the migration lock, when it reads what was applied.
    let mut blocker = db.client().await;
    let tx = blocker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE refinery_schema_history IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let mut first = spawn_migrate(&url, &db.scratch_dir().join("killed.out"));
    eventually(
        MINUTE,
        "the first migrate to hold the lock and wait half-way",
        || async {
            let c = db.client().await;
            count(
                &c,
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted",
            )
            .await
                == 1
                && count(
                    &c,
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'relation' AND NOT granted",
                )
                .await
                    >= 1
        },
    )
    .await;
    first.kill().expect("kill -9 the first migrate");
    first.wait().unwrap();
    tx.rollback().await.unwrap();
    let started = std::time::Instant::now();
    let second = verb(&["migrate"], &url);
    assert!(
        second.status.success(),
        "the second migrate: {}{}",
        text(&second.stdout),
        text(&second.stderr)
    );
    assert!(
        text(&second.stdout).contains(&format!("applied V{version}__")),
        "the second migrate applies what the first left undone: {}",
        text(&second.stdout)
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the second migrate did not wait for a stranded lock ({:?})",
        started.elapsed()
    );
    let c = db.client().await;
    let found: i32 = c
        .query_one("SELECT outbox.schema_version()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(found, version);
    assert_eq!(
        advisory_locks(&db).await,
        0,
        "no advisory lock outlives a migrate"
    );
    db.finish().await;
}

/// Enqueues `keys` × `per_key` messages through `url` with the library's `enqueue`, from 4
/// producers, each inside its own transactions of 10 messages (the way an application
/// enqueues with its own writes). The payload carries the key and the message's rank in it.
async fn produce(url: &str, keys: usize, per_key: usize) {
    let mut producers = tokio::task::JoinSet::new();
    for p in 0..4 {
        let url = url.to_owned();
        producers.spawn(async move {
            let mut c = common::connect(&url)
                .await
                .expect("connect through the pooler");
            // Producer p owns the keys k with k % 4 == p, so each key's ranks commit in order.
            let mine: Vec<usize> = (0..keys).filter(|k| k % 4 == p).collect();
            let messages: Vec<(usize, usize)> = (0..per_key)
                .flat_map(|n| mine.iter().map(move |k| (*k, n)))
                .collect();
            for chunk in messages.chunks(10) {
                let tx = c.transaction().await.expect("begin");
                for (k, n) in chunk {
                    let message = NewMessage {
                        topic: "pooled".into(),
                        key: Some(format!("key-{k}")),
                        payload: serde_json::json!({"key": k, "n": n}).into(),
                        ..NewMessage::default()
                    };
                    enqueue(&tx, &message)
                        .await
                        .expect("enqueue through the pooler");
                }
                tx.commit().await.expect("commit");
            }
        });
    }
    while let Some(done) = producers.join_next().await {
        done.expect("producer");
    }
}

/// Per key, the ranks in the order they arrived in the JSON-lines file `out`.
fn arrivals(out: &Path) -> HashMap<i64, Vec<i64>> {
    let mut arrivals: HashMap<i64, Vec<i64>> = HashMap::new();
    for line in std::fs::read_to_string(out).unwrap_or_default().lines() {
        let l: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        arrivals
            .entry(l["payload"]["key"].as_i64().unwrap())
            .or_default()
            .push(l["payload"]["n"].as_i64().unwrap());
    }
    arrivals
}

/// 10,000 messages enqueued through the pooler in `mode` and relayed through it by a
/// relayer given `args`; checks that each arrived once, in order per key, and returns the
/// relayer (still running) for its gauges.
async fn relay_through(db: &TestDb, bouncer: &PgBouncer, name: &str, args: &[&str]) -> Relayer {
    let url = bouncer.url(db);
    let out = db.scratch_dir().join(format!("{name}.jsonl"));
    let telemetry = format!("127.0.0.1:{}", free_port());
    let out_arg = out.display().to_string();
    let mut all: Vec<&str> = vec![
        "--sink",
        "file",
        "--sink-file",
        &out_arg,
        "--telemetry-addr",
        &telemetry,
    ];
    all.extend_from_slice(args);
    let relayer = Relayer::start_with_url(db, &url, name, &all);
    let (keys, per_key) = (100, 100);
    produce(&url, keys, per_key).await;
    let c = db.client().await;
    eventually(
        3 * MINUTE,
        "10,000 messages relayed through the pooler",
        || async { pending(&c).await == 0 },
    )
    .await;
    let arrivals = arrivals(&out);
    assert_eq!(arrivals.len(), keys, "every key arrived");
    for (key, ns) in &arrivals {
        assert_eq!(
            *ns,
            (0..i64::try_from(per_key).unwrap()).collect::<Vec<_>>(),
            "key {key} arrived once each, in order\nrelayer log:\n{}",
            relayer.log_text()
        );
    }
    relayer
}

#[tokio::test(flavor = "multi_thread")]
async fn through_a_transaction_pooler_the_relayer_detects_it_sends_unnamed_statements_and_polls() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db.scratch_dir(), "transaction").await;
    // Nothing set but the URL: the relayer finds the pooler, turns its leasing statements
    // unnamed, and finds its LISTEN deaf; messages still arrive, by polling.
    let relayer = relay_through(&db, &bouncer, "auto", &[]).await;
    assert_eq!(gauge(&relayer, "outbox_unnamed_statements").await, 1.0);
    assert_eq!(
        gauge(&relayer, "outbox_listener_healthy").await,
        0.0,
        "LISTEN through a transaction pooler is reported deaf"
    );
    let (status, body) =
        outbox_relay::probes::probe(relayer.telemetry.as_deref().unwrap(), "/readyz")
            .await
            .unwrap();
    assert_eq!(
        status, 200,
        "a deaf listener does not make the relayer unready: {body}"
    );
    assert!(body.contains("wake-ups: deaf"), "/readyz says why: {body}");
    assert!(
        body.contains("listen_url"),
        "/readyz says what to set: {body}"
    );
    drop(relayer);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn through_a_transaction_pooler_unnamed_statements_and_a_direct_listen_url_wake_at_once() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db.scratch_dir(), "transaction").await;
    // The poll interval is long: only wake-ups explain a quick pickup.
    let relayer = relay_through(
        &db,
        &bouncer,
        "direct-listen",
        &[
            "--statements",
            "unnamed",
            "--listen-url",
            &db.url,
            "--poll-interval-ms",
            "5000",
        ],
    )
    .await;
    assert_eq!(gauge(&relayer, "outbox_unnamed_statements").await, 1.0);
    assert_eq!(gauge(&relayer, "outbox_listener_healthy").await, 1.0);
    // Low load: one message at a time through the pooler, each after the previous arrived.
    let mut producer = common::connect(&bouncer.url(&db)).await.unwrap();
    let c = db.client().await;
    let mut pickups = Vec::new();
    for n in 0..12 {
        // The relayer is idle first: the rechecks that follow a wake-up end within 525 ms,
        // after which only a wake-up (or the 5 s poll) finds the next message. The sleep is
        // the behaviour: an idle relayer, not a synchronisation.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let tx = producer.transaction().await.unwrap();
        let message = NewMessage {
            topic: "pickup".into(),
            payload: serde_json::json!({"n": n}).into(),
            ..NewMessage::default()
        };
        let id = enqueue(&tx, &message).await.unwrap();
        tx.commit().await.unwrap();
        eventually(MINUTE, "the message to be delivered", || async {
            pending(&c).await == 0
        })
        .await;
        // From the enqueue (the time in the message's UUIDv7, taken by the database's clock)
        // to its delivery (the attempt's created_at, the same clock).
        let delivered: chrono::DateTime<chrono::Utc> = c
            .query_one(
                "SELECT created_at FROM outbox.attempts WHERE outbox_id = $1",
                &[&id.0],
            )
            .await
            .unwrap()
            .get(0);
        let (secs, nanos) = id.0.get_timestamp().expect("a UUIDv7").to_unix();
        let enqueued_ms = secs as f64 * 1000.0 + f64::from(nanos) / 1e6;
        let ms = delivered.timestamp_micros() as f64 / 1000.0 - enqueued_ms;
        pickups.push(ms);
    }
    pickups.sort_by(f64::total_cmp);
    let p50 = pickups[pickups.len() / 2];
    eprintln!("enqueue to delivery through the pooler with a direct listen_url: p50 {p50:.1} ms");
    assert!(
        p50 < 100.0,
        "woken by the direct listener, not by polling (5 s, or 200 ms while deaf): p50 \
         {p50:.1} ms ({pickups:?})"
    );
    drop(relayer);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn through_a_session_pooler_named_statements_and_listen_work_as_directly() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db.scratch_dir(), "session").await;
    let relayer = relay_through(&db, &bouncer, "session", &[]).await;
    assert_eq!(gauge(&relayer, "outbox_unnamed_statements").await, 0.0);
    eventually(MINUTE, "the listener's first check", || async {
        gauge(&relayer, "outbox_listener_healthy").await == 1.0
    })
    .await;
    drop(relayer);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pooler_in_statement_mode_is_refused_with_the_reason() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db.scratch_dir(), "statement").await;
    let url = bouncer.url(&db);
    let migrate = verb(&["migrate"], &url);
    assert!(!migrate.status.success());
    assert!(
        text(&migrate.stderr).contains("pooler in statement mode"),
        "{}",
        text(&migrate.stderr)
    );
    let mut relayer = Relayer::start_with_url(&db, &url, "statement", &["--no-telemetry"]);
    let code = relayer.exit_code(MINUTE).await;
    assert_ne!(code, Some(0));
    assert!(
        relayer.log_text().contains("pooler in statement mode"),
        "{}",
        relayer.log_text()
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn nothing_depends_on_the_search_path() {
    // A session whose search_path is empty: every statement names its schema, or fails.
    let db = TestDb::new().await;
    let c = db.client().await;
    common::fill(&c, "qualified", 200, Some(5)).await;
    let url = format!("{}?options=-csearch_path%3D", db.url);
    let probe = common::connect(&url).await.unwrap();
    let path: String = probe
        .query_one("SELECT current_setting('search_path')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(path, "", "the URL empties the search_path");
    let out = db.scratch_dir().join("qualified.jsonl");
    let out_arg = out.display().to_string();
    let mut relayer = Relayer::start_with_url(
        &db,
        &url,
        "qualified",
        &["--sink", "file", "--sink-file", &out_arg, "--no-telemetry"],
    );
    eventually(MINUTE, "200 messages relayed", || async {
        pending(&c).await == 0
    })
    .await;
    relayer.signal("TERM");
    assert_eq!(
        relayer.exit_code(MINUTE).await,
        Some(0),
        "{}",
        relayer.log_text()
    );
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), 200);
    for args in [
        &["status"][..],
        &["dead-letters", "list"],
        &["enqueue", "--topic", "qualified", "--payload", "{}"],
        &["migrate"],
    ] {
        let o = verb(args, &url);
        assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
    }
    db.finish().await;
}

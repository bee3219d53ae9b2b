//! The relayer as users run it: real processes of the built binary, real connections, real
//! signals (SIGKILL, SIGSTOP/SIGCONT, SIGTERM), checked against the attempt log, the rows
//! left in the outbox, the file sink's output and the relayer's /metrics (never its log
//! wording).

use crate::common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::{Relayer, TestDb, dead_letters, eventually, fill, free_port, pending};
use tokio_postgres::Client;
use uuid::Uuid;

const MINUTE: Duration = Duration::from_secs(60);

async fn leases_of(c: &Client, worker: &str) -> Vec<Uuid> {
    c.query(
        "SELECT outbox_id FROM outbox.messages WHERE claimed_by = $1",
        &[&worker],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// The JSON lines written by the file sink.
fn lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

fn ids(lines: &[serde_json::Value]) -> Vec<Uuid> {
    lines
        .iter()
        .map(|l| l["outbox_id"].as_str().unwrap().parse().unwrap())
        .collect()
}

/// "attempt_no:STATE:worker" per attempt of each message.
async fn histories(c: &Client) -> HashMap<Uuid, Vec<String>> {
    let mut h: HashMap<Uuid, Vec<String>> = HashMap::new();
    for r in c
        .query(
            "SELECT outbox_id, attempt_no || ':' || state || ':' || worker_id \
             FROM outbox.attempts ORDER BY outbox_id, attempt_no",
            &[],
        )
        .await
        .unwrap()
    {
        h.entry(r.get(0)).or_default().push(r.get(1));
    }
    h
}

fn file_args(path: &std::path::Path) -> Vec<String> {
    vec![
        "--sink".into(),
        "file".into(),
        "--sink-file".into(),
        path.display().to_string(),
        "--no-telemetry".into(),
    ]
}

fn start(db: &TestDb, worker: &str, args: &[String]) -> Relayer {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Relayer::start(db, worker, &args)
}

fn with(base: &[String], more: &[&str]) -> Vec<String> {
    base.iter()
        .cloned()
        .chain(more.iter().map(|s| (*s).to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn four_workers_drain_50000_messages_exactly_once() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let all: HashSet<Uuid> = fill(&c, "load", 50_000, Some(10))
        .await
        .into_iter()
        .collect();
    let out = db.scratch_dir().join("out.jsonl");
    let args = with(&file_args(&out), &["--batch-size", "500"]);
    let mut workers: Vec<Relayer> = (0..4)
        .map(|i| start(&db, &format!("drain-{i}"), &args))
        .collect();

    eventually(3 * MINUTE, "the outbox to drain", || async {
        pending(&c).await == 0
    })
    .await;
    for w in &workers {
        w.signal("TERM");
    }
    for w in &mut workers {
        assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());
    }

    let delivered = ids(&lines(&out));
    assert_eq!(delivered.len(), 50_000, "one line per message");
    let distinct: HashSet<Uuid> = delivered.into_iter().collect();
    assert_eq!(distinct, all, "every message delivered, none twice");
    let h = histories(&c).await;
    assert_eq!(h.len(), 50_000);
    assert!(
        h.values()
            .all(|a| a.len() == 1 && a[0].starts_with("1:DISPATCHED:drain-")),
        "every history is exactly 1:DISPATCHED"
    );
    let used: HashSet<&str> = h
        .values()
        .map(|a| a[0].rsplit(':').next().unwrap())
        .collect();
    assert!(used.len() > 1, "work was shared: {used:?}");
    db.finish().await;
}

/// The current slot of outbox.messages.
async fn current_slot(c: &Client) -> i16 {
    c.query_one("SELECT outbox.message_slot()", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_relayers_rotate_the_slots_and_truncate_the_one_they_emptied() {
    // ... and count the rotations that find it held open by a session, until it ends.
    let db = TestDb::new().await;
    let c = db.client().await;
    // Slot 0 stays current until the test ends its period, however slow the machine.
    c.batch_execute("UPDATE outbox.message_slots SET opened_at = now() + interval '1 hour'")
        .await
        .unwrap();
    // Autovacuum may empty slot 0's heap down to no page once its rows are dead, and the
    // rotation passes over a slot without pages (nothing left to give back): the truncation
    // this test waits for would then never come.
    c.batch_execute("ALTER TABLE outbox.messages_0 SET (autovacuum_enabled = false)")
        .await
        .unwrap();
    let first: HashSet<Uuid> = fill(&c, "load", 5_000, Some(10))
        .await
        .into_iter()
        .collect();
    let out = db.scratch_dir().join("out.jsonl");
    // With telemetry, for the counter of slots held open.
    let args: Vec<String> = file_args(&out)
        .into_iter()
        .filter(|a| a != "--no-telemetry")
        .collect();
    let mut workers: Vec<Relayer> = (0..2)
        .map(|i| {
            let telemetry = format!("127.0.0.1:{}", free_port());
            start(
                &db,
                &format!("slots-{i}"),
                &with(&args, &["--telemetry-addr", &telemetry]),
            )
        })
        .collect();
    eventually(MINUTE, "the first messages to be delivered", || async {
        pending(&c).await == 0
    })
    .await;
    assert_eq!(current_slot(&c).await, 0, "slot 0's period is not over");
    // A session idle in a transaction that read outbox.messages: it holds every slot open.
    let holder = db.client().await;
    holder
        .batch_execute("BEGIN; SELECT count(*) FROM outbox.messages")
        .await
        .unwrap();
    // Only a truncation gives the slot a new file (vacuum may also empty the old one).
    let filenode = || async {
        c.query_one(
            "SELECT pg_relation_filenode('outbox.messages_0')::bigint",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
    };
    let before = filenode().await;
    // The current slot's period is over: a relayer's janitor moves producers on.
    c.batch_execute(
        "UPDATE outbox.message_slots SET opened_at = now() - interval '1 hour' WHERE slot = 0",
    )
    .await
    .unwrap();
    eventually(MINUTE, "producers to move to slot 1", || async {
        current_slot(&c).await == 1
    })
    .await;
    let second: HashSet<Uuid> = fill(&c, "load", 1_000, None).await.into_iter().collect();
    let held_open = || async {
        let mut sum = 0.0;
        for w in &workers {
            sum += w
                .metric("outbox_message_slots_held_open_total")
                .await
                .unwrap_or(0.0);
        }
        sum
    };
    eventually(MINUTE, "a rotation to find slot 0 held open", || async {
        held_open().await >= 2.0
    })
    .await;
    assert_eq!(filenode().await, before, "slot 0 is kept while it is held");
    holder.batch_execute("COMMIT").await.unwrap();
    eventually(MINUTE, "slot 0 to be truncated", || async {
        filenode().await != before
    })
    .await;
    eventually(MINUTE, "the second messages to be delivered", || async {
        pending(&c).await == 0
    })
    .await;
    for w in &workers {
        w.signal("TERM");
    }
    for w in &mut workers {
        assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());
    }
    let delivered: HashSet<Uuid> = ids(&lines(&out)).into_iter().collect();
    assert_eq!(
        delivered,
        first.union(&second).copied().collect(),
        "every message of both slots delivered"
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_killed_with_leases_loses_nothing() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let all: HashSet<Uuid> = fill(&c, "load", 20_000, Some(10))
        .await
        .into_iter()
        .collect();
    let dir = db.scratch_dir();
    let lease = [
        "--lease-secs",
        "3",
        "--repair-interval-secs",
        "1",
        "--batch-size",
        "100",
    ];

    let victim_out = dir.join("victim.jsonl");
    // Its own application_name, to see when its database sessions are gone.
    let victim_url = format!("{}?application_name=victim", db.url);
    let victim_args = with(&file_args(&victim_out), &lease);
    let victim_args = with(&victim_args, &["--database-url", &victim_url]);
    let mut victim = start(&db, "victim", &victim_args);
    // Kill it while it holds leases: once it holds some, freeze it, let whatever it already
    // sent finish in its backends, and kill it only if leases remain (it may have completed
    // its batches meanwhile; then let it run until it holds leases again and try again).
    let busy_sessions = || async {
        c.query_one(
            "SELECT count(*) FROM pg_stat_activity \
              WHERE datname = current_database() AND application_name = 'victim' \
                AND state <> 'idle'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
    };
    loop {
        eventually(MINUTE, "the victim to hold leases", || async {
            !leases_of(&c, "victim").await.is_empty()
        })
        .await;
        victim.signal("STOP");
        eventually(MINUTE, "the frozen victim's queries to finish", || async {
            busy_sessions().await == 0
        })
        .await;
        if !leases_of(&c, "victim").await.is_empty() {
            break;
        }
        victim.signal("CONT");
    }
    victim.signal("KILL");
    assert_eq!(victim.exit_code(MINUTE).await, None, "killed by a signal");
    // A completion the victim sent just before dying may still run in its backend; the
    // killed batch is what it holds once those sessions have ended.
    eventually(MINUTE, "the victim's database sessions to end", || async {
        c.query_one(
            "SELECT count(*) FROM pg_stat_activity \
              WHERE datname = current_database() AND application_name = 'victim'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
            == 0
    })
    .await;
    let killed: HashSet<Uuid> = leases_of(&c, "victim").await.into_iter().collect();
    assert!(!killed.is_empty(), "the victim died holding leases");

    let outs: Vec<_> = (0..2)
        .map(|i| dir.join(format!("survivor-{i}.jsonl")))
        .collect();
    let mut survivors: Vec<Relayer> = outs
        .iter()
        .enumerate()
        .map(|(i, out)| {
            start(
                &db,
                &format!("survivor-{i}"),
                &with(&file_args(out), &lease),
            )
        })
        .collect();
    eventually(
        3 * MINUTE,
        "the survivors to deliver everything",
        || async { pending(&c).await == 0 },
    )
    .await;
    for s in &survivors {
        s.signal("TERM");
    }
    for s in &mut survivors {
        assert_eq!(s.exit_code(MINUTE).await, Some(0), "{}", s.log_text());
    }

    let mut seen: HashMap<Uuid, usize> = HashMap::new();
    for out in outs.iter().chain([&victim_out]) {
        for id in ids(&lines(out)) {
            *seen.entry(id).or_default() += 1;
        }
    }
    let delivered: HashSet<Uuid> = seen.keys().copied().collect();
    assert_eq!(delivered, all, "nothing is lost");
    let duplicates: HashSet<Uuid> = seen
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| *id)
        .collect();
    assert!(
        duplicates.is_subset(&killed),
        "only messages of the killed batch may arrive twice"
    );
    let h = histories(&c).await;
    for id in &killed {
        let history = &h[id];
        assert_eq!(history.len(), 2, "{history:?}");
        assert_eq!(history[0], "1:ZOMBIE_REQUEUE:victim");
        assert!(
            history[1].starts_with("2:DISPATCHED:survivor-"),
            "{history:?}"
        );
    }
    assert!(
        h.iter()
            .filter(|(id, _)| !killed.contains(id))
            .all(|(_, a)| a.len() == 1 && a[0].starts_with("1:DISPATCHED")),
        "messages outside the killed batch have one attempt"
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_worker_is_fenced_when_it_wakes_up() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let all: HashSet<Uuid> = fill(&c, "load", 10, None).await.into_iter().collect();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    // The destination takes 4 s; the lease is 2 s: frozen, the worker cannot extend it.
    let mut frozen = Relayer::start(
        &db,
        "frozen",
        &[
            "--sink",
            "null",
            "--null-latency-ms",
            "4000",
            "--lease-secs",
            "2",
            "--batch-size",
            "10",
            "--telemetry-addr",
            &addr,
        ],
    );
    eventually(MINUTE, "the frozen worker to hold all leases", || async {
        leases_of(&c, "frozen").await.len() == 10
    })
    .await;
    // Frozen inside the destination's 4 s, not between the claim and the publish (that case
    // is the test below): the publish starts within the window (1.6 s) of the claim.
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    frozen.signal("STOP");

    let out = db.scratch_dir().join("rescuer.jsonl");
    let mut rescuer = start(
        &db,
        "rescuer",
        &with(
            &file_args(&out),
            &["--lease-secs", "2", "--repair-interval-secs", "1"],
        ),
    );
    eventually(MINUTE, "the rescuer to deliver everything", || async {
        pending(&c).await == 0
    })
    .await;
    frozen.signal("CONT");

    // Woken, its completion is refused (10 lost leases); on a machine so loaded that the
    // publish had not started when it froze, it gives the batch back unpublished instead.
    // Either way the outcome is the rescuer's (the histories below).
    let metrics_url = format!("http://{addr}/metrics");
    eventually(
        MINUTE,
        "the woken worker to count 10 lost leases or give the batch back",
        || async {
            lease_lost_total(&metrics_url).await == Some(10.0)
                || frozen
                    .log_text()
                    .contains("reason=\"its publish window closed before dispatch\"")
        },
    )
    .await;

    let rescued: HashSet<Uuid> = ids(&lines(&out)).into_iter().collect();
    assert_eq!(rescued, all);
    for (id, history) in histories(&c).await {
        assert_eq!(
            history,
            ["1:ZOMBIE_REQUEUE:frozen", "2:DISPATCHED:rescuer"],
            "{id}: the frozen worker's outcome was refused"
        );
    }
    for w in [&frozen, &rescuer] {
        w.signal("TERM");
    }
    assert_eq!(
        frozen.exit_code(MINUTE).await,
        Some(0),
        "{}",
        frozen.log_text()
    );
    assert_eq!(
        rescuer.exit_code(MINUTE).await,
        Some(0),
        "{}",
        rescuer.log_text()
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_frozen_between_claim_and_publish_does_not_publish_when_it_wakes() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let all: HashSet<Uuid> = fill(&c, "load", 10, Some(1)).await.into_iter().collect();
    // Hold every shard's claim turn, so that the worker's claim is sent and waits in the
    // database.
    let turn = db.client().await;
    turn.batch_execute("BEGIN; SELECT * FROM outbox.turns WHERE name LIKE 'claim:%' FOR UPDATE")
        .await
        .unwrap();
    let stale_out = db.scratch_dir().join("frozen.jsonl");
    let telemetry = format!("127.0.0.1:{}", common::free_port());
    let mut frozen = Relayer::start(
        &db,
        "frozen",
        &[
            "--sink",
            "file",
            "--sink-file",
            &stale_out.display().to_string(),
            "--telemetry-addr",
            &telemetry,
            "--lease-secs",
            "2",
            "--batch-size",
            "10",
        ],
    );
    eventually(
        MINUTE,
        "the worker's claim to wait for its turn",
        || async {
            c.query_one(
                "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock' \
               AND query LIKE '%claim_outbox_batch%'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
                == 1
        },
    )
    .await;
    // Frozen with its claim on the way: the leases start while it cannot see them.
    frozen.signal("STOP");
    turn.batch_execute("COMMIT").await.unwrap();
    eventually(
        MINUTE,
        "the frozen worker's claim to lease all 10",
        || async { leases_of(&c, "frozen").await.len() == 10 },
    )
    .await;

    let out = db.scratch_dir().join("rescuer.jsonl");
    let mut rescuer = start(
        &db,
        "rescuer",
        &with(
            &file_args(&out),
            &["--lease-secs", "2", "--repair-interval-secs", "1"],
        ),
    );
    eventually(MINUTE, "the rescuer to deliver everything", || async {
        pending(&c).await == 0
    })
    .await;
    frozen.signal("CONT");
    eventually(
        MINUTE,
        "the woken worker to give its stale batch back",
        || async {
            frozen
                .metric("outbox_stale_batches_total")
                .await
                .is_some_and(|n| n >= 1.0)
        },
    )
    .await;
    assert!(
        lines(&stale_out).is_empty(),
        "stale writes: {:?}",
        lines(&stale_out)
    );
    let rescued: HashSet<Uuid> = ids(&lines(&out)).into_iter().collect();
    assert_eq!(rescued, all);
    for w in [&frozen, &rescuer] {
        w.signal("TERM");
    }
    assert_eq!(
        frozen.exit_code(MINUTE).await,
        Some(0),
        "{}",
        frozen.log_text()
    );
    assert_eq!(
        rescuer.exit_code(MINUTE).await,
        Some(0),
        "{}",
        rescuer.log_text()
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_payload_over_max_message_bytes_is_dead_lettered_without_being_relayed() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let big: Uuid = c
        .query_one(
            "SELECT outbox.enqueue('t', decode(repeat('ab', 5000), 'hex'))",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let small = fill(&c, "t", 20, None).await;
    let out = db.scratch_dir().join("out.jsonl");
    let mut w = start(
        &db,
        "sized",
        &with(
            &file_args(&out),
            &["--max-message-bytes", "4096", "--max-batch-bytes", "1024"],
        ),
    );
    eventually(MINUTE, "everything to be settled", || async {
        pending(&c).await == 0
    })
    .await;
    let dead = dead_letters(&c).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, big);
    assert!(
        dead[0]
            .1
            .contains("payload is 5000 bytes, more than max_message_bytes (4096)"),
        "{}",
        dead[0].1
    );
    let relayed: HashSet<Uuid> = ids(&lines(&out)).into_iter().collect();
    assert_eq!(relayed, small.into_iter().collect());
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());
    db.finish().await;
}

/// Sum of `outbox_lease_lost_total` over topics, scraped from /metrics.
async fn lease_lost_total(url: &str) -> Option<f64> {
    let body = http_get(url).await?;
    Some(
        body.lines()
            .filter(|l| l.starts_with("outbox_lease_lost_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}

/// A minimal HTTP/1.0 GET (the body), enough for /metrics.
async fn http_get(url: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/')?;
    let mut s = tokio::net::TcpStream::connect(host).await.ok()?;
    s.write_all(format!("GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.ok()?;
    buf.split_once("\r\n\r\n").map(|(_, body)| body.to_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_under_load_releases_what_it_cannot_finish_and_exits_0() {
    let db = TestDb::new().await;
    let c = db.client().await;
    fill(&c, "load", 5_000, Some(10)).await;
    // Each batch takes 1.5 s at the destination; the shutdown deadline is 0.3 s.
    let mut w = Relayer::start(
        &db,
        "busy",
        &[
            "--sink",
            "null",
            "--null-latency-ms",
            "1500",
            "--batch-size",
            "200",
            "--shutdown-timeout-ms",
            "300",
            "--no-telemetry",
        ],
    );
    eventually(MINUTE, "the worker to hold leases", || async {
        leases_of(&c, "busy").await.len() >= 200
    })
    .await;
    let started = std::time::Instant::now();
    w.signal("TERM");
    assert_eq!(
        w.exit_code(Duration::from_secs(10)).await,
        Some(0),
        "{}",
        w.log_text()
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "exits soon after the deadline"
    );
    assert!(
        leases_of(&c, "busy").await.is_empty(),
        "every lease was given back"
    );
    let released = c
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE lease_token IS NULL AND attempt_count = 0",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert!(
        released > 0,
        "what it could not finish was released: back in the outbox, no attempt counted"
    );

    // Nothing is left for repair: no message ever gets a ZOMBIE_REQUEUE.
    c.execute(
        "UPDATE outbox.messages SET lease_expires_at = now() - interval '1 minute' \
         WHERE lease_token IS NOT NULL",
        &[],
    )
    .await
    .unwrap();
    let repaired: i32 = c
        .query_one("SELECT requeued FROM outbox.repair_expired_leases()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(repaired, 0);
    let (dispatched, other): (i64, i64) = c
        .query_one(
            "SELECT count(*) FILTER (WHERE state = 'DISPATCHED'), count(*) FILTER (WHERE state <> 'DISPATCHED') \
             FROM outbox.attempts",
            &[],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(other, 0, "released messages count no attempt");
    assert_eq!(
        pending(&c).await + dispatched,
        5_000,
        "every message delivered or pending"
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_in_flight_deliveries_finish_within_the_deadline() {
    let db = TestDb::new().await;
    let c = db.client().await;
    fill(&c, "load", 2_000, Some(10)).await;
    let mut w = Relayer::start(
        &db,
        "graceful",
        &[
            "--sink",
            "null",
            "--null-latency-ms",
            "700",
            "--batch-size",
            "100",
            "--shutdown-timeout-ms",
            "10000",
            "--no-telemetry",
        ],
    );
    eventually(MINUTE, "the worker to hold leases", || async {
        !leases_of(&c, "graceful").await.is_empty()
    })
    .await;
    w.signal("TERM");
    assert_eq!(
        w.exit_code(Duration::from_secs(15)).await,
        Some(0),
        "{}",
        w.log_text()
    );
    assert!(leases_of(&c, "graceful").await.is_empty());
    let dispatched: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCHED'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        dispatched >= 100,
        "the in-flight batches were completed, not dropped"
    );
    assert_eq!(pending(&c).await + dispatched, 2_000);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn per_key_order_holds_across_four_workers() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // One file for all four: each batch is one append, so the file is the arrival order.
    let out = db.scratch_dir().join("ordered.jsonl");
    // Only key heads are claimable (100 at a time here), and a completion wakes no one: the
    // worker that completes a round claims the next at once, while the others find work only
    // when they poll. A short poll makes all four compete for every round; otherwise the
    // first worker can drain all 50 rounds within one default poll interval, alone.
    let args = with(&file_args(&out), &["--poll-interval-ms", "10"]);
    let mut workers: Vec<Relayer> = (0..4)
        .map(|i| start(&db, &format!("order-{i}"), &args))
        .collect();
    // The messages arrive once every worker listens, with the notification outbox.enqueue
    // would send, so that no worker has a head start.
    eventually(MINUTE, "the four workers to listen", || async {
        let listening: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND query = 'LISTEN outbox_new'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        listening == 4
    })
    .await;
    c.execute(
        "INSERT INTO outbox.messages (topic, message_key, payload) \
         SELECT 'ordered', 'key-' || k, convert_to(json_build_object('key', k, 'n', n)::text, 'UTF8') \
           FROM generate_series(1, 50) AS n, generate_series(1, 100) AS k ORDER BY n, k",
        &[],
    )
    .await
    .unwrap();
    c.execute("SELECT pg_notify('outbox_new', 'ordered')", &[])
        .await
        .unwrap();
    eventually(3 * MINUTE, "5000 keyed messages to drain", || async {
        pending(&c).await == 0
    })
    .await;
    for w in &workers {
        w.signal("TERM");
    }
    for w in &mut workers {
        assert_eq!(w.exit_code(MINUTE).await, Some(0));
    }
    let mut arrivals: HashMap<i64, Vec<i64>> = HashMap::new();
    for l in lines(&out) {
        arrivals
            .entry(l["payload"]["key"].as_i64().unwrap())
            .or_default()
            .push(l["payload"]["n"].as_i64().unwrap());
    }
    assert_eq!(arrivals.len(), 100);
    for (key, ns) in &arrivals {
        assert_eq!(
            *ns,
            (1..=50).collect::<Vec<_>>(),
            "key {key} arrived out of order"
        );
    }
    let workers_used: i64 = c
        .query_one("SELECT count(DISTINCT worker_id) FROM outbox.attempts", &[])
        .await
        .unwrap()
        .get(0);
    assert!(workers_used > 1, "several workers took part");
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn messages_the_destination_rejects_are_dead_lettered_with_the_reason() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let good: HashSet<Uuid> = fill(&c, "load", 100, None).await.into_iter().collect();
    let mut bad = HashSet::new();
    for i in 0..5 {
        // Claims to be JSON, is not.
        let id: Uuid = c
            .query_one(
                "SELECT outbox.enqueue('load', convert_to('{{broken ' || $1::text, 'UTF8'), \
                 p_content_type => 'application/json')",
                &[&i.to_string()],
            )
            .await
            .unwrap()
            .get(0);
        bad.insert(id);
    }
    let out = db.scratch_dir().join("out.jsonl");
    let mut w = start(&db, "picky", &file_args(&out));
    eventually(
        MINUTE,
        "everything to be delivered or dead-lettered",
        || async { pending(&c).await == 0 },
    )
    .await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));

    let delivered: HashSet<Uuid> = ids(&lines(&out)).into_iter().collect();
    assert_eq!(
        delivered, good,
        "the good messages are delivered, the bad are not"
    );
    let dead: HashMap<Uuid, String> = dead_letters(&c).await.into_iter().collect();
    assert_eq!(dead.keys().copied().collect::<HashSet<_>>(), bad);
    assert!(
        dead.values().all(|e| e.contains("not valid JSON")),
        "{dead:?}"
    );
    let h = histories(&c).await;
    assert!(bad.iter().all(|id| h[id] == ["1:FAILED:picky"]));
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_config_refuses_to_start_naming_the_setting() {
    let db = TestDb::new().await;
    let dir = db.scratch_dir();
    let toml = dir.join("relay.toml");
    std::fs::write(&toml, "batch_size = 100\nlease_seconds = 30\n").unwrap();
    let destination = |file: &str, table: &str| {
        let path = dir.join(file);
        std::fs::write(
            &path,
            format!("{table}\n[[routes]]\ntopic = \"*\"\ndestination = \"d\"\n"),
        )
        .unwrap();
        path.display().to_string()
    };
    let nats = destination(
        "nats.toml",
        "[destinations.d]\ntype = \"nats\"\nurl = \"nats://bad host:4222\"",
    );
    let amqp = destination(
        "amqp.toml",
        "[destinations.d]\ntype = \"amqp\"\nurl = \"amqp://guest@127.0.0.1:notaport/%2f\"",
    );
    let null = destination(
        "null.toml",
        "[destinations.d]\ntype = \"null\"\nlatency_ms = 86400000",
    );
    let deadline = destination(
        "deadline.toml",
        "[destinations.d]\ntype = \"stdout\"\ntimeout_ms = 0",
    );
    let budget = destination(
        "budget.toml",
        "[destinations.d]\ntype = \"stdout\"\nmax_in_flight = 65",
    );
    let kafka = destination(
        "kafka.toml",
        "[destinations.d]\ntype = \"kafka\"\n[destinations.d.properties]\n\"no.such.property\" = 1",
    );
    let typo = destination(
        "typo.toml",
        "[destinations.d]\ntype = \"redis\"\nstreem = \"s\"",
    );
    // (flags, environment, the setting the error must name)
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (vec![], vec![("OUTBOX_BATCH_SIZE", "0")], "batch_size"),
        (vec!["--lease-secs", "0"], vec![], "lease_secs"),
        (vec!["--sink", "kafka"], vec![], "sink"),
        (vec!["--sink", "file"], vec![], "sink_file"),
        (
            vec!["--retry-multiplier", "0.1"],
            vec![],
            "retry_multiplier",
        ),
        (
            vec!["--telemetry-addr", "not-an-address"],
            vec![],
            "telemetry_addr",
        ),
        (
            vec!["--config", toml.to_str().unwrap()],
            vec![],
            "lease_seconds",
        ),
        (vec!["--batch-size", "many"], vec![], "--batch-size"),
        (
            vec!["--batch-size", "-1"],
            vec![],
            "invalid setting batch_size: -1 is out of range",
        ),
        (
            vec![],
            vec![("OUTBOX_LEASE_SECS", "-5")],
            "invalid setting lease_secs: -5",
        ),
        (
            vec!["--retry-multiplier", "-1"],
            vec![],
            "invalid setting retry_multiplier: -1",
        ),
        (vec!["--config", &nats], vec![], "destinations.d.url"),
        (vec!["--config", &amqp], vec![], "destinations.d.url"),
        (
            vec!["--config", &null],
            vec![],
            "invalid setting destinations.d.latency_ms",
        ),
        (
            vec!["--config", &deadline],
            vec![],
            "invalid setting destinations.d.timeout_ms: 0 is out of range 1..=600000",
        ),
        (
            vec!["--config", &budget],
            vec![],
            "invalid setting destinations.d.max_in_flight: 65 is out of range 1..=64",
        ),
        (
            vec!["--config", &kafka],
            vec![],
            "invalid setting destinations.d.properties.no.such.property: refused by the Kafka client",
        ),
        (vec!["--config", &typo], vec![], "unknown field `streem`"),
    ];
    for (args, env, setting) in cases {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
            .arg("run")
            .args(&args)
            .envs(env.iter().copied())
            .env("DATABASE_URL", &db.url)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success(),
            "{args:?} {env:?} must refuse to start"
        );
        assert!(
            stderr.contains(setting),
            "{args:?} {env:?}: {stderr:?} must name {setting}"
        );
    }
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_database_password_never_reaches_the_logs() {
    let log = std::env::temp_dir().join(format!("outbox-secret-{}.log", std::process::id()));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["run", "--no-telemetry", "--all-topics"])
        .env(
            "DATABASE_URL",
            "postgres://relay:s3cret-pw@127.0.0.1:1/outbox",
        )
        .stderr(std::fs::File::create(&log).unwrap())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let text = || std::fs::read_to_string(&log).unwrap_or_default();
    eventually(
        MINUTE,
        "a failed connection attempt to be logged",
        || async { text().contains("database not ready yet") },
    )
    .await;
    let _ = child.kill();
    let _ = child.wait();
    let logged = text();
    assert!(logged.contains("relay:***@127.0.0.1:1"), "{logged}");
    assert!(
        logged.contains("connection refused (127.0.0.1:1)"),
        "{logged}"
    );
    assert!(!logged.contains("s3cret"), "{logged}");
    let _ = std::fs::remove_file(&log);
}

/// Whether a claim of the worker named by `application_name` that started after `since`
/// (a time of the database's clock) has finished: the worker has looked at the outbox since
/// then, and what was not committed when it looked was not there for it.
async fn looked_since(c: &Client, application_name: &str, since: std::time::SystemTime) -> bool {
    c.query_one(
        "SELECT EXISTS (SELECT FROM pg_stat_activity \
                         WHERE datname = current_database() AND application_name = $1 \
                           AND query LIKE '%outbox.claim_outbox_batch%' \
                           AND state = 'idle' AND query_start > $2)",
        &[&application_name, &since],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_producer_that_shared_a_wake_up_is_picked_up_without_waiting_for_the_poll() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let out = db.scratch_dir().join("recheck.jsonl");
    // Its own application_name, to tell its claims in pg_stat_activity.
    let url = format!("{}?application_name=recheck", db.url);
    let mut w = start(
        &db,
        "recheck",
        &with(
            &file_args(&out),
            &["--poll-interval-ms", "60000", "--database-url", &url],
        ),
    );
    eventually(MINUTE, "the worker to listen", || async {
        let listening: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND query = 'LISTEN outbox_new'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        listening == 1
    })
    .await;

    // Every wake-up window of the next 4 s is taken, as by producers that notify: this
    // producer does not, and commits just after the notification of the window's winner
    // (sent here by hand) made the worker look.
    let windows = db.client().await;
    windows
        .execute(
            "SELECT pg_advisory_lock(hashtext('outbox.wake_relayers'), \
                    ((extract(epoch FROM clock_timestamp()) * 500)::bigint % 2147483647 + w)::integer) \
               FROM generate_series(0, 2000) AS w",
            &[],
        )
        .await
        .unwrap();
    let producer = db.client().await;
    producer.batch_execute("BEGIN").await.unwrap();
    producer
        .execute("SELECT outbox.enqueue('late', '{}'::jsonb)", &[])
        .await
        .unwrap();
    // The notification is sent when this statement commits, after the time it reads.
    let notified: std::time::SystemTime = c
        .query_one("SELECT clock_timestamp(), pg_notify('outbox_new', '')", &[])
        .await
        .unwrap()
        .get(0);
    // Whatever the worker was doing (its start-up looks included), the notification makes
    // it look at once and then recheck for a while: commit as soon as one look has ended,
    // so that only a recheck can find the message before the 60 s poll. The worker's
    // rechecks span about half a second, hence the short polling step.
    let deadline = std::time::Instant::now() + MINUTE;
    while !looked_since(&c, "recheck", notified).await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for the worker to look after the notification"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    producer.batch_execute("COMMIT").await.unwrap();
    let committed = std::time::Instant::now();
    eventually(MINUTE, "the late producer's message", || async {
        lines(&out).len() == 1
    })
    .await;
    assert!(
        committed.elapsed() < Duration::from_secs(10),
        "picked up after {:?}: it waited for the poll",
        committed.elapsed()
    );
    windows
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .unwrap();
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));
    db.finish().await;
}

/// A hot key (3,000 messages behind one head) drains in runs through four processes, one of
/// them killed with SIGKILL and restarted again and again: every message arrives, and none of
/// the key arrives before every earlier one of its key has arrived (a redelivery after a kill
/// may repeat messages, never reorder them).
#[tokio::test(flavor = "multi_thread")]
async fn a_hot_key_keeps_its_order_through_four_workers_and_kills() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let out = db.scratch_dir().join("hot.jsonl");
    let args = with(
        &file_args(&out),
        &[
            "--lease-secs",
            "3",
            "--repair-interval-secs",
            "1",
            "--batch-size",
            "200",
            "--poll-interval-ms",
            "20",
        ],
    );
    c.execute(
        "INSERT INTO outbox.messages (topic, message_key, payload) \
         SELECT 'hot', CASE WHEN n % 2 = 0 THEN 'hot' END, \
                convert_to(json_build_object('n', n)::text, 'UTF8') \
           FROM generate_series(1, 6000) AS n ORDER BY n",
        &[],
    )
    .await
    .unwrap();
    let mut names: Vec<String> = (0..4).map(|i| format!("hot-{i}")).collect();
    let mut workers: Vec<Relayer> = names.iter().map(|name| start(&db, name, &args)).collect();
    for round in 0..6 {
        // Each kill hits a worker while it holds leases (unless the outbox drained first).
        let victim = round % 4;
        eventually(MINUTE, "the next victim to hold leases", || async {
            !leases_of(&c, &names[victim]).await.is_empty() || pending(&c).await == 0
        })
        .await;
        workers[victim].signal("KILL");
        assert_eq!(workers[victim].exit_code(MINUTE).await, None);
        names[victim] = format!("hot-{victim}-{round}");
        workers[victim] = start(&db, &names[victim], &args);
    }
    eventually(3 * MINUTE, "6000 messages to drain", || async {
        pending(&c).await == 0
    })
    .await;
    // A worker restarted last may still be starting: its first log line comes after its
    // signal handler is installed, so SIGTERM then means a graceful stop.
    for w in &workers {
        eventually(MINUTE, "each worker to be up", || async {
            !w.log_text().is_empty()
        })
        .await;
    }
    for w in &workers {
        w.signal("TERM");
    }
    for w in &mut workers {
        assert_eq!(w.exit_code(MINUTE).await, Some(0));
    }
    // A batch is one append; a worker killed in the middle of one may leave a partial line.
    let text = std::fs::read_to_string(&out).unwrap();
    let arrivals: Vec<i64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|l| l["payload"]["n"].as_i64().unwrap())
        .collect();
    let mut seen: HashSet<i64> = HashSet::new();
    for n in &arrivals {
        if n % 2 == 0 {
            assert!(
                *n == 2 || seen.contains(&(n - 2)),
                "hot message {n} arrived before message {} of its key",
                n - 2
            );
        }
        seen.insert(*n);
    }
    assert_eq!(seen.len(), 6000, "every message arrived");
    let workers_used: i64 = c
        .query_one(
            "SELECT count(DISTINCT worker_id) FROM outbox.attempts WHERE state = 'DISPATCHED'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(workers_used > 1, "several workers took part");
    db.finish().await;
}

/// A `[destinations.d]` file destination at `path` with one route, `topic`.
fn routed_to_file(db: &TestDb, name: &str, topic: &str, path: &std::path::Path) -> String {
    let config = db.scratch_dir().join(format!("{name}.toml"));
    std::fs::write(
        &config,
        format!(
            "[destinations.d]\ntype = \"file\"\npath = \"{}\"\n\n[[routes]]\ntopic = \"{topic}\"\ndestination = \"d\"\n",
            path.display()
        ),
    )
    .unwrap();
    config.display().to_string()
}

/// Item 7 of issue 55: a relayer whose routes cover only `u.*` claims only those topics;
/// the 5 messages of `slow.topic` stay pending, unleased and unattempted, and are named as
/// claimed by no running relayer once ready for longer than the bound (the gauge, the
/// `status` line), until a relayer that covers them delivers them.
#[tokio::test(flavor = "multi_thread")]
async fn a_narrow_relayer_leaves_the_topics_it_does_not_cover_to_the_relayer_that_does() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let slow: HashSet<Uuid> = fill(&c, "slow.topic", 5, None).await.into_iter().collect();
    let covered: HashSet<Uuid> = fill(&c, "u.created", 5, None).await.into_iter().collect();
    let u_out = db.scratch_dir().join("u.jsonl");
    let narrow_config = routed_to_file(&db, "narrow", "u.*", &u_out);
    let telemetry = format!("127.0.0.1:{}", free_port());
    let mut narrow = Relayer::start(
        &db,
        "narrow",
        &[
            "--config",
            &narrow_config,
            "--poll-interval-ms",
            "50",
            "--observe-interval-secs",
            "1",
            "--observe-uncovered-secs",
            "1",
            "--telemetry-addr",
            &telemetry,
        ],
    );
    eventually(MINUTE, "the covered topic delivered", || async {
        pending(&c).await == 5
    })
    .await;
    // The sleep is the behaviour: some twenty polls of the narrow relayer over the rest.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let left = c
        .query_one(
            "SELECT count(*) FILTER (WHERE topic = 'slow.topic' AND lease_token IS NULL \
                                       AND attempt_count = 0), count(*) \
               FROM outbox.messages",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((left.get::<_, i64>(0), left.get::<_, i64>(1)), (5, 5));
    assert!(dead_letters(&c).await.is_empty());
    assert_eq!(
        ids(&lines(&u_out)).into_iter().collect::<HashSet<_>>(),
        covered
    );
    // Named once ready for longer than the bound: the gauge, and status's line.
    eventually(MINUTE, "the uncovered topic's gauge", || async {
        narrow.metric("outbox_uncovered_ready_messages").await == Some(5.0)
    })
    .await;
    let status = |bound: &'static str| {
        let out = common::verb(&["status", "--uncovered-secs", bound], &db.url);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let named = status("1");
    assert!(
        named.contains("uncovered: topic \"slow.topic\": 5 ready")
            && !named.contains("uncovered: topic \"u."),
        "{named}"
    );
    assert!(!status("3600").contains("uncovered:"));

    let slow_out = db.scratch_dir().join("slow.jsonl");
    let wide_config = routed_to_file(&db, "wide", "slow.*", &slow_out);
    let mut wide = Relayer::start(&db, "wide", &["--config", &wide_config, "--no-telemetry"]);
    eventually(MINUTE, "the other topic delivered", || async {
        pending(&c).await == 0
    })
    .await;
    assert_eq!(
        ids(&lines(&slow_out)).into_iter().collect::<HashSet<_>>(),
        slow
    );
    eventually(MINUTE, "the gauge back to 0", || async {
        narrow.metric("outbox_uncovered_ready_messages").await == Some(0.0)
    })
    .await;
    let h = histories(&c).await;
    for id in &slow {
        assert_eq!(h[id], ["1:DISPATCHED:wide"], "{id}");
    }
    for w in [&mut narrow, &mut wide] {
        w.signal("TERM");
        assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());
    }
    db.finish().await;
}

/// A `null` (or `stdout`) sink taking every topic would swallow what other relayers are
/// there to deliver: `run` refuses it, naming the flag, unless `--all-topics` says so.
#[tokio::test(flavor = "multi_thread")]
async fn a_catch_all_null_sink_is_refused_without_all_topics_and_claims_all_with_it() {
    let db = TestDb::new().await;
    let c = db.client().await;
    fill(&c, "a", 3, None).await;
    fill(&c, "b", 3, None).await;
    for sink in ["null", "stdout"] {
        let out = common::verb(&["run", "--sink", sink, "--no-telemetry"], &db.url);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{sink}: {stderr}");
        assert!(
            stderr.contains("all_topics")
                && stderr.contains(&format!("the {sink} sink would take every topic"))
                && stderr.contains("add --all-topics"),
            "{sink}: {stderr}"
        );
    }
    assert_eq!(pending(&c).await, 6, "the refused relayers claimed nothing");
    assert_eq!(
        common::count(&c, "SELECT count(*) FROM outbox.attempts").await,
        0
    );

    let mut w = Relayer::start(
        &db,
        "all",
        &["--sink", "null", "--all-topics", "--no-telemetry"],
    );
    eventually(MINUTE, "every topic delivered", || async {
        pending(&c).await == 0
    })
    .await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());
    db.finish().await;
}

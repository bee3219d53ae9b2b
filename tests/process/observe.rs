//! The fleet gauges and the MVCC watchdog against a real database: figures per topic with
//! the rest as `other`, one refresh per interval for the fleet, and a session idle in
//! transaction found, named and cleared by a running relayer (its /metrics, /debug/health
//! and `status`, with well-formed JSON logs); `status` showing each destination's circuit
//! as relayer processes report it (open while the destination is down, closed once it is
//! back, stale once a killed relayer stops renewing), when delayed messages are due, and the
//! key order rules once one is set.

use crate::common;

use std::time::{Duration, Instant};

use common::{Relayer, TestDb, eventually, free_port, text, verb};
use outbox_relay::observe::fetch;
use outbox_relay::probes::probe;

const MINUTE: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread")]
async fn fleet_gauges_count_each_state_per_topic_and_sum_the_rest_as_other() {
    let db = TestDb::new().await;
    let c = db.client().await;
    common::fill(&c, "alpha", 5, None).await;
    common::fill(&c, "beta", 3, None).await;
    c.batch_execute(
        "SELECT outbox.enqueue('beta', '{}'::jsonb, NULL, '{}', now() + interval '1 hour') \
           FROM generate_series(1, 2);
         SELECT outbox.enqueue('gamma', '{}'::jsonb) FROM generate_series(1, 3);
         -- one expired and one live lease on gamma
         UPDATE outbox.messages SET claimed_by = 'w', lease_token = gen_random_uuid(),
                lease_expires_at = now() - interval '1 second'
          WHERE seq = (SELECT min(seq) FROM outbox.messages WHERE topic = 'gamma');
         UPDATE outbox.messages SET claimed_by = 'w', lease_token = gen_random_uuid(),
                lease_expires_at = now() + interval '1 hour'
          WHERE seq = (SELECT max(seq) FROM outbox.messages WHERE topic = 'gamma');
         INSERT INTO outbox.dead_letters (outbox_id, topic, payload, content_type, headers,
                                          created_at, attempt_count, max_attempts, last_error)
         VALUES (gen_random_uuid(), 'delta', '\\x7b7d', 'application/json', '{}', now(), 3, 3, 'HTTP 500');
         INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token)
         SELECT gen_random_uuid(), 1, s, 'w', gen_random_uuid()
           FROM unnest('{DISPATCHED,DISPATCHED,RETRYABLE}'::outbox.attempt_state[]) AS s;",
    )
    .await
    .unwrap();

    let o = outbox_relay::observe::fetch(&db.store(), 2, Duration::ZERO)
        .await
        .unwrap()
        .expect("an observation");
    assert!(o.refreshed);
    let topics: Vec<(&str, i64, i64, i64, i64, i64)> = o
        .snapshot
        .topics
        .iter()
        .map(|t| {
            (
                t.topic.as_str(),
                t.ready,
                t.delayed,
                t.in_flight,
                t.expired_leases,
                t.dead_letters,
            )
        })
        .collect();
    // alpha and beta have the largest backlogs (5 each); gamma and delta are `other`.
    assert_eq!(
        topics,
        vec![
            ("alpha", 5, 0, 0, 0, 0),
            ("beta", 3, 2, 0, 0, 0),
            ("other", 1, 0, 1, 1, 1),
        ]
    );
    assert!(o.snapshot.topics[0].oldest_ready_age_seconds.unwrap() >= 0.0);
    assert_eq!(o.snapshot.attempts_last_minute.get("DISPATCHED"), Some(&2));
    assert_eq!(o.snapshot.attempts_last_minute.get("RETRYABLE"), Some(&1));
    assert!(o.snapshot.messages_table.is_some());

    let text = outbox_relay::observe::render(&o, Duration::from_secs(300));
    for line in [
        "outbox_backlog_messages{topic=\"beta\",state=\"delayed\"} 2",
        "outbox_backlog_messages{topic=\"other\",state=\"expired_lease\"} 1",
        "outbox_dead_letters{topic=\"other\"} 1",
        "outbox_attempts_last_minute{state=\"RETRYABLE\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
    }
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn one_caller_refreshes_per_interval_and_a_taken_turn_is_not_waited_for() {
    let db = TestDb::new().await;
    let store = db.store();
    let first = fetch(&store, 10, MINUTE).await.unwrap().unwrap();
    assert!(first.refreshed);
    let second = fetch(&store, 10, MINUTE).await.unwrap().unwrap();
    assert!(
        !second.refreshed,
        "a fresh snapshot is read, not recomputed"
    );
    assert_eq!(second.observed_at, first.observed_at);

    // Another process is refreshing (it holds the turn): the caller gets the previous
    // snapshot at once instead of queueing behind it.
    let mut holder = db.client().await;
    let tx = holder.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM outbox.turns WHERE name = 'observe' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    let third = tokio::time::timeout(Duration::from_secs(5), fetch(&store, 10, Duration::ZERO))
        .await
        .expect("observe does not wait for the turn")
        .unwrap()
        .unwrap();
    assert!(!third.refreshed);
    assert_eq!(third.observed_at, first.observed_at);
    tx.rollback().await.unwrap();
    assert!(
        fetch(&store, 10, Duration::ZERO)
            .await
            .unwrap()
            .unwrap()
            .refreshed
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_idle_in_transaction_session_is_named_within_a_refresh_and_cleared_when_it_ends() {
    let db = TestDb::new().await;
    let addr = format!("127.0.0.1:{}", free_port());
    let interval = Duration::from_secs(1);
    let threshold = Duration::from_secs(2);
    let relayer = Relayer::start(
        &db,
        "watchdog",
        &[
            "--sink",
            "null",
            "--telemetry-addr",
            &addr,
            "--log-format",
            "json",
            "--observe-interval-secs",
            "1",
            "--horizon-warn-secs",
            "2",
        ],
    );
    eventually(MINUTE, "the first observation", || async {
        probe(&addr, "/debug/health")
            .await
            .is_ok_and(|(_, body)| body.contains("\"status\":\"ok\""))
    })
    .await;

    // A report that opened a repeatable-read transaction, read, and went idle: its
    // snapshot pins the horizon.
    let holder = common::connect(&format!("{}?application_name=nightly-report", db.url))
        .await
        .unwrap();
    holder
        .batch_execute(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; \
             SELECT count(*) FROM outbox.messages WHERE topic = 'report'",
        )
        .await
        .unwrap();
    let began = Instant::now();
    let pid: i32 = holder
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);

    let named = format!("session pid {pid} (nightly-report), idle in transaction");
    eventually(MINUTE, "/debug/health to name the session", || async {
        probe(&addr, "/debug/health")
            .await
            .is_ok_and(|(_, body)| body.contains(&named))
    })
    .await;
    // Named once it is past the threshold, within one refresh interval (plus scheduling
    // slack on a loaded machine).
    let found_after = began.elapsed();
    assert!(
        found_after <= threshold + interval + Duration::from_secs(3),
        "found after {found_after:?}"
    );
    let (_, health) = probe(&addr, "/debug/health").await.unwrap();
    let health: serde_json::Value = serde_json::from_str(&health).unwrap();
    assert_eq!(health["status"], "degraded");
    let advice = health["problems"][0]["advice"].as_str().unwrap();
    assert!(
        advice.contains(&format!("pg_terminate_backend({pid})")),
        "{advice}"
    );
    let (ready, _) = probe(&addr, "/readyz").await.unwrap();
    assert_eq!(ready, 200, "the relayer is not the culprit: it stays ready");

    let (_, metrics) = probe(&addr, "/metrics").await.unwrap();
    let culprit = format!(
        "outbox_mvcc_horizon_culprit_age_seconds{{kind=\"session\",pid=\"{pid}\",\
         name=\"nightly-report\",state=\"idle in transaction\"}}"
    );
    assert!(metrics.contains(&culprit), "no {culprit} in\n{metrics}");

    let status = verb(&["status", "--horizon-warn-secs", "2"], &db.url);
    let status_text = text(&status.stdout);
    assert!(status.status.success(), "{}", text(&status.stderr));
    assert!(status_text.contains(&named), "{status_text}");
    assert!(status_text.contains("what to do: end it"), "{status_text}");

    // Three more refreshes (each moves the observation's timestamp on /metrics): the
    // culprit stays one problem and one series, the same session, older at each refresh.
    let culprit_age = |metrics: &str| -> Vec<f64> {
        metrics
            .lines()
            .filter(|l| l.starts_with(&culprit))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect()
    };
    let first_age = culprit_age(&metrics);
    assert_eq!(first_age.len(), 1, "{metrics}");
    let observed_at = || async {
        common::metric(&addr, "outbox_observation_timestamp_seconds")
            .await
            .expect("/metrics answers")
    };
    let mut last = observed_at().await;
    let mut refreshes = 0;
    let deadline = Instant::now() + MINUTE;
    while refreshes < 3 {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for 3 refreshes; {refreshes} seen"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = observed_at().await;
        if now != last {
            refreshes += 1;
            last = now;
        }
    }
    let (_, metrics) = probe(&addr, "/metrics").await.unwrap();
    let later_age = culprit_age(&metrics);
    assert_eq!(later_age.len(), 1, "one series for the culprit:\n{metrics}");
    assert!(
        later_age[0] > first_age[0],
        "the same culprit, held longer: {first_age:?} then {later_age:?}"
    );
    let (_, health) = probe(&addr, "/debug/health").await.unwrap();
    let health: serde_json::Value = serde_json::from_str(&health).unwrap();
    assert_eq!(
        health["problems"].as_array().map(Vec::len),
        Some(1),
        "{health}"
    );

    holder.batch_execute("COMMIT").await.unwrap();
    eventually(MINUTE, "the warning to clear", || async {
        probe(&addr, "/debug/health")
            .await
            .is_ok_and(|(_, body)| body.contains("\"status\":\"ok\""))
    })
    .await;
    let (_, metrics) = probe(&addr, "/metrics").await.unwrap();
    assert!(!metrics.contains(&culprit), "{metrics}");

    // JSON logs carry numbers as numbers, and no Rust Debug renderings; the watchdog's
    // events about the session are among them.
    let log = relayer.log_text();
    let about_it = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["pid"] == pid)
        .count();
    assert!(about_it > 0, "no event carries pid {pid}:\n{log}");
    for line in log.lines() {
        let event: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        for (key, value) in event.as_object().unwrap() {
            if key == "pid"
                || key.ends_with("_ms")
                || key.ends_with("_secs")
                || key == "age_seconds"
            {
                assert!(value.is_number(), "{key} is not a number in {line}");
            }
            if let Some(s) = value.as_str() {
                for debug in ["Some(", "None", "Duration", "{ ", "Ok(", "Err("] {
                    assert!(
                        !s.contains(debug),
                        "{key} looks like Debug output in {line}"
                    );
                }
            }
        }
    }
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn status_shows_topics_filters_one_and_watches_with_rates() {
    let db = TestDb::new().await;
    let c = db.client().await;
    common::fill(&c, "orders", 4, None).await;
    common::fill(&c, "emails", 2, None).await;

    let out = verb(&["status"], &db.url);
    let shown = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let row = |name: &str| {
        shown
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .map(|l| l.split_whitespace().take(2).collect::<Vec<_>>().join(" "))
    };
    assert_eq!(row("orders").as_deref(), Some("orders 4"), "{shown}");
    assert_eq!(row("emails").as_deref(), Some("emails 2"), "{shown}");
    assert_eq!(row("total").as_deref(), Some("total 6"), "{shown}");
    assert!(shown.contains("health: ok"), "{shown}");

    let out = verb(&["status", "--topic", "emails", "--json"], &db.url);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["ready"], 2);
    assert_eq!(json["topics"].as_array().unwrap().len(), 1);
    assert_eq!(json["topics"][0]["topic"], "emails");
    assert_eq!(json["problems"], serde_json::json!([]));

    // Not a terminal: plain blocks, one per second, each with the fleet's rates.
    let mut watch = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["status", "--watch"])
        .env("DATABASE_URL", &db.url)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = watch.stdout.take().unwrap();
    let blocks = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        let mut rates = Vec::new();
        for line in std::io::BufReader::new(stdout).lines() {
            let line = line.unwrap();
            if line.starts_with("fleet, last minute:") {
                rates.push(line);
                if rates.len() == 3 {
                    break;
                }
            }
        }
        rates
    })
    .await
    .unwrap();
    let _ = watch.kill();
    let _ = watch.wait();
    assert_eq!(blocks.len(), 3);
    // Nothing moves here: rates below one a second are shown as counts per minute.
    assert!(blocks[0].contains("0/min delivered"), "{blocks:?}");
    assert!(
        blocks[2].contains("backlog +0/min"),
        "the second and later blocks carry the backlog's rate: {blocks:?}"
    );
    db.finish().await;
}

/// `status --json`'s circuits: (destination, state, stale, the workers that reported it).
fn circuits_shown(db: &TestDb) -> Vec<(String, String, bool, Vec<String>)> {
    let out = verb(&["status", "--json"], &db.url);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json["circuits"]
        .as_array()
        .unwrap_or_else(|| panic!("status --json has no circuits: {json}"))
        .iter()
        .map(|c| {
            (
                c["destination"].as_str().unwrap().to_owned(),
                c["state"].as_str().unwrap().to_owned(),
                c["stale"].as_bool().unwrap(),
                c["workers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|w| w["worker_id"].as_str().unwrap().to_owned())
                    .collect(),
            )
        })
        .collect()
}

fn circuit(state: &str, stale: bool, workers: &[&str]) -> (String, String, bool, Vec<String>) {
    (
        "hooks".to_owned(),
        state.to_owned(),
        stale,
        workers.iter().map(|w| (*w).to_owned()).collect(),
    )
}

/// `status`'s text line of destination `hooks` in `state`.
fn circuit_line(db: &TestDb, state: &str) -> Option<String> {
    let out = verb(&["status"], &db.url);
    text(&out.stdout)
        .lines()
        .find(|l| l.starts_with("hooks ") && l.split_whitespace().nth(1) == Some(state))
        .map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread")]
async fn status_shows_each_destinations_circuit_as_the_relayers_last_reported_it() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // An HTTP destination on a port nothing listens on yet: down.
    let held = common::ClosedPort::new();
    let port = held.port;
    let config = db.scratch_dir().join("hooks.toml");
    std::fs::write(
        &config,
        format!(
            "[destinations.hooks]\ntype = \"http\"\nurl = \"http://127.0.0.1:{port}/\"\n\
             [[routes]]\ntopic = \"*\"\ndestination = \"hooks\"\n"
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let args = [
        "--config",
        &config,
        "--no-telemetry",
        "--batch-size",
        "1",
        "--circuit-failures",
        "1",
        "--circuit-cooldown-ms",
        "2000",
        "--retry-base-ms",
        "10",
    ];
    let mut first = Relayer::start(&db, "relay-a", &args);
    let mut second = Relayer::start(&db, "relay-b", &args);
    eventually(
        MINUTE,
        "both relayers to report a closed circuit",
        || async { circuits_shown(&db) == [circuit("closed", false, &["relay-a", "relay-b"])] },
    )
    .await;

    common::fill(&c, "orders", 20, None).await;
    eventually(
        MINUTE,
        "both relayers to report the circuit open",
        || async { circuits_shown(&db) == [circuit("open", false, &["relay-a", "relay-b"])] },
    )
    .await;
    eventually(MINUTE, "status to show the circuit open", || async {
        circuit_line(&db, "open").is_some_and(|l| l.ends_with("relay-a, relay-b"))
    })
    .await;

    // The destination is back: each relayer's next probe closes its circuit.
    let listener = held.listen();
    let app = axum::Router::new().fallback(|| async { axum::http::StatusCode::OK });
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    eventually(
        MINUTE,
        "both relayers to report the circuit closed",
        || async {
            // A message for each relayer's probe: the other may have drained the rest.
            common::fill(&c, "orders", 2, None).await;
            circuits_shown(&db) == [circuit("closed", false, &["relay-a", "relay-b"])]
        },
    )
    .await;
    let line = circuit_line(&db, "closed").expect("a closed line");
    assert!(line.ends_with("relay-a, relay-b"), "{line}");

    // A relayer killed renews nothing: once its report expired (aged here instead of
    // waiting out its 90 s), it is shown stale, apart from the live ones.
    first.signal("KILL");
    first.exit_code(MINUTE).await;
    c.batch_execute(
        "UPDATE outbox.circuit_reports SET expires_at = now() - interval '1 second' \
         WHERE worker_id = 'relay-a'",
    )
    .await
    .unwrap();
    assert_eq!(
        circuits_shown(&db),
        [
            circuit("closed", false, &["relay-b"]),
            circuit("closed", true, &["relay-a"])
        ]
    );
    let out = text(&verb(&["status"], &db.url).stdout);
    assert!(
        out.lines().any(|l| l.starts_with("hooks ")
            && l.contains("closed (stale)")
            && l.contains("relay-a (not renewed; expired ")),
        "{out}"
    );
    // A relayer stopping cleanly takes its reports with it.
    second.signal("TERM");
    assert_eq!(second.exit_code(MINUTE).await, Some(0));
    assert_eq!(circuits_shown(&db), [circuit("closed", true, &["relay-a"])]);
    server.abort();
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn status_shows_when_the_first_delayed_message_of_a_topic_is_due() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "SELECT outbox.enqueue('later', '{}'::jsonb, p_available_at => now() + interval '90 seconds');
         SELECT outbox.enqueue('later', '{}'::jsonb, p_available_at => now() + interval '1 day');
         SELECT outbox.enqueue('parked', '{}'::jsonb, p_available_at => 'infinity');",
    )
    .await
    .unwrap();
    let asked = chrono::Utc::now();
    let out = verb(&["status", "--json"], &db.url);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let topic = |name: &str| {
        json["topics"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["topic"] == name)
            .unwrap_or_else(|| panic!("{name} in {json}"))
            .clone()
    };
    let due: chrono::DateTime<chrono::Utc> = topic("later")["next_due_at"]
        .as_str()
        .unwrap_or_else(|| panic!("later has a due time: {json}"))
        .parse()
        .unwrap();
    let in_secs = (due - asked).num_milliseconds() as f64 / 1000.0;
    assert!(
        (80.0..=90.0).contains(&in_secs),
        "the earlier one, due 90 s after it was enqueued: {in_secs} s"
    );
    assert_eq!(topic("parked")["next_due_at"], serde_json::Value::Null);
    assert_eq!(json["next_due_at"], topic("later")["next_due_at"], "{json}");

    let out = verb(&["status"], &db.url);
    let shown = text(&out.stdout);
    let due_column = |name: &str| {
        shown
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .and_then(|l| l.rsplit("  ").next())
            .map(str::trim)
            .map(str::to_owned)
    };
    assert!(
        due_column("later").is_some_and(|d| d.starts_with("in ")),
        "{shown}"
    );
    assert_eq!(due_column("parked").as_deref(), Some("-"), "{shown}");
    db.finish().await;
}

/// Item 2 of issue 55, the case it reports: `orders.dead` routed to a destination that is
/// down and `orders.live` to one that is up, five keys with a message on `orders.dead`
/// before ten on `orders.live`. The unkeyed `orders.live` messages are delivered; the keyed
/// ones wait behind their key's head by per-key order, and the relayer says why: the
/// held-topic gauges name `orders.dead` with its 5 keys, its log names the topic, the
/// destination and the held topic, and `status` has a line saying the same. Once the
/// destination is back, everything is delivered in key order and the gauges go back to 0.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_held_behind_a_topic_whose_destination_is_down_is_named_with_the_blocking_topic() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let held = common::ClosedPort::new();
    let port = held.port;
    let live_out = db.scratch_dir().join("live.jsonl");
    let config = db.scratch_dir().join("held.toml");
    std::fs::write(
        &config,
        format!(
            "[destinations.down]\ntype = \"http\"\nurl = \"http://127.0.0.1:{port}/\"\n\
             [destinations.live]\ntype = \"file\"\npath = \"{}\"\n\
             [[routes]]\ntopic = \"orders.dead\"\ndestination = \"down\"\n\
             [[routes]]\ntopic = \"orders.live\"\ndestination = \"live\"\n",
            live_out.display()
        ),
    )
    .unwrap();
    for k in 0..5 {
        let key = format!("order-{k}");
        c.execute(
            "SELECT outbox.enqueue('orders.dead', '{}'::jsonb, $1)",
            &[&key],
        )
        .await
        .unwrap();
        c.execute(
            "SELECT outbox.enqueue('orders.live', jsonb_build_object('n', n), $1) \
               FROM generate_series(1, 10) AS n",
            &[&key],
        )
        .await
        .unwrap();
    }
    common::fill(&c, "orders.live", 10, None).await;

    let config = config.display().to_string();
    let telemetry = format!("127.0.0.1:{}", free_port());
    let mut relayer = Relayer::start(
        &db,
        "relay-held",
        &[
            "--config",
            &config,
            "--telemetry-addr",
            &telemetry,
            "--poll-interval-ms",
            "50",
            "--circuit-failures",
            "1",
            "--circuit-cooldown-ms",
            "3000",
            "--retry-base-ms",
            "10",
            "--observe-interval-secs",
            "1",
            "--observe-uncovered-secs",
            "1",
        ],
    );
    eventually(MINUTE, "the unkeyed live messages delivered", || async {
        live_out.exists() && lines_in(&live_out) >= 10
    })
    .await;
    eventually(MINUTE, "the held keys' gauge", || async {
        relayer.metric("outbox_circuit_held_keys").await == Some(5.0)
    })
    .await;
    // Only the unkeyed ones went: each keyed live message waits behind its key's head.
    assert_eq!(lines_in(&live_out), 10);
    let ready = relayer
        .metric("outbox_circuit_held_ready_messages")
        .await
        .unwrap();
    assert!((1.0..=5.0).contains(&ready), "{ready}");
    assert_eq!(
        relayer.metric("outbox_uncovered_held_keys").await,
        Some(0.0)
    );

    let out = verb(&["status", "--uncovered-secs", "1"], &db.url);
    assert!(out.status.success(), "{out:?}");
    let status = text(&out.stdout);
    let line = status
        .lines()
        .find(|l| l.starts_with("held by an open circuit: topic \"orders.dead\": "))
        .unwrap_or_else(|| panic!("no held line: {status}"));
    assert!(
        line.contains("while the circuit of down is open")
            && line.contains("it holds 5 key(s) whose messages on orders.live wait behind it"),
        "{line}"
    );
    let json = text(&verb(&["status", "--json", "--uncovered-secs", "1"], &db.url).stdout);
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    let held_topics = &json["circuit_held_topics"];
    assert_eq!(held_topics[0]["topic"], "orders.dead", "{json}");
    assert_eq!(held_topics[0]["destinations"], serde_json::json!(["down"]));
    assert_eq!(held_topics[0]["held_keys"], 5);
    assert_eq!(json["uncovered_topics"], serde_json::json!([]));
    let log = relayer.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("topic held behind an open circuit")
                && l.contains("orders.dead")
                && l.contains("down")
                && l.contains("orders.live")),
        "{log}"
    );

    // The destination is back: the next probe closes the circuit and every key drains.
    let listener = held.listen();
    let app = axum::Router::new().fallback(|| async { axum::http::StatusCode::OK });
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    eventually(MINUTE, "every message delivered", || async {
        common::pending(&c).await == 0
    })
    .await;
    assert_eq!(lines_in(&live_out), 60);
    // Each key's live messages arrived in enqueue order (n counts up from 1).
    let mut last: std::collections::HashMap<String, i64> = std::collections::HashMap::new();
    for line in std::fs::read_to_string(&live_out).unwrap().lines() {
        let m: serde_json::Value = serde_json::from_str(line).unwrap();
        if let Some(key) = m["key"].as_str() {
            let n = m["payload"]["n"].as_i64().unwrap();
            let before = last.insert(key.to_owned(), n).unwrap_or(0);
            assert_eq!(n, before + 1, "{key}: {n} after {before}");
        }
    }
    assert_eq!(last.len(), 5);
    assert!(last.values().all(|n| *n == 10), "{last:?}");
    eventually(MINUTE, "the held keys' gauge back to 0", || async {
        relayer.metric("outbox_circuit_held_keys").await == Some(0.0)
    })
    .await;
    assert!(
        !text(&verb(&["status", "--uncovered-secs", "1"], &db.url).stdout)
            .contains("held by an open circuit")
    );
    relayer.signal("TERM");
    assert_eq!(relayer.exit_code(MINUTE).await, Some(0));
    server.abort();
    db.finish().await;
}

/// The lines of a JSONL file written so far.
fn lines_in(path: &std::path::Path) -> usize {
    std::fs::read_to_string(path)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn status_shows_the_key_order_rules_once_one_is_set() {
    let db = TestDb::new().await;
    // the login that sets the rules, as key-order connects
    let login: String = db
        .client()
        .await
        .query_one("SELECT session_user::text", &[])
        .await
        .unwrap()
        .get(0);
    let key_order_lines = |shown: &str| -> Vec<String> {
        shown
            .lines()
            .filter(|l| l.starts_with("key order:"))
            .map(str::to_owned)
            .collect()
    };
    let out = verb(&["status"], &db.url);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert_eq!(
        key_order_lines(&shown),
        Vec::<String>::new(),
        "no rule, no line: {shown}"
    );

    for (pattern, scope) in [("orders.*", "topic"), ("orders.audit", "global")] {
        let out = verb(&["key-order", "set", pattern, scope], &db.url);
        assert!(out.status.success(), "{out:?}");
    }
    let out = verb(&["status"], &db.url);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    let lines = key_order_lines(&shown);
    let heads: Vec<String> = lines
        .iter()
        .map(|l| l.split(" (").next().unwrap().to_owned())
        .collect();
    assert_eq!(
        heads,
        [
            "key order: orders.audit global",
            "key order: orders.* topic",
            "key order: default global",
        ],
        "a line per rule, most specific first, then the default: {shown}"
    );
    assert!(
        lines[1].contains("keys ordered per topic; set ")
            && lines[1].ends_with(&format!(" by {login})")),
        "{}",
        lines[1]
    );

    let out = verb(&["status", "--json"], &db.url);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let key_order = &json["key_order"];
    assert_eq!(key_order["default"], "global", "{json}");
    let rules: Vec<(&str, &str, &str)> = key_order["rules"]
        .as_array()
        .unwrap_or_else(|| panic!("status --json has no key order rules: {json}"))
        .iter()
        .map(|r| {
            (
                r["pattern"].as_str().unwrap(),
                r["topic_pattern"].as_str().unwrap(),
                r["scope"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rules,
        [
            ("orders.audit", "orders.audit", "global"),
            ("orders.*", "orders.%", "topic")
        ]
    );
    assert_eq!(key_order["rules"][0]["set_by"], login.as_str());
    db.finish().await;
}

//! The dispatch layer between the relay and the destinations, seen from outside: routes,
//! circuits, per-destination budgets and deadlines, panics, and the metrics they report.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use outbox_relay::config::{RawConfig, Settings};
use outbox_relay::destination::{Destination, Window};
use outbox_relay::dispatch::Dispatcher;
use outbox_relay::message::{ClaimedMessage, Outcome};
use outbox_relay::relay::Relay;
use uuid::Uuid;

use crate::common::{self, Relayer, TestDb, eventually, pending};
use crate::http::{Hooks, relayer};
use crate::{CIRCUIT_STATE, CLOSED, MINUTE, circuit_opens, drained, histories};

#[tokio::test(flavor = "multi_thread")]
async fn an_outage_costs_one_attempt_per_failure_and_probe_and_no_message_two() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let hooks = Hooks::serve().await;
    hooks.seen.lock().unwrap().down = true;
    let telemetry = format!("127.0.0.1:{}", common::free_port());
    // Defaults otherwise: batch 500, 3 batches in flight.
    let flags = [
        "--telemetry-addr",
        &telemetry,
        "--circuit-failures",
        "5",
        "--circuit-cooldown-ms",
        "1000",
    ];
    let mut w = relayer(&db, "outage", &hooks.url(), "", &flags);
    let all: HashSet<Uuid> = common::fill(&c, "orders", 3000, None)
        .await
        .into_iter()
        .collect();
    let outage = std::time::Instant::now();
    circuit_opens(&w).await;
    // The sleep is the behaviour: an outage of 8 s of a real process's time, over which the
    // attempts below are counted (one half-open probe per 1 s cool-down).
    tokio::time::sleep(Duration::from_secs(8)).await;
    let (status, body) = outbox_relay::probes::probe(&telemetry, "/readyz")
        .await
        .unwrap();
    assert_eq!(
        status, 200,
        "an outage is reported, not unreadiness: {body}"
    );
    assert!(body.contains("destination hooks: down"), "{body}");

    let r = c
        .query_one(
            "SELECT coalesce(sum(n), 0)::bigint, coalesce(max(n), 0)::int \
             FROM (SELECT count(*) AS n FROM outbox.attempts GROUP BY outbox_id) AS a",
            &[],
        )
        .await
        .unwrap();
    let (attempts, most): (i64, i32) = (r.get(0), r.get(1));
    let probes = i64::try_from(outage.elapsed().as_secs()).unwrap() + 1;
    assert!(
        (5..=5 + probes).contains(&attempts),
        "{attempts} attempts in a {probes} s outage (5 failures to open + one per probe)"
    );
    assert_eq!(most, 1, "no message gets two attempts from one outage");
    // Open, then half-open after each cool-down: the attempts past the 5 that opened it are
    // the probes.
    assert!(
        attempts > 5,
        "a probe after a cool-down: {attempts} attempts"
    );

    hooks.seen.lock().unwrap().down = false;
    drained(&c).await;
    assert_eq!(
        w.metric(CIRCUIT_STATE).await,
        Some(CLOSED),
        "the circuit closed once the server was back"
    );
    assert_eq!(hooks.delivered("orders"), all);
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_topic_no_route_takes_is_left_to_other_relayers() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let out = db.scratch_dir().join("orders.jsonl");
    let config = db.scratch_dir().join("routes.toml");
    std::fs::write(
        &config,
        format!(
            "[destinations.files]\ntype = \"file\"\npath = \"{}\"\n\n\
             [[routes]]\ntopic = \"orders.*\"\ndestination = \"files\"\n",
            out.display()
        ),
    )
    .unwrap();
    let routed = common::fill(&c, "orders.created", 10, None).await;
    common::fill(&c, "payments", 2, None).await;
    let config = config.display().to_string();
    let mut w = Relayer::start(&db, "routes", &["--config", &config, "--no-telemetry"]);
    common::eventually(MINUTE, "the routed messages delivered", || async {
        common::count(
            &c,
            "SELECT count(*) FROM outbox.messages WHERE topic = 'orders.created'",
        )
        .await
            == 0
    })
    .await;
    // A few more claims, which must still leave the other topic alone.
    tokio::time::sleep(Duration::from_millis(500)).await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));
    assert_eq!(
        std::fs::read_to_string(&out).unwrap().lines().count(),
        routed.len()
    );
    assert_eq!(
        common::count(
            &c,
            "SELECT count(*) FROM outbox.messages WHERE topic = 'payments' AND lease_token IS NULL"
        )
        .await,
        2,
        "the topic no route takes stays pending, unclaimed"
    );
    assert_eq!(
        common::count(&c, "SELECT count(*) FROM outbox.attempts a JOIN outbox.messages m USING (outbox_id) WHERE m.topic = 'payments'").await,
        0,
        "and without an attempt"
    );
    assert!(common::dead_letters(&c).await.is_empty());
    db.finish().await;
}

/// A frozen destination holds only its own messages: the other destination's messages of
/// the same claims are delivered and completed while it is frozen, and each destination
/// has its own budget.
#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_destination_does_not_hold_up_another() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let hooks = Hooks::serve().await;
    hooks.seen.lock().unwrap().frozen = true;
    let out = db.scratch_dir().join("fast.jsonl");
    let config = db.scratch_dir().join("two.toml");
    std::fs::write(
        &config,
        format!(
            "[destinations.slow]\ntype = \"http\"\nurl = \"{}\"\ntimeout_ms = 120000\n\n\
             [destinations.fast]\ntype = \"file\"\npath = \"{}\"\n\n\
             [[routes]]\ntopic = \"slow\"\ndestination = \"slow\"\n\n\
             [[routes]]\ntopic = \"*\"\ndestination = \"fast\"\n",
            hooks.url(),
            out.display()
        ),
    )
    .unwrap();
    // Interleaved, so that claims span both destinations.
    c.execute(
        "INSERT INTO outbox.messages (topic, payload) \
         SELECT CASE WHEN i % 10 = 0 THEN 'slow' ELSE 'fast' END, convert_to(json_build_object('n', i)::text, 'UTF8') \
           FROM generate_series(1, 5000) AS i",
        &[],
    )
    .await
    .unwrap();
    let config = config.display().to_string();
    let mut w = Relayer::start(
        &db,
        "two",
        &["--config", &config, "--no-telemetry", "--batch-size", "100"],
    );
    let remaining = |topic: &'static str| {
        let c = &c;
        async move {
            c.query_one(
                "SELECT count(*) FROM outbox.messages WHERE topic = $1",
                &[&topic],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
        }
    };
    // Well within the frozen destination's 120 s deadline.
    eventually(
        Duration::from_secs(30),
        "the fast destination's 4,500 messages to complete",
        || async { remaining("fast").await == 0 },
    )
    .await;
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), 4500);
    assert_eq!(
        remaining("slow").await,
        500,
        "the frozen destination completed nothing"
    );
    assert!(hooks.delivered("slow").is_empty());

    hooks.seen.lock().unwrap().frozen = false;
    eventually(
        MINUTE,
        "the slow destination's messages once it answers",
        || async { pending(&c).await == 0 },
    )
    .await;
    assert!(histories(&c).await.values().all(|h| h == "1:DISPATCHED"));
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));
    db.finish().await;
}

/// A destination that panics on every batch.
struct Panicking;

impl Destination for Panicking {
    fn publish<'a>(
        &'a self,
        _: &'a [ClaimedMessage],
        _: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async { panic!("the client library failed an assertion") })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_destination_that_panics_is_counted_and_its_leases_released_at_once() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let metrics = outbox_relay::telemetry::install();
    common::fill(&c, "orders", 10, None).await;
    let settings = Settings::from_raw(RawConfig {
        database_url: Some(db.url.clone()),
        worker_id: Some("panics".into()),
        ..RawConfig::default()
    })
    .unwrap();
    let dispatcher = Dispatcher::single(
        "boom",
        Arc::new(Panicking),
        settings.dispatch.circuit,
        MINUTE,
        1,
    );
    let relay = Relay::new(settings.relay, db.store(), Arc::new(dispatcher));
    let summary = relay.tick().await.unwrap();
    assert_eq!((summary.claimed, summary.released), (10, 10));
    let leased: i64 = common::count(
        &c,
        "SELECT count(*) FROM outbox.messages WHERE lease_token IS NOT NULL",
    )
    .await;
    assert_eq!(leased, 0, "released at once, not left to expire");
    assert_eq!(pending(&c).await, 10);
    assert!(histories(&c).await.is_empty(), "no attempt counted");
    let rendered = metrics.render();
    assert!(
        rendered.contains("outbox_dispatch_panics_total{destination=\"boom\"} 1"),
        "{rendered}"
    );
    db.finish().await;
}

/// The value of the sample `series` (name and labels, as rendered) in a scrape.
fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_are_described_start_at_zero_carry_the_destination_and_pass_promtool() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let hooks = Hooks::serve().await;
    hooks.seen.lock().unwrap().down = true;
    let telemetry = format!("127.0.0.1:{}", common::free_port());
    let mut w = relayer(
        &db,
        "metrics",
        &hooks.url(),
        "",
        &["--telemetry-addr", &telemetry],
    );
    eventually(MINUTE, "the telemetry listener", || async {
        outbox_relay::probes::probe(&telemetry, "/healthz")
            .await
            .is_ok()
    })
    .await;
    let (_, scrape) = outbox_relay::probes::probe(&telemetry, "/metrics")
        .await
        .unwrap();
    // Counters and gauges exist from the start (histograms appear with their first sample,
    // the fleet gauges with the first observation, the per-topic gauges with their first
    // topic; promtool below checks that whatever appears is described).
    for &(name, kind, _) in outbox_relay::telemetry::METRICS {
        if matches!(
            kind,
            outbox_relay::telemetry::Kind::Histogram
                | outbox_relay::telemetry::Kind::Observed
                | outbox_relay::telemetry::Kind::LabelledGauge
        ) {
            continue;
        }
        assert!(
            scrape.contains(&format!("# HELP {name} ")),
            "no HELP for {name}:\n{scrape}"
        );
        if kind == outbox_relay::telemetry::Kind::Counter {
            assert_eq!(
                sample(&scrape, name),
                Some(0.0),
                "{name} reads 0 from the start:\n{scrape}"
            );
        }
    }

    // One attempt allowed: the destination's 503 is the last one, and the database
    // dead-letters the message.
    c.execute(
        "SELECT outbox.enqueue('orders', '{}'::jsonb, NULL, '{}', NULL, NULL, 1)",
        &[],
    )
    .await
    .unwrap();
    drained(&c).await;
    let (_, scrape) = outbox_relay::probes::probe(&telemetry, "/metrics")
        .await
        .unwrap();
    assert_eq!(
        sample(
            &scrape,
            "outbox_messages_dead_lettered_total{topic=\"orders\"}"
        ),
        Some(1.0),
        "{scrape}"
    );
    assert!(
        scrape.contains("outbox_dispatch_duration_seconds_count{destination=\"hooks\"}"),
        "{scrape}"
    );

    let promtool = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut promtool = promtool.expect("promtool (Debian package prometheus; .ci/run installs it)");
    use std::io::Write;
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(scrape.as_bytes())
        .unwrap();
    let checked = promtool.wait_with_output().unwrap();
    assert!(
        checked.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));
    db.finish().await;
}

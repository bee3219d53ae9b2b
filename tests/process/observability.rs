//! What operators load into Prometheus and Grafana: the alert rules pass `promtool check
//! rules` and their unit tests, the dashboard and the rules name only metrics the binary
//! exports (read from the code's one list, `telemetry::METRICS`), and a live `/metrics` with
//! the fleet gauges passes `promtool check metrics`.

use crate::common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Relayer, TestDb, eventually, free_port};
use outbox_relay::telemetry::{Kind, METRICS};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn promtool(args: &[&str], stdin: Option<&str>) -> (bool, String) {
    let mut child = Command::new("promtool")
        .args(args)
        .current_dir(Path::new(ROOT).join("deploy/prometheus"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus; `make test` installs it)");
    let mut input = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        use std::io::Write;
        input.write_all(text.as_bytes()).unwrap();
    }
    drop(input);
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Every series name `/metrics` can carry: each metric, and a histogram's three series.
fn exported() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for &(name, kind, _) in METRICS {
        names.insert(name.to_owned());
        if kind == Kind::Histogram {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
    }
    names
}

/// The `outbox_…` metric names a text mentions.
fn mentioned(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("outbox_") {
        let starts_a_word = rest[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'));
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if starts_a_word {
            names.insert(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    names
}

#[test]
fn alert_rules_pass_promtool_and_their_unit_tests() {
    let (ok, out) = promtool(&["check", "rules", "alerts.yml"], None);
    assert!(ok, "promtool check rules: {out}");
    let (ok, out) = promtool(&["test", "rules", "alerts.test.yml"], None);
    assert!(ok, "promtool test rules: {out}");
}

#[test]
fn the_dashboard_and_the_rules_name_only_exported_metrics() {
    let exported = exported();
    let dashboard =
        std::fs::read_to_string(Path::new(ROOT).join("deploy/grafana/outbox-relay.json")).unwrap();
    let parsed: serde_json::Value = serde_json::from_str(&dashboard).expect("dashboard is JSON");
    let mut queries = String::new();
    for panel in parsed["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries += target["expr"].as_str().unwrap();
            queries.push('\n');
        }
    }
    let rules =
        std::fs::read_to_string(Path::new(ROOT).join("deploy/prometheus/alerts.yml")).unwrap();
    for (what, text) in [("dashboard", &queries), ("alerts.yml", &rules)] {
        let names = mentioned(text);
        assert!(names.len() >= 8, "{what} names {names:?}");
        let unknown: Vec<&String> = names.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{what} names metrics the binary does not export: {unknown:?}"
        );
    }
    // Each section the on-call engineer looks for is on the dashboard.
    let titles: Vec<&str> = parsed["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["type"] == "row")
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    for section in [
        "Throughput",
        "Backlog",
        "Latency",
        "Retries and dead letters",
        "Destinations",
        "Lease safety",
        "MVCC watchdog",
        "Database",
    ] {
        assert!(titles.contains(&section), "no {section} row in {titles:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_live_scrape_with_the_fleet_gauges_passes_promtool_check_metrics() {
    let db = TestDb::new().await;
    let c = db.client().await;
    common::fill(&c, "orders", 3, None).await;
    c.execute(
        "SELECT outbox.enqueue('later', '{}'::jsonb, NULL, '{}', now() + interval '1 hour')",
        &[],
    )
    .await
    .unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let _relayer = Relayer::start(
        &db,
        "scraped",
        &[
            "--sink",
            "null",
            "--telemetry-addr",
            &addr,
            "--observe-interval-secs",
            "1",
        ],
    );
    eventually(
        Duration::from_secs(60),
        "delivery and a later observation",
        || async {
            let (_, body) = outbox_relay::probes::probe(&addr, "/metrics")
                .await
                .unwrap_or_default();
            // Delivered, and observed since: the topic has left the gauges.
            body.contains("outbox_lease_left_at_completion_seconds_count")
                && body.contains("outbox_backlog_messages{topic=\"later\"")
                && !body.contains("topic=\"orders\",state=")
        },
    )
    .await;
    let (_, scrape) = outbox_relay::probes::probe(&addr, "/metrics")
        .await
        .unwrap();
    for line in [
        "outbox_backlog_messages{topic=\"later\",state=\"delayed\"} 1",
        "outbox_build_info{version=\"",
        "# HELP outbox_mvcc_horizon_age_seconds ",
        "outbox_claim_seconds_per_message_count",
    ] {
        assert!(scrape.contains(line), "no {line} in\n{scrape}");
    }
    let (ok, out) = promtool(&["check", "metrics"], Some(&scrape));
    assert!(ok, "promtool check metrics: {out}\n{scrape}");
    db.finish().await;
}

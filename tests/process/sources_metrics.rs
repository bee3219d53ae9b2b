//! What a many-source process tells Prometheus, with real processes against real databases:
//! its delivery counters carry a `source` label (the first `source_label_limit` sources it
//! serves by name, the rest as `other`) with each source's own counts; each source it serves
//! has its backlog exported by it alone, so that a second process taking a source over
//! takes over its backlog series and the fleet's sum counts each source once; the scrape
//! passes `promtool check metrics`; and a
//! one-database process exports the series it always did, without a `source` label.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::{Relayer, TestDb, base_url, connect, eventually, fill, free_port};
use outbox_relay::store::with_database;

const MINUTE: Duration = Duration::from_secs(60);

/// One sample of a scrape: its labels and its value.
type Sample = (BTreeMap<String, String>, f64);

/// The samples of metric `name` in a Prometheus text scrape.
fn samples(scrape: &str, name: &str) -> Vec<Sample> {
    scrape
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let (labels, value) = if let Some(rest) = rest.strip_prefix('{') {
                let (labels, value) = rest.split_once("} ")?;
                (labels, value)
            } else {
                ("", rest.strip_prefix(' ')?)
            };
            let labels = labels
                .split("\",")
                .filter(|pair| !pair.is_empty())
                .map(|pair| {
                    let (k, v) = pair.split_once("=\"").expect("label=\"value\"");
                    (k.to_owned(), v.trim_end_matches('"').to_owned())
                })
                .collect();
            Some((labels, value.trim().parse().ok()?))
        })
        .collect()
}

/// The values of metric `name` summed by the value of label `by` (samples without it are
/// left out).
fn by_label(scrape: &str, name: &str, by: &str) -> BTreeMap<String, f64> {
    let mut sums = BTreeMap::new();
    for (labels, value) in samples(scrape, name) {
        if let Some(key) = labels.get(by) {
            *sums.entry(key.clone()).or_insert(0.0) += value;
        }
    }
    sums
}

/// `promtool check metrics` on a scrape: the counters, the recorder's gauges and the
/// sources' backlog gauges together are valid Prometheus text.
fn promtool_check_metrics(scrape: &str) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus; `make test` installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(scrape.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{scrape}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn scrape(addr: &str) -> String {
    match outbox_relay::probes::probe(addr, "/metrics").await {
        Ok((200, body)) => body,
        _ => String::new(),
    }
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// A source: its name (its database), how many `orders` messages it gets (delivered) and
/// how many `parked` ones (never claimed: `topics = ["orders"]`, so they stay its backlog).
struct Source {
    name: String,
    orders: i64,
    parked: i64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_source_is_labelled_up_to_the_cap_and_its_backlog_exported_by_its_server_alone() {
    let db = TestDb::new().await;
    let template = db.migrated_template().await;
    let mut sources = Vec::new();
    for (i, (orders, parked)) in [(10, 1), (20, 2), (30, 4)].into_iter().enumerate() {
        let name = db.sibling_from(&format!("m{i}"), &template).await;
        let c = connect(&with_database(&base_url(), &name)).await.unwrap();
        fill(&c, "orders", orders, None).await;
        fill(&c, "parked", parked, None).await;
        sources.push(Source {
            name,
            orders,
            parked,
        });
    }
    let dir = db.scratch_dir();
    let mut config = String::from(
        "sink = \"file\"\n\
         sink_file_fsync = false\n\
         topics = [\"orders\"]\n\
         sources_discover_interval_secs = 1\n\
         source_lease_secs = 3\n\
         source_pool_size = 2\n\
         observe_interval_secs = 1\n\
         source_label_limit = 2\n",
    );
    for s in &sources {
        config += &format!(
            "[sources.{}]\ndatabase_url = \"{}\"\n",
            s.name,
            with_database(&base_url(), &s.name)
        );
    }
    let config_file = dir.join("relay.toml");
    std::fs::write(&config_file, config).unwrap();
    let start = |worker: &str, addr: &str| {
        let sink = dir.join(format!("{worker}.jsonl"));
        Relayer::start(
            &db,
            worker,
            &[
                "--config",
                config_file.to_str().unwrap(),
                "--sink-file",
                sink.to_str().unwrap(),
                "--telemetry-addr",
                addr,
            ],
        )
    };

    // One process serves the three sources and delivers every `orders` message.
    let a_addr = format!("127.0.0.1:{}", free_port());
    let a = start("m0", &a_addr);
    let total: i64 = sources.iter().map(|s| s.orders).sum();
    eventually(
        MINUTE,
        "every orders message delivered and counted",
        || async {
            let delivered = by_label(
                &scrape(&a_addr).await,
                "outbox_messages_delivered_total",
                "source",
            );
            #[allow(clippy::cast_precision_loss)]
            let done = delivered.values().sum::<f64>() == total as f64;
            done && lines(&dir.join("m0.jsonl")) == usize::try_from(total).unwrap()
        },
    )
    .await;

    // The first two sources it served keep their name; the third is `other`. Which two
    // depends on the order the slots were taken in: the counts tell them apart.
    let body = scrape(&a_addr).await;
    let delivered = by_label(&body, "outbox_messages_delivered_total", "source");
    let claimed = by_label(&body, "outbox_messages_claimed_total", "source");
    assert_eq!(
        delivered.len(),
        3,
        "two named sources and other: {delivered:?}\n{}",
        a.log_text()
    );
    assert!(delivered.contains_key("other"), "{delivered:?}");
    let named: Vec<&Source> = sources
        .iter()
        .filter(|s| delivered.contains_key(&s.name))
        .collect();
    assert_eq!(named.len(), 2, "{delivered:?}");
    let unnamed = sources
        .iter()
        .find(|s| !delivered.contains_key(&s.name))
        .unwrap();
    #[allow(clippy::cast_precision_loss)]
    for (label, s) in named
        .iter()
        .map(|s| (s.name.as_str(), *s))
        .chain([("other", unnamed)])
    {
        assert_eq!(delivered[label], s.orders as f64, "delivered of {label}");
        assert_eq!(claimed[label], s.orders as f64, "claimed of {label}");
    }
    // Every delivery is counted under topic orders and a source; the counter without
    // labels (there from the start) stays 0.
    for (labels, value) in samples(&body, "outbox_messages_delivered_total") {
        if labels.contains_key("source") {
            assert_eq!(labels["topic"], "orders", "{labels:?}");
        } else {
            assert_eq!(value, 0.0, "{labels:?}");
        }
    }

    // The backlog of each source: its parked messages, under the same labels.
    eventually(MINUTE, "each source's backlog exported", || async {
        let backlog = by_label(
            &scrape(&a_addr).await,
            "outbox_source_backlog_messages",
            "source",
        );
        #[allow(clippy::cast_precision_loss)]
        let expected: BTreeMap<String, f64> = named
            .iter()
            .map(|s| (s.name.clone(), s.parked as f64))
            .chain([("other".to_owned(), unnamed.parked as f64)])
            .collect();
        backlog == expected
    })
    .await;
    let body = scrape(&a_addr).await;
    let oldest = by_label(&body, "outbox_source_oldest_ready_age_seconds", "source");
    assert_eq!(oldest.len(), 3, "{oldest:?}");
    assert!(oldest.values().all(|age| *age > 0.0), "{oldest:?}");
    for line in [
        "# TYPE outbox_source_backlog_messages gauge",
        "# TYPE outbox_source_oldest_ready_age_seconds gauge",
    ] {
        assert!(body.contains(line), "no {line} in\n{body}");
    }
    // Nothing is in flight any more, under each label.
    let in_flight = by_label(&body, "outbox_in_flight_messages", "source");
    assert_eq!(in_flight.len(), 3, "{in_flight:?}");
    assert!(in_flight.values().all(|n| *n == 0.0), "{in_flight:?}");
    // The destination's timings and circuit state are by source too, under the same
    // labels: each source has circuits of its own, all closed here.
    let dispatched = by_label(&body, "outbox_dispatch_duration_seconds_count", "source");
    let circuits = by_label(&body, "outbox_destination_circuit_state", "source");
    for by_source in [&dispatched, &circuits] {
        assert_eq!(
            by_source.keys().collect::<Vec<_>>(),
            delivered.keys().collect::<Vec<_>>(),
            "{by_source:?}"
        );
    }
    assert!(dispatched.values().all(|n| *n >= 1.0), "{dispatched:?}");
    assert!(circuits.values().all(|n| *n == 0.0), "{circuits:?}");
    promtool_check_metrics(&body);

    // A second process joins: the first gives it a source back (its fair share is two of
    // the three; b takes a second only if one of a's slots lapses, a 3 s lease on a loaded
    // machine). From then on each source's backlog is exported by the one process that
    // serves it: the fleet's sum is the sources' parked messages, counted once.
    let b_addr = format!("127.0.0.1:{}", free_port());
    let b = start("m1", &b_addr);
    let parked: i64 = sources.iter().map(|s| s.parked).sum();
    eventually(MINUTE, "a source moved, its backlog with it", || async {
        let on_a = samples(&scrape(&a_addr).await, "outbox_source_backlog_messages");
        let on_b = samples(&scrape(&b_addr).await, "outbox_source_backlog_messages");
        let sum: f64 = on_a.iter().chain(&on_b).map(|(_, v)| v).sum();
        // The sources b serves are the first it labels (up to the cap of two): each has
        // its name there.
        #[allow(clippy::cast_precision_loss)]
        let b_is_right = !on_b.is_empty()
            && on_b.iter().all(|(labels, value)| {
                sources
                    .iter()
                    .any(|s| labels["source"] == s.name && *value == s.parked as f64)
            });
        #[allow(clippy::cast_precision_loss)]
        let fleet_sum = sum == parked as f64;
        b_is_right && fleet_sum && !on_a.is_empty() && on_a.len() + on_b.len() == 3
    })
    .await;
    // The sources that moved are no longer exported by the first process.
    let on_b = scrape(&b_addr).await;
    let gone_from_a = by_label(
        &scrape(&a_addr).await,
        "outbox_source_backlog_messages",
        "source",
    );
    for (labels, _) in samples(&on_b, "outbox_source_backlog_messages") {
        let moved = &labels["source"];
        assert!(
            !gone_from_a.contains_key(moved.as_str()),
            "a still exports {moved}: {gone_from_a:?}\n{}\n{}",
            a.log_text(),
            b.log_text()
        );
    }
    drop(a);
    drop(b);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_database_exports_its_counters_without_a_source_label() {
    let db = TestDb::new().await;
    let c = db.client().await;
    fill(&c, "orders", 5, None).await;
    let addr = format!("127.0.0.1:{}", free_port());
    let relayer = Relayer::start(
        &db,
        "single",
        &["--sink", "null", "--telemetry-addr", &addr],
    );
    eventually(MINUTE, "five delivered", || async {
        relayer.metric("outbox_messages_delivered_total").await == Some(5.0)
    })
    .await;
    let body = scrape(&addr).await;
    for name in [
        "outbox_messages_delivered_total",
        "outbox_messages_claimed_total",
    ] {
        let found = samples(&body, name);
        assert!(!found.is_empty(), "no {name} in\n{body}");
        for (labels, _) in found {
            assert!(!labels.contains_key("source"), "{name} {labels:?}");
        }
    }
    assert!(
        samples(&body, "outbox_source_backlog_messages").is_empty(),
        "a one-database process exports no source backlog:\n{body}"
    );
    drop(relayer);
    db.finish().await;
}

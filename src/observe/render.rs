//! The fleet gauges of an observation in the Prometheus text format, rendered apart from
//! the recorder so that a topic that leaves the largest ones stops being exported, and the
//! backlog gauges of the sources a many-source process serves, so that a source that moves
//! to another process stops being exported by this one.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use super::{HorizonHolder, Observation};
use crate::telemetry;

/// The fleet gauges of `observation` in the Prometheus text format, appended to what the
/// recorder renders. Rendered here rather than through the recorder so that a topic that
/// leaves the largest ones stops being exported instead of keeping its last value.
pub fn render(observation: &Observation, threshold: Duration) -> String {
    let s = &observation.snapshot;
    let mut out = String::new();
    let mut family = |name: &str, samples: Vec<(Vec<(&str, &str)>, f64)>| {
        let help = telemetry::help(name);
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (labels, value) in samples {
            let labels: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            if labels.is_empty() {
                let _ = writeln!(out, "{name} {value}");
            } else {
                let _ = writeln!(out, "{name}{{{}}} {value}", labels.join(","));
            }
        }
    };
    #[allow(clippy::cast_precision_loss)] // counts far below 2^52
    let f = |n: i64| n as f64;

    family(
        telemetry::OBSERVED_AT,
        vec![(
            vec![],
            observation.observed_at.timestamp_millis() as f64 / 1000.0,
        )],
    );
    let mut backlog = Vec::new();
    for t in &s.topics {
        for (state, n) in [
            ("ready", t.ready),
            ("delayed", t.delayed),
            ("in_flight", t.in_flight),
            ("expired_lease", t.expired_leases),
        ] {
            backlog.push((vec![("topic", t.topic.as_str()), ("state", state)], f(n)));
        }
    }
    family(telemetry::BACKLOG, backlog);
    family(
        telemetry::DEAD_LETTERS,
        s.topics
            .iter()
            .map(|t| (vec![("topic", t.topic.as_str())], f(t.dead_letters)))
            .collect(),
    );
    family(
        telemetry::OLDEST_READY_AGE,
        s.topics
            .iter()
            .map(|t| {
                let age = t.oldest_ready_age_seconds.unwrap_or(0.0);
                (vec![("topic", t.topic.as_str())], age)
            })
            .collect(),
    );
    family(
        telemetry::ATTEMPTS_LAST_MINUTE,
        ["DISPATCHED", "RETRYABLE", "FAILED", "ZOMBIE_REQUEUE"]
            .into_iter()
            .map(|state| {
                let n = s.attempts_last_minute.get(state).copied().unwrap_or(0);
                (vec![("state", state)], f(n))
            })
            .collect(),
    );
    let oldest = s
        .horizon_holders
        .iter()
        .filter_map(|h| h.age_seconds)
        .fold(0.0_f64, f64::max);
    family(telemetry::HORIZON_AGE, vec![(vec![], oldest)]);
    let xid_age = s
        .horizon_holders
        .iter()
        .filter_map(|h| h.xid_age)
        .max()
        .unwrap_or(0);
    family(telemetry::HORIZON_XID_AGE, vec![(vec![], f(xid_age))]);
    let culprits: Vec<&HorizonHolder> = s
        .horizon_holders
        .iter()
        .filter(|h| h.is_culprit(threshold))
        .take(5)
        .collect();
    let pids: Vec<String> = culprits
        .iter()
        .map(|h| h.pid.map(|p| p.to_string()).unwrap_or_default())
        .collect();
    family(
        telemetry::HORIZON_CULPRIT,
        culprits
            .iter()
            .zip(&pids)
            .map(|(h, pid)| {
                (
                    vec![
                        ("kind", h.kind.as_str()),
                        ("pid", pid.as_str()),
                        ("name", h.name.as_deref().unwrap_or("")),
                        ("state", h.state.as_deref().unwrap_or("")),
                    ],
                    h.age_seconds.unwrap_or(0.0),
                )
            })
            .collect(),
    );
    if let Some(table) = &s.messages_table {
        family(
            telemetry::TABLE_TUPLES,
            vec![
                (vec![("kind", "live")], f(table.live_tuples)),
                (vec![("kind", "dead")], f(table.dead_tuples)),
            ],
        );
        if let Some(at) = table.last_autovacuum {
            family(
                telemetry::LAST_AUTOVACUUM,
                vec![(vec![], at.timestamp_millis() as f64 / 1000.0)],
            );
        }
    }
    out
}

/// The backlog gauges of the sources this process serves, from each source's latest
/// observation and under its `source` label: the messages ready to be claimed, and the age
/// of the oldest (0 when none is ready). Sources sharing a label (`other`) are summed, and
/// their oldest age is the oldest of them.
pub fn render_sources(backlogs: &[(String, Observation)]) -> String {
    let mut by_label: BTreeMap<&str, (i64, f64)> = BTreeMap::new();
    for (label, observation) in backlogs {
        let (ready, oldest) = by_label.entry(label.as_str()).or_default();
        for t in &observation.snapshot.topics {
            *ready += t.ready;
            *oldest = oldest.max(t.oldest_ready_age_seconds.unwrap_or(0.0));
        }
    }
    let mut out = String::new();
    for name in [
        telemetry::SOURCE_BACKLOG,
        telemetry::SOURCE_OLDEST_READY_AGE,
    ] {
        let help = telemetry::help(name);
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (label, (ready, oldest)) in &by_label {
            #[allow(clippy::cast_precision_loss)] // counts far below 2^52
            let value = if name == telemetry::SOURCE_BACKLOG {
                *ready as f64
            } else {
                *oldest
            };
            let _ = writeln!(out, "{name}{{source=\"{}\"}} {value}", escape(label));
        }
    }
    out
}

/// A label value in the text format: backslash, double quote and newline escaped.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

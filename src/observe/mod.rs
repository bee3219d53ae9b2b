//! What the fleet looks like from the database, and what is wrong with it.
//!
//! Per-process counters cannot say how large the backlog is, how old its oldest message
//! is, or that a session elsewhere is holding back the MVCC horizon so that dead tuples
//! pile up in `outbox.messages` and every claim crawls. `outbox.observe` (V8) computes those
//! figures once per interval for the whole fleet (one caller at a time; the others read the
//! stored snapshot), and this module turns a snapshot into Prometheus gauges, into a
//! diagnosis with advice (`/debug/health`, `outbox-relay status`), and into one warning per
//! culprit that holds the horizon longer than the threshold. It also asks, each interval,
//! which topics stall (`outbox.stalled_topics`: ready messages that no relayer's routes
//! cover, or that every relayer covering them leaves out while their destination's circuit
//! is open, wait with no signal of their own, and by per-key order so do the later
//! messages of their keys on other topics), and warns once per such topic, with its cause
//! and the keys it holds on other topics, and sets their gauges.
//!
//! With many sources, each source a process serves is observed the same way, and its
//! backlog exported by the process that serves it (`render_sources`).
//!
//! `render.rs` writes the fleet gauges in the Prometheus text format.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::message::WorkerId;
use crate::store::{StalledTopic, Store, StoreError};
use crate::telemetry;

mod render;

pub use render::{render, render_sources};

/// One snapshot of `outbox.observe`.
#[derive(Clone, Debug, Serialize)]
pub struct Observation {
    pub observed_at: DateTime<Utc>,
    /// Whether this call computed it (rather than reading another process's).
    #[serde(skip)]
    pub refreshed: bool,
    #[serde(flatten)]
    pub snapshot: Snapshot,
}

/// The snapshot's figures; the shape is documented on `outbox.observe`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Snapshot {
    pub topics: Vec<TopicFigures>,
    pub attempts_last_minute: BTreeMap<String, i64>,
    pub horizon_holders: Vec<HorizonHolder>,
    pub messages_table: Option<TableFigures>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct TopicFigures {
    /// A topic, or `other` for the topics beyond the largest ones.
    pub topic: String,
    pub ready: i64,
    pub delayed: i64,
    pub in_flight: i64,
    pub expired_leases: i64,
    pub dead_letters: i64,
    pub oldest_ready_age_seconds: Option<f64>,
    /// When the first delayed message becomes ready (none delayed, or all parked at
    /// `infinity`: `None`). Snapshots stored before V26 lack it.
    #[serde(default)]
    pub next_due_at: Option<DateTime<Utc>>,
}

/// A session, replication slot or prepared transaction that holds back what vacuum may
/// remove from `outbox.messages`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct HorizonHolder {
    pub kind: String,
    pub pid: Option<i32>,
    /// Application name, slot name or prepared transaction id.
    pub name: Option<String>,
    pub state: Option<String>,
    /// How long it has held its snapshot or transaction (unknown for a replication slot).
    pub age_seconds: Option<f64>,
    pub xid_age: Option<i64>,
    /// The first 100 characters of the statement (never its parameters).
    pub query: Option<String>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct TableFigures {
    pub live_tuples: i64,
    pub dead_tuples: i64,
    pub last_autovacuum: Option<DateTime<Utc>>,
    pub last_vacuum: Option<DateTime<Utc>>,
}

/// How often and how much to observe, and when a held horizon is a problem.
#[derive(Clone, Copy, Debug)]
pub struct ObserveSettings {
    pub interval: Duration,
    pub top_topics: i32,
    pub horizon_threshold: Duration,
    /// A topic whose messages have been ready this long, claimed by no running relayer, is
    /// named.
    pub uncovered_after: Duration,
}

impl HorizonHolder {
    /// Its figures as the watchdog's events report them.
    fn as_culprit(&self) -> telemetry::HorizonCulprit<'_> {
        telemetry::HorizonCulprit {
            kind: &self.kind,
            pid: self.pid,
            name: self.name.as_deref(),
            state: self.state.as_deref(),
            age_seconds: self.age_seconds,
            xid_age: self.xid_age,
            query: self.query.as_deref(),
        }
    }

    /// Whether it is a problem: held longer than `threshold`, or (a replication slot, whose
    /// age is not known) no standby is using it.
    pub fn is_culprit(&self, threshold: Duration) -> bool {
        match self.age_seconds {
            Some(age) => age >= threshold.as_secs_f64(),
            None => self.state.as_deref() == Some("inactive"),
        }
    }

    /// Who it is, in words.
    pub fn describe(&self) -> String {
        let mut s = self.kind.clone();
        if let Some(pid) = self.pid {
            let _ = write!(s, " pid {pid}");
        }
        if let Some(name) = self.name.as_deref().filter(|n| !n.is_empty()) {
            let _ = write!(s, " ({name})");
        }
        if let Some(state) = &self.state {
            let _ = write!(s, ", {state}");
        }
        if let Some(age) = self.age_seconds {
            let _ = write!(s, ", for {age:.0} s");
        }
        if let Some(query) = self.query.as_deref().filter(|q| !q.is_empty()) {
            let _ = write!(s, ", last statement: {query}");
        }
        s
    }

    /// What an operator can do about it.
    pub fn advice(&self) -> String {
        match (self.kind.as_str(), self.pid, self.name.as_deref()) {
            ("replication slot", _, Some(slot)) => format!(
                "if its standby is gone, drop the slot: SELECT pg_drop_replication_slot('{slot}')"
            ),
            ("prepared transaction", _, Some(gid)) => format!(
                "finish it with COMMIT PREPARED '{gid}' or ROLLBACK PREPARED '{gid}' (ask its owner which)"
            ),
            (_, Some(pid), _) => format!(
                "end it: SELECT pg_terminate_backend({pid}); to stop it recurring, set \
                 idle_in_transaction_session_timeout (and a statement_timeout) for that \
                 application's role"
            ),
            _ => "find and end the transaction holding the oldest snapshot".to_owned(),
        }
    }
}

/// A problem the snapshot shows, and what to do about it.
#[derive(Clone, Debug, Serialize)]
pub struct Problem {
    pub what: String,
    pub advice: String,
}

/// Dead tuples in `outbox.messages` above this (and above the live rows) slow claims down.
const DEAD_TUPLES_PROBLEM: i64 = 100_000;

/// What is wrong, as the snapshot tells it.
pub fn diagnose(snapshot: &Snapshot, threshold: Duration) -> Vec<Problem> {
    let mut problems: Vec<Problem> = snapshot
        .horizon_holders
        .iter()
        .filter(|h| h.is_culprit(threshold))
        .map(|h| Problem {
            what: format!(
                "{} holds back the MVCC horizon: dead rows of outbox.messages cannot be vacuumed",
                h.describe()
            ),
            advice: h.advice(),
        })
        .collect();
    if let Some(table) = &snapshot.messages_table
        && table.dead_tuples > DEAD_TUPLES_PROBLEM
        && table.dead_tuples > table.live_tuples
    {
        problems.push(Problem {
            what: format!(
                "outbox.messages has {} dead tuples and {} live ones: claims step over them",
                table.dead_tuples, table.live_tuples
            ),
            advice: "end whatever holds the horizon (above), then VACUUM (VERBOSE) outbox.messages"
                .to_owned(),
        });
    }
    problems
}

/// The latest observation this process has, shared with the HTTP listener.
pub struct Latest {
    observation: RwLock<Option<Observation>>,
    pub settings: ObserveSettings,
}

impl Latest {
    pub fn new(settings: ObserveSettings) -> Arc<Self> {
        Arc::new(Self {
            observation: RwLock::new(None),
            settings,
        })
    }

    pub fn get(&self) -> Option<Observation> {
        self.observation
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set(&self, observation: Observation) {
        *self
            .observation
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(observation);
    }

    /// `/debug/health`: the diagnosis, the figures it is based on, and whether all is well.
    pub fn health(&self) -> serde_json::Value {
        match self.get() {
            None => serde_json::json!({
                "status": "unknown",
                "problems": [],
                "note": "no observation yet (the first comes within one observe interval)",
            }),
            Some(o) => {
                let problems = diagnose(&o.snapshot, self.settings.horizon_threshold);
                serde_json::json!({
                    "status": if problems.is_empty() { "ok" } else { "degraded" },
                    "problems": problems,
                    "observation": o,
                })
            }
        }
    }
}

/// `outbox.observe` read into an [`Observation`]: the fleet's latest snapshot, refreshed
/// first when it is older than `max_age` and no other process is refreshing it; `None`
/// before the first one. A snapshot of an unexpected shape is a schema error.
pub async fn fetch(
    store: &Store,
    top_topics: i32,
    max_age: Duration,
) -> Result<Option<Observation>, StoreError> {
    let Some(row) = store.observe(top_topics, max_age).await? else {
        return Ok(None);
    };
    let snapshot = serde_json::from_value(row.snapshot).map_err(|e| {
        StoreError::Schema(format!(
            "outbox.observe returned an unexpected snapshot: {e}"
        ))
    })?;
    Ok(Some(Observation {
        observed_at: row.observed_at,
        refreshed: row.refreshed,
        snapshot,
    }))
}

/// Observes every `interval` (±10%) until `shutdown`: keeps `latest` current, warns once
/// per culprit that holds the horizon past the threshold (and says when it is gone), and
/// once per stalled topic (and says when it moves again).
pub async fn run(
    store: Store,
    worker: WorkerId,
    source: crate::telemetry::Source,
    latest: Arc<Latest>,
    shutdown: CancellationToken,
) {
    let settings = latest.settings;
    let mut warned: HashMap<String, HorizonHolder> = HashMap::new();
    let mut stalled: HashSet<(String, String)> = HashSet::new();
    loop {
        let mut any_waiting = true;
        match fetch(&store, settings.top_topics, settings.interval).await {
            Ok(Some(observation)) => {
                watch_horizon(
                    &observation.snapshot,
                    settings.horizon_threshold,
                    &mut warned,
                );
                any_waiting = waited_past(&observation.snapshot, settings.uncovered_after);
                latest.set(observation);
            }
            Ok(None) => {}
            Err(e) => telemetry::database_error(&worker, &source, "observe", &e),
        }
        // stalled_topics reads outbox.messages whole: asked only when the fleet's
        // snapshot has a message ready for longer than the bound (none: none stalls).
        if any_waiting {
            match store.stalled_topics(settings.uncovered_after).await {
                Ok(found) => watch_stalled(&source, &found, settings.top_topics, &mut stalled),
                Err(e) => telemetry::database_error(&worker, &source, "stalled_topics", &e),
            }
        } else {
            watch_stalled(&source, &[], settings.top_topics, &mut stalled);
        }
        let jittered = settings.interval.mul_f64(rand::random_range(0.9..=1.1));
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(jittered) => {}
        }
    }
}

/// Whether any topic of `snapshot` (the top topics and `other`, so every topic) has a
/// message ready for longer than `bound`.
fn waited_past(snapshot: &Snapshot, bound: Duration) -> bool {
    snapshot
        .topics
        .iter()
        .filter_map(|t| t.oldest_ready_age_seconds)
        .any(|age| age >= bound.as_secs_f64())
}

/// Warns once per topic that became stalled (no running relayer claims its ready messages,
/// or every relayer claiming them leaves them out behind an open circuit), naming it with
/// its cause and the keys it holds on other topics, and says when it moves again; the
/// gauges follow the `top` oldest such topics of each cause.
fn watch_stalled(
    source: &telemetry::Source,
    found: &[StalledTopic],
    top: i32,
    warned: &mut HashSet<(String, String)>,
) {
    let top = usize::try_from(top).unwrap_or(usize::MAX);
    let now: HashSet<(String, String)> = found
        .iter()
        .map(|s| (s.topic.clone(), s.cause.clone()))
        .collect();
    for s in found {
        if warned.insert((s.topic.clone(), s.cause.clone())) {
            if s.is_uncovered() {
                telemetry::topic_uncovered(
                    source,
                    &s.topic,
                    s.ready,
                    s.oldest_ready_age_secs,
                    s.held_keys,
                    &s.held_topics,
                );
            } else {
                telemetry::topic_held_by_circuits(
                    source,
                    &s.topic,
                    &s.destinations,
                    s.ready,
                    s.oldest_ready_age_secs,
                    s.held_keys,
                    &s.held_topics,
                );
            }
        }
    }
    for (topic, cause) in warned.difference(&now) {
        if cause == StalledTopic::UNCOVERED {
            telemetry::topic_covered_again(source, topic);
        } else {
            telemetry::topic_no_longer_held_by_circuits(source, topic);
        }
    }
    warned.retain(|t| now.contains(t));
    for s in found.iter().filter(|s| s.is_uncovered()).take(top) {
        telemetry::uncovered_topic(source, &s.topic, s.ready, s.held_keys);
    }
    for s in found.iter().filter(|s| !s.is_uncovered()).take(top) {
        telemetry::circuit_held_topic(source, &s.topic, s.ready, s.held_keys);
    }
}

/// Culprits are told apart by kind, pid and name: the same session in a new long
/// transaction is the same culprit until it lets go.
fn culprit_key(h: &HorizonHolder) -> String {
    format!(
        "{}|{}|{}",
        h.kind,
        h.pid.unwrap_or(0),
        h.name.as_deref().unwrap_or("")
    )
}

fn watch_horizon(
    snapshot: &Snapshot,
    threshold: Duration,
    warned: &mut HashMap<String, HorizonHolder>,
) {
    let culprits: HashMap<String, &HorizonHolder> = snapshot
        .horizon_holders
        .iter()
        .filter(|h| h.is_culprit(threshold))
        .map(|h| (culprit_key(h), h))
        .collect();
    for (key, h) in &culprits {
        if !warned.contains_key(key) {
            telemetry::horizon_held(h.as_culprit(), &h.advice(), threshold);
            warned.insert(key.clone(), (*h).clone());
        }
    }
    warned.retain(|key, h| {
        let still = culprits.contains_key(key);
        if !still {
            telemetry::horizon_released(h.as_culprit());
        }
        still
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(kind: &str, age: Option<f64>, state: &str) -> HorizonHolder {
        HorizonHolder {
            kind: kind.to_owned(),
            pid: (kind == "session").then_some(42),
            name: Some("billing \"nightly\"".to_owned()),
            state: Some(state.to_owned()),
            age_seconds: age,
            xid_age: Some(7),
            query: Some("SELECT 1".to_owned()),
        }
    }

    #[test]
    fn a_culprit_is_older_than_the_threshold_or_an_unused_slot() {
        let t = Duration::from_secs(300);
        assert!(holder("session", Some(301.0), "idle in transaction").is_culprit(t));
        assert!(!holder("session", Some(2.0), "active").is_culprit(t));
        assert!(holder("replication slot", None, "inactive").is_culprit(t));
        assert!(!holder("replication slot", None, "active").is_culprit(t));
    }

    #[test]
    fn warns_once_per_culprit_and_forgets_it_when_it_lets_go() {
        let t = Duration::from_secs(1);
        let mut warned = HashMap::new();
        let held = Snapshot {
            horizon_holders: vec![holder("session", Some(5.0), "idle in transaction")],
            ..Snapshot::default()
        };
        watch_horizon(&held, t, &mut warned);
        watch_horizon(&held, t, &mut warned);
        assert_eq!(warned.len(), 1);
        watch_horizon(&Snapshot::default(), t, &mut warned);
        assert!(warned.is_empty());
    }

    #[test]
    fn label_values_are_escaped() {
        let o = Observation {
            observed_at: Utc::now(),
            refreshed: true,
            snapshot: Snapshot {
                horizon_holders: vec![holder("session", Some(5.0), "idle in transaction")],
                ..Snapshot::default()
            },
        };
        let text = render(&o, Duration::from_secs(1));
        assert!(text.contains(r#"name="billing \"nightly\"""#), "{text}");
    }

    fn topic(name: &str, ready: i64, oldest: Option<f64>) -> TopicFigures {
        TopicFigures {
            topic: name.to_owned(),
            ready,
            delayed: 0,
            in_flight: 0,
            expired_leases: 0,
            dead_letters: 0,
            oldest_ready_age_seconds: oldest,
            next_due_at: None,
        }
    }

    #[test]
    fn a_source_backlog_sums_its_topics_and_other_sums_its_sources() {
        let observed = |topics| Observation {
            observed_at: Utc::now(),
            refreshed: true,
            snapshot: Snapshot {
                topics,
                ..Snapshot::default()
            },
        };
        let text = render_sources(&[
            (
                "billing".to_owned(),
                observed(vec![topic("a", 3, Some(2.5)), topic("b", 4, Some(7.0))]),
            ),
            ("other".to_owned(), observed(vec![topic("a", 1, Some(9.0))])),
            ("other".to_owned(), observed(vec![topic("a", 2, None)])),
        ]);
        for line in [
            "outbox_source_backlog_messages{source=\"billing\"} 7",
            "outbox_source_backlog_messages{source=\"other\"} 3",
            "outbox_source_oldest_ready_age_seconds{source=\"billing\"} 7",
            "outbox_source_oldest_ready_age_seconds{source=\"other\"} 9",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
        }
    }
}

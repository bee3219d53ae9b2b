//! What this process knows of each source: serving it, standing by while other processes
//! serve it, or unable to (down, unmigrated, the wrong schema version, grants lost, over
//! the connection budget), with who serves it. Each change is logged once; `/readyz` and
//! the `outbox_sources` gauge read the board. A source this process serves has its latest
//! observation here too, which `/metrics` exports as the source's backlog while this process
//! is its first holder (one exporter per source, so that the fleet's sum counts each once).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};

use crate::observe::{Latest, Observation};

/// The state of one source in this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceState {
    /// Found; not asked yet.
    Starting,
    /// This process serves it, in this slot.
    Serving { slot: i32 },
    /// Others serve it (or nobody yet): this process asks again every discovery interval.
    Standby,
    /// This process may not open more connections to its server (the connection budget).
    OverBudget,
    /// It has ready messages and nobody serves it: it waits for its turn (a process with
    /// room takes it, or one serving another source of its server gives that one up),
    /// within the bound [`Share::wait_bound`](super::share::Share::wait_bound) states.
    Queued,
    /// Queued for longer than that bound: starved, which the log, `/readyz` and the
    /// `outbox_sources{state="waiting"}` gauge show.
    Waiting,
    /// It cannot be served: the reason, in words (retried with backoff).
    Down(String),
}

impl SourceState {
    /// The state's name, as the gauge and `/readyz` give it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Serving { .. } => "serving",
            Self::Standby => "standby",
            Self::OverBudget => "over_budget",
            Self::Queued => "queued",
            Self::Waiting => "waiting",
            Self::Down(_) => "down",
        }
    }
}

/// One source's line on the board.
#[derive(Clone, Debug)]
pub struct Entry {
    pub state: SourceState,
    pub since: DateTime<Utc>,
    /// The workers serving it, as the source last said.
    pub holders: Vec<String>,
}

/// Every source this process knows, by name.
#[derive(Debug, Default)]
pub struct Board {
    entries: Mutex<BTreeMap<String, Entry>>,
    observed: Mutex<BTreeMap<String, Observed>>,
}

/// The observations of a source this process serves, and the label it exports them under.
struct Observed {
    label: String,
    /// This process's worker id: the backlog is exported while it is the first holder.
    worker: String,
    latest: Arc<Latest>,
}

impl std::fmt::Debug for Observed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observed")
            .field("label", &self.label)
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}

impl Board {
    /// Records `state` for `source`, logging it when it changed.
    pub fn set(&self, source: &str, state: SourceState) {
        let mut board = self.entries.lock().expect("board lock");
        let entry = board.entry(source.to_owned()).or_insert_with(|| Entry {
            state: SourceState::Starting,
            since: Utc::now(),
            holders: Vec::new(),
        });
        if entry.state == state {
            return;
        }
        match &state {
            SourceState::Down(reason) => {
                tracing::warn!(source, reason = %reason,
                    "source cannot be served; retried with backoff while the others go on");
            }
            SourceState::Waiting => tracing::warn!(
                source,
                waiting_since = %entry.since.format("%Y-%m-%dT%H:%M:%SZ"),
                "source starved: it has had ready messages and no process serving it for \
                 longer than the bound its turns promise"
            ),
            SourceState::OverBudget => tracing::warn!(
                source,
                "source not taken: this process's share of its server's connection budget \
                 is used (max_connections_per_server)"
            ),
            other => tracing::info!(source, state = other.name(), "source state"),
        }
        // Waiting is queued for too long: it keeps the time the wait started.
        if !(entry.state == SourceState::Queued && state == SourceState::Waiting) {
            entry.since = Utc::now();
        }
        entry.state = state;
        crate::telemetry::sources(&counts(&board));
    }

    /// Since when `source` has been in its present state.
    pub fn since(&self, source: &str) -> Option<DateTime<Utc>> {
        self.entries
            .lock()
            .expect("board lock")
            .get(source)
            .map(|e| e.since)
    }

    /// Records who serves `source`, as the source said.
    pub fn holders(&self, source: &str, holders: Vec<String>) {
        if let Some(entry) = self.entries.lock().expect("board lock").get_mut(source) {
            entry.holders = holders;
        }
    }

    /// Forgets `source` (no longer discovered).
    pub fn remove(&self, source: &str) {
        self.unobserve(source);
        let mut board = self.entries.lock().expect("board lock");
        board.remove(source);
        crate::telemetry::sources(&counts(&board));
    }

    /// Every source's line, by name.
    pub fn entries(&self) -> BTreeMap<String, Entry> {
        self.entries.lock().expect("board lock").clone()
    }

    /// `source` is served here and observed into `latest`: its backlog is exported under
    /// `label` while this process (`worker`) serves it as its first holder.
    pub fn observe(&self, source: &str, label: &str, worker: &str, latest: Arc<Latest>) {
        self.observed.lock().expect("board lock").insert(
            source.to_owned(),
            Observed {
                label: label.to_owned(),
                worker: worker.to_owned(),
                latest,
            },
        );
    }

    /// `source` is no longer served here: its backlog is no longer exported by this process.
    pub fn unobserve(&self, source: &str) {
        self.observed.lock().expect("board lock").remove(source);
    }

    /// The latest observation of each source whose backlog this process exports, with its
    /// label: the sources it serves as their first holder (in slot order), observed at least
    /// once.
    pub fn backlogs(&self) -> Vec<(String, Observation)> {
        let entries = self.entries.lock().expect("board lock");
        let observed = self.observed.lock().expect("board lock");
        observed
            .iter()
            .filter(|(source, o)| {
                entries.get(*source).is_some_and(|e| {
                    matches!(e.state, SourceState::Serving { .. })
                        && e.holders.first() == Some(&o.worker)
                })
            })
            .filter_map(|(_, o)| Some((o.label.clone(), o.latest.get()?)))
            .collect()
    }
}

/// Sources per state name.
fn counts(board: &BTreeMap<String, Entry>) -> BTreeMap<&'static str, usize> {
    let mut counts = BTreeMap::new();
    for name in crate::telemetry::SOURCE_STATES {
        counts.insert(name, 0);
    }
    for entry in board.values() {
        *counts.entry(entry.state.name()).or_default() += 1;
    }
    counts
}

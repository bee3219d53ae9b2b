//! What this process knows of each source: serving it, standing by while other processes
//! serve it, or unable to (down, unmigrated, the wrong schema version, grants lost, over
//! the connection budget), with who serves it. Each change is logged once; `/readyz` and
//! the `outbox_sources` gauge read the board.

use std::collections::BTreeMap;
use std::sync::Mutex;

use chrono::{DateTime, Utc};

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
pub struct Board(Mutex<BTreeMap<String, Entry>>);

impl Board {
    /// Records `state` for `source`, logging it when it changed.
    pub fn set(&self, source: &str, state: SourceState) {
        let mut board = self.0.lock().expect("board lock");
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
            SourceState::OverBudget => tracing::warn!(
                source,
                "source not taken: this process's share of its server's connection budget \
                 is used (max_connections_per_server)"
            ),
            other => tracing::info!(source, state = other.name(), "source state"),
        }
        entry.state = state;
        entry.since = Utc::now();
        crate::telemetry::sources(&counts(&board));
    }

    /// Records who serves `source`, as the source said.
    pub fn holders(&self, source: &str, holders: Vec<String>) {
        if let Some(entry) = self.0.lock().expect("board lock").get_mut(source) {
            entry.holders = holders;
        }
    }

    /// Forgets `source` (no longer discovered).
    pub fn remove(&self, source: &str) {
        let mut board = self.0.lock().expect("board lock");
        board.remove(source);
        crate::telemetry::sources(&counts(&board));
    }

    /// Every source's line, by name.
    pub fn entries(&self) -> BTreeMap<String, Entry> {
        self.0.lock().expect("board lock").clone()
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

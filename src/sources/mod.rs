//! Many outboxes, one fleet. A source is one outbox database; the sources come from the
//! config, from a server's databases and from a catalogue query, found again every
//! discovery interval. Every process of the fleet runs the same supervisor: it asks each
//! source for a slot (`outbox.serve_source`), serves the sources it holds a slot on, each
//! with a relay of its own (its own claim loop, pool, circuits and budgets, so one source's
//! backlog, slow messages or errors never hold back another's), and takes no more than its
//! fair share, so that the sources spread over the processes and move when processes join
//! or leave. Slots are leases in the sources themselves: no coordinator, no other store.
//!
//! - `settings.rs`: [`SourcesSettings`];
//! - `discover.rs`: finding the sources;
//! - `share.rs`: this process's fair share, and its part of each server's connection budget;
//! - `serve.rs`: one source's task: ask, serve while the slot holds, give it back;
//! - `board.rs`: each source's state, logged once per change, for `/readyz` and metrics,
//!   and the latest observation of each source served here, exported as its backlog.

mod board;
mod discover;
mod serve;
mod settings;
mod share;

pub use board::{Board, Entry, SourceState};
pub use discover::discover;
pub use settings::{MAX_SLOTS, SourcesSettings};
pub use share::wait_bound;

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::dispatch::Dispatcher;
use crate::observe::ObserveSettings;
use crate::relay::RelaySettings;
use crate::store::{Statements, Turns};
use crate::telemetry::SourceLabels;

/// What every source's task shares: the settings, the destinations and the fair share.
pub struct Fleet {
    pub settings: SourcesSettings,
    pub relay: RelaySettings,
    pub statements: Statements,
    /// The destinations, built once; each served source gets its own circuits and budgets
    /// on them ([`Dispatcher::for_source`]).
    pub dispatcher: Arc<Dispatcher>,
    pub board: Arc<Board>,
    /// The `source` label of each served source's metrics (the first `label_limit` keep
    /// their name).
    labels: SourceLabels,
    /// How each served source is observed for its backlog gauges; None: not observed.
    observe: Option<ObserveSettings>,
    share: share::Share,
    /// Each server's turns for the leasing calls of the sources served on it
    /// ([`Store::with_turns`](crate::store::Store::with_turns)), by server.
    turns: std::sync::Mutex<std::collections::HashMap<String, Arc<Turns>>>,
    /// When this process started: during its first discovery interval, and until it has
    /// polled every source once, it only joins (says it is alive in every source) and takes
    /// nothing, so that it learns the fleet's size before taking its share, instead of
    /// taking every source (and the whole connection budget) and giving most back.
    started: std::time::Instant,
}

impl Fleet {
    pub fn new(
        settings: SourcesSettings,
        relay: RelaySettings,
        statements: Statements,
        dispatcher: Arc<Dispatcher>,
    ) -> Self {
        Self {
            share: share::Share::new(&settings),
            labels: SourceLabels::new(settings.label_limit),
            observe: None,
            settings,
            relay,
            statements,
            dispatcher,
            board: Arc::default(),
            turns: std::sync::Mutex::default(),
            started: std::time::Instant::now(),
        }
    }

    /// The same fleet, observing each source it serves every `settings.interval`
    /// (`outbox.observe`, as one database is) for the backlog gauges of `/metrics`.
    pub fn with_observe(mut self, settings: ObserveSettings) -> Self {
        self.observe = Some(settings);
        self
    }
}

impl Fleet {
    /// The turns of `server`'s leasing calls, when they are capped.
    fn turns(&self, server: &str) -> Option<Arc<Turns>> {
        let n = self.settings.calls_per_server?;
        let configured = self.settings.backlogged_calls_per_server;
        let mut turns = self.turns.lock().expect("turns lock");
        Some(
            turns
                .entry(server.to_owned())
                .or_insert_with(|| {
                    Arc::new(match configured {
                        Some(backlogged) => Turns::new(n, backlogged),
                        None => Turns::new(n, n.div_ceil(2)).adaptive(),
                    })
                })
                .clone(),
        )
    }
}

/// Runs discovery and one task per source until `shutdown`, then stops every task: each
/// stops claiming, lets its deliveries finish (or releases them) and gives its slot back.
pub async fn run(fleet: Arc<Fleet>, shutdown: CancellationToken) {
    let mut tasks: BTreeMap<String, (String, CancellationToken, JoinHandle<()>)> = BTreeMap::new();
    let mut failing: Option<String> = None;
    loop {
        let known: BTreeMap<String, String> = tasks
            .iter()
            .map(|(name, (url, _, _))| (name.clone(), url.clone()))
            .collect();
        match discover::discover_keeping(&fleet.settings, &known, Some(&fleet.share)).await {
            Ok(found) => {
                if failing.take().is_some() {
                    tracing::info!("sources discovery works again");
                }
                // Gone, or its connection string changed: stopped, all at once (a new task
                // starts for a changed one below).
                let gone: Vec<String> = tasks
                    .iter()
                    .filter(|(name, (url, _, _))| found.get(*name) != Some(url))
                    .map(|(name, _)| name.clone())
                    .collect();
                let mut stopping = Vec::new();
                for name in gone {
                    let (_, stop, task) = tasks.remove(&name).expect("listed");
                    tracing::info!(source = %name, "source no longer discovered: releasing it");
                    stop.cancel();
                    stopping.push((name, task));
                }
                for (name, task) in stopping {
                    let _ = task.await;
                    fleet.board.remove(&name);
                    fleet.share.forget(&name);
                }
                fleet.share.set_sources(found.len());
                for (name, url) in found {
                    // A task that ended by itself (it failed) is started again.
                    if tasks
                        .get(&name)
                        .is_some_and(|(_, _, task)| !task.is_finished())
                    {
                        continue;
                    }
                    if tasks.remove(&name).is_some() {
                        tracing::warn!(source = %name, "the source's task ended: starting it again");
                    } else {
                        tracing::info!(source = %name,
                            database = %crate::secret::redact_url(&url), "source discovered");
                        fleet.board.set(&name, SourceState::Starting);
                    }
                    let stop = shutdown.child_token();
                    let task = tokio::spawn(serve::run(
                        fleet.clone(),
                        name.clone(),
                        url.clone(),
                        stop.clone(),
                    ));
                    tasks.insert(name, (url, stop, task));
                }
            }
            Err(e) => {
                if failing.as_deref() != Some(e.as_str()) {
                    tracing::warn!(error = %e, sources = tasks.len(),
                        "sources discovery failed: serving the sources found before, retrying");
                    failing = Some(e);
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(fleet.settings.discover_interval) => {}
        }
    }
    // Every task stops at once (each drains its relay and leaves its source).
    for (_, stop, _) in tasks.values() {
        stop.cancel();
    }
    for (_, (_, _, task)) in tasks {
        let _ = task.await;
    }
}

//! What a many-source fleet needs to know: the sources listed in the config, where to
//! discover more and how often, how many processes may serve one source, the slot lease,
//! each served source's pool and the connection budget of each Postgres server. `config`
//! validates these values (naming the setting) and composes them into the process's
//! settings.

use std::collections::BTreeMap;
use std::time::Duration;

/// Validated settings of the sources a process serves. Empty (no source listed, nothing to
/// discover): the process serves the one database of `database_url`, as ever.
#[derive(Clone, Debug, PartialEq)]
pub struct SourcesSettings {
    /// The outbox schema of a source that names none (`outbox_schema`); the connection
    /// strings below name theirs already.
    pub schema: String,
    /// Sources listed in the config: name → connection string (naming its schema as
    /// `outbox_schema` when it is not `outbox`).
    pub listed: BTreeMap<String, String>,
    /// Every database on this server that holds the outbox schema is a source, named after
    /// the database.
    pub server_url: Option<String>,
    /// A catalogue database and the query that returns (name, connection string[, schema])
    /// rows.
    pub catalogue: Option<(String, String)>,
    /// How often discovery runs (and how often a source not served here is asked for).
    pub discover_interval: Duration,
    /// The most processes that may serve one source at once; None: every process when
    /// there is one source, one when there are many.
    pub processes_per_source: Option<i32>,
    /// How long a process's slot on a source holds without renewal.
    pub lease: Duration,
    /// Connections of each served source's pool.
    pub pool_size: usize,
    /// The fleet's cap on connections to one Postgres server (host and port), shared out
    /// evenly among the processes that serve its sources (their pools, `LISTEN` sessions
    /// and the poll sessions kept open between polls); None: no cap, and no poll session
    /// kept.
    pub max_connections_per_server: Option<usize>,
    /// Leasing calls (claims, completions, releases, lease repairs) one process runs at
    /// once on one Postgres server, over all the sources it serves there; None: no cap but
    /// each source's pool.
    pub calls_per_server: Option<usize>,
    /// Of those, the calls of backlogged sources (whose latest claim came back full) at
    /// once; the other turns are kept for the sources that are not backlogged. None: half
    /// of `calls_per_server`, rounded up, and one while quiet sources flow beside the
    /// backlog (adaptive turns, [`crate::store::Turns::adaptive`]).
    pub backlogged_calls_per_server: Option<usize>,
    /// Sources named in the `source` label of this process's metrics (the first ones it
    /// serves); the others are `other`.
    pub label_limit: usize,
}

impl Default for SourcesSettings {
    /// Nothing to serve; `calls_per_server` and `label_limit` at the defaults of
    /// `source_calls_per_server` and `source_label_limit`.
    fn default() -> Self {
        Self {
            schema: crate::connection::DEFAULT_SCHEMA.to_owned(),
            listed: BTreeMap::new(),
            server_url: None,
            catalogue: None,
            discover_interval: Duration::ZERO,
            processes_per_source: None,
            lease: Duration::ZERO,
            pool_size: 0,
            max_connections_per_server: None,
            calls_per_server: Some(4),
            backlogged_calls_per_server: None,
            label_limit: 50,
        }
    }
}

impl SourcesSettings {
    /// Whether this process serves sources (rather than the one `database_url`).
    pub fn is_many(&self) -> bool {
        !self.listed.is_empty() || self.server_url.is_some() || self.catalogue.is_some()
    }

    /// Slots of each source when `sources` sources are known: the setting, or every
    /// process (the most a slot table holds) for one source and one for several.
    pub fn slots(&self, sources: usize) -> i32 {
        self.processes_per_source
            .unwrap_or(if sources <= 1 { MAX_SLOTS } else { 1 })
    }

    /// How long a process's membership of a source holds: two discovery intervals and a
    /// lease, so that a late poll does not make the fleet look smaller than it is.
    pub fn membership_ttl(&self) -> Duration {
        self.discover_interval * 2 + self.lease
    }

    /// Connections a served source may open: its pool and its `LISTEN` session.
    pub fn connections_per_source(&self) -> usize {
        self.pool_size + 1
    }
}

/// The most slots `outbox.serve_source` gives out.
pub const MAX_SLOTS: i32 = 1024;

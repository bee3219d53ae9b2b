//! The one module that talks SQL, so that nothing else knows how the SQL API is called or
//! sees its errors (`connection` only opens sessions). It owns the connection pool, calls the `outbox.*` functions with
//! one statement each, converts rows into its own types and the domain's, and turns the
//! SQLSTATEs of the SQL API (`P7002` lease lost, `P7001` invalid argument) into typed errors.
//! Lease checks are never made here: the database makes them.
//!
//! One file per contract area, like the SQL API's:
//! - this file: the pool and its connections, [`StoreError`], `ping`;
//! - [`migrate`](Store::migrate) and [`check_schema`](Store::check_schema) (`migrate.rs`):
//!   the embedded migrations and the schema version this build needs;
//! - `enqueue.rs`: `outbox.enqueue`, on the pool or on the caller's own transaction;
//! - `lease.rs`: claim, complete, extend, release and repair, the leasing functions;
//! - `dead_letters.rs`: listing, reading and replaying dead letters;
//! - `observation.rs`: `outbox.observe` and the `outbox.status` view;
//! - `listen.rs`: the `LISTEN` connection that wakes the claimer, and its self-test;
//! - `statements.rs`: how the leasing calls send their statements (named and cached, or
//!   unnamed for transaction poolers), and the fallback from one to the other;
//! - `pooler.rs`: what sits between the relayer and Postgres (a transaction or statement
//!   pooler), found out at start;
//! - `sources.rs`: the slots through which a fleet shares many outboxes, and finding them;
//! - `turns.rs`: the turns of the leasing calls of one server's sources in a many-source
//!   process;
//! - `fill.rs`: synthetic messages in bulk, for the bench and the tests;
//! - `adopt.rs`: adopting an application's own outbox table, and the tables adopted;
//! - `key_order.rs`: the scope of a key's order (the whole outbox, or per topic) per topic
//!   pattern;
//! - `console.rs`: what the browser console reads and writes, each call under a statement
//!   timeout, counts capped, lists keyset-paginated.
//!
//! Every statement names its schema (`outbox.…`, or the source's own schema: `naming.rs`)
//! and nothing sets session state, so a statement means the same on whichever server
//! connection a pooler gives it. Outside the
//! leasing calls, statements are sent unnamed with their parameter types (one round trip,
//! nothing left on the server).

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};

use crate::connection::{Target, describe_chain};
use crate::secret::redact_url;

mod adopt;
mod console;
mod dead_letters;
mod enqueue;
mod fill;
mod key_order;
mod lease;
mod listen;
mod migrate;
mod naming;
mod observation;
mod pooler;
mod slots;
mod sources;
mod statements;
mod turns;

pub use adopt::AdoptedTable;
pub use console::{
    COUNT_CAP, CappedCount, DeadLetterRow, FailureRow, HolderRow, MessageDetail, MessageFilter,
    MessageRow, MessageState, MinuteRate, ReplayRow, SEARCH_WINDOW, WorkerRow, thousands,
};
pub use dead_letters::{AttemptRecord, DeadLetter, DeadLetterFilter};
pub use enqueue::{enqueue, enqueue_in};
pub use fill::{
    fill_messages, fill_messages_numbered, fill_messages_returning_ids,
    fill_messages_returning_ids_in,
};
pub use key_order::KeyOrderScope;
pub use lease::{ClaimSizes, Repair, TopicFilter};
pub use listen::{ListenerHealth, NOTIFY_CHANNEL};
pub use observation::{CircuitReport, ObservationRow, ReportedCircuit, StalledTopic, Status};
pub use pooler::{Pooling, STATEMENT_POOLING};
pub use slots::Rotation;
pub use sources::SourceTurn;
pub use statements::Statements;
pub use turns::{Turn, Turns};

/// Errors of the storage layer, split by what the caller should do about them.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLSTATE P7002: the lease is not held any more; someone else owns the outcome.
    #[error("lease lost: {0}")]
    LeaseLost(String),
    /// SQLSTATE P7001: an argument the SQL API refused; the message names it.
    #[error("{0}")]
    InvalidArgument(String),
    /// The connection string (or its TLS settings) could not be used.
    #[error("invalid database URL: {0}")]
    InvalidUrl(String),
    /// No connection could be made or had from the pool; `reason` says why in words
    /// (Postgres' message and SQLSTATE, refused connection, TLS problem).
    #[error("cannot connect to {target}: {reason}")]
    Unavailable {
        target: String,
        reason: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Any other database error (retry the operation later).
    #[error("database error: {message}")]
    Database {
        message: String,
        #[source]
        source: tokio_postgres::Error,
    },
    /// The schema is missing, older than this build, or not readable by this login.
    #[error("{0}")]
    Schema(String),
    #[error("migration failed: {0}")]
    Migration(String),
    /// The database URL reaches a pooler that cannot serve the relayer (statement mode).
    #[error("{0}")]
    Pooler(String),
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        match e.as_db_error() {
            Some(db) if db.code().code() == "P7002" => StoreError::LeaseLost(db.message().into()),
            Some(db) if db.code().code() == "P7001" => {
                StoreError::InvalidArgument(db.message().into())
            }
            Some(db) => StoreError::Database {
                message: format!("{} (SQLSTATE {})", db.message(), db.code().code()),
                source: e,
            },
            None => StoreError::Database {
                message: describe_chain(&e),
                source: e,
            },
        }
    }
}

impl StoreError {
    /// A connection to `target` could not be made: `e` explained in words (see
    /// [`Target::explain`]), kept as the source.
    pub fn connect_failed(target: &Target, e: tokio_postgres::Error) -> Self {
        StoreError::Unavailable {
            target: target.describe(),
            reason: target.explain(&e),
            source: Box::new(e),
        }
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// A session's connection to drive: its messages (notifications among them) are read from it.
type Connection = tokio_postgres::Connection<
    tokio_postgres::Socket,
    <tokio_postgres_rustls::MakeRustlsConnect as tokio_postgres::tls::MakeTlsConnect<
        tokio_postgres::Socket,
    >>::Stream,
>;

/// A session of its own on `target`, outside the pool (the listener, the pooler probe);
/// the caller drives its connection.
async fn session(target: &Target) -> Result<(tokio_postgres::Client, Connection)> {
    target
        .config
        .connect(target.tls.clone())
        .await
        .map_err(|e| StoreError::connect_failed(target, e))
}

/// Sizes of the connection pool, for the pool gauges.
#[derive(Clone, Copy, Debug)]
pub struct PoolStatus {
    pub size: usize,
    pub available: usize,
    pub max_size: usize,
}

/// Handle to the outbox database; cheap to clone.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    target: Arc<Target>,
    /// Where the notification listener connects: `target` unless a `listen_url` was given.
    listen_target: Arc<Target>,
    statements: Arc<statements::Mode>,
    listener: Arc<listen::State>,
    /// Turns for the leasing calls, shared by the stores of one server's sources in a
    /// many-source process, and this store's part of them (see [`Store::with_turns`]);
    /// None: no cap but the pool's.
    turns: Option<Arc<TurnsHere>>,
    /// Whether the latest claim came back full (a backlog), which decides the kind of turn
    /// the leasing calls wait for.
    backlogged: Arc<std::sync::atomic::AtomicBool>,
    /// Whether the latest claim got no message (an idle source; see
    /// [`Store::latest_claim_empty`]).
    empty: Arc<std::sync::atomic::AtomicBool>,
    /// Its URL is the default one, not given (see [`Store::on_default_database`]).
    default_database: bool,
}

/// A store's part of its server's turns: the turns, and how many of the store's pool's
/// connections its leasing calls may hold at once (all but one, at least one), so that a
/// call waiting for a turn never keeps the slot's renewal and the lease extensions waiting
/// for a connection.
#[derive(Debug)]
struct TurnsHere {
    turns: Arc<Turns>,
    connections: tokio::sync::Semaphore,
}

/// A leasing call's connection (it derefs to it), with its turn and its place among the
/// leasing calls' connections when the store has turns; all are given back when it drops,
/// the turn first.
pub(super) struct LeasingCall<'a> {
    _turn: Option<turns::Turn<'a>>,
    client: deadpool_postgres::Object,
    _connection: Option<tokio::sync::SemaphorePermit<'a>>,
}

impl std::ops::Deref for LeasingCall<'_> {
    type Target = deadpool_postgres::Object;

    fn deref(&self) -> &Self::Target {
        &self.client
    }
}

impl Store {
    /// Builds a pool of at most `max_connections` to `url` (TLS as its `sslmode` and the
    /// `PG*` variables say; see [`crate::connection`]). Connections are opened lazily, so this
    /// fails only on a malformed URL; use [`Store::ping`] to check reachability.
    pub fn connect(url: &str, max_connections: usize) -> Result<Self> {
        Self::connect_as(url, max_connections, "outbox-relay")
    }

    /// [`Store::connect`], its sessions named `application_name` (in `pg_stat_activity`)
    /// unless the URL names them.
    pub fn connect_as(url: &str, max_connections: usize, application_name: &str) -> Result<Self> {
        let mut target = Target::parse(url)
            .map_err(|e| StoreError::InvalidUrl(format!("{e} (in {})", redact_url(url))))?;
        let config = &mut target.config;
        if config.get_application_name().is_none() {
            config.application_name(application_name);
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
        let manager = Manager::from_config(
            target.config.clone(),
            target.tls.clone(),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(max_connections)
            // The connection used last is handed out first, so that the ones a quiet
            // source does not need stay idle and are closed by `close_idle`.
            .queue_mode(deadpool_postgres::QueueMode::Lifo)
            .wait_timeout(Some(Duration::from_secs(30)))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| StoreError::InvalidUrl(e.to_string()))?;
        let target = Arc::new(target);
        Ok(Self {
            pool,
            listen_target: target.clone(),
            target,
            statements: Arc::new(statements::Mode::new(Statements::Auto)),
            listener: Arc::new(listen::State::default()),
            turns: None,
            backlogged: Arc::default(),
            empty: Arc::default(),
            default_database: false,
        })
    }

    /// The same store, known to be on the default database (no URL was given: the
    /// server's `postgres` database), so that a missing or old schema is reported with the
    /// fix of naming the outbox's database rather than of migrating this one.
    pub fn on_default_database(mut self) -> Self {
        self.default_database = true;
        self
    }

    /// The same store, its leasing calls (claims, completions, releases and lease repairs;
    /// not lease extensions) each waiting for one of `turns` and holding it while the
    /// database runs them. Shared by the stores of every source one process serves on a
    /// server, it caps how many of those calls that server runs for the process at once,
    /// however many sources it serves, and how many of them come from backlogged sources
    /// ([`Turns`]). The leasing calls then hold at most all but one of the pool's
    /// connections at once (each from before it waits for its turn until its call ends), so
    /// that a call queued for the server's turns never keeps the source's slot renewal
    /// (`serve_source`) or a lease extension waiting for a connection.
    pub fn with_turns(mut self, turns: Arc<Turns>) -> Self {
        let connections = self.pool.status().max_size.saturating_sub(1).max(1);
        self.turns = Some(Arc::new(TurnsHere {
            turns,
            connections: tokio::sync::Semaphore::new(connections),
        }));
        self
    }

    /// The same store, sending its leasing statements as `statements` says.
    pub fn with_statements(mut self, statements: Statements) -> Self {
        self.statements = Arc::new(statements::Mode::new(statements));
        self
    }

    /// The same store, listening for notifications on a connection to `url` (a direct
    /// connection when `url` of [`Store::connect`] goes through a transaction pooler).
    pub fn with_listen_url(mut self, url: &str) -> Result<Self> {
        let mut target = Target::parse(url).map_err(|e| {
            StoreError::InvalidUrl(format!("{e} (in listen_url {})", redact_url(url)))
        })?;
        if target.config.get_application_name().is_none() {
            target.config.application_name("outbox-relay listener");
        }
        if target.config.get_connect_timeout().is_none() {
            target.config.connect_timeout(Duration::from_secs(10));
        }
        self.listen_target = Arc::new(target);
        Ok(self)
    }

    /// What a leasing call holds while it runs: with turns, its place among the leasing
    /// calls' connections, then a connection, then one of the server's turns (see
    /// [`Store::with_turns`]); without, a connection. The connection comes before the turn,
    /// so that a turn is held only while the database runs the call, never while waiting
    /// for this source's pool.
    pub(super) async fn leasing_call(&self) -> Result<LeasingCall<'_>> {
        let Some(here) = &self.turns else {
            return Ok(LeasingCall {
                _turn: None,
                client: self.client().await?,
                _connection: None,
            });
        };
        let connection = here.connections.acquire().await.expect("never closed");
        let client = self.client().await?;
        let backlogged = self.backlogged.load(std::sync::atomic::Ordering::Relaxed);
        Ok(LeasingCall {
            _turn: Some(here.turns.take(backlogged).await),
            client,
            _connection: Some(connection),
        })
    }

    /// Records whether a claim came back `full` (its batch or its byte budget filled: a
    /// backlog) and whether it `got` any message.
    ///
    /// A claim that got messages without filling, when the claim before it did not fill
    /// either, is quiet traffic, which makes adaptive turns hold backlogged calls to one at
    /// a time ([`Turns::quiet_flowed`]); the last claim of a backlog that runs dry is not.
    pub(super) fn claimed(&self, full: bool, got: bool) {
        self.empty.store(!got, std::sync::atomic::Ordering::Relaxed);
        let was_full = self
            .backlogged
            .swap(full, std::sync::atomic::Ordering::Relaxed);
        if got
            && !full
            && !was_full
            && let Some(here) = &self.turns
        {
            here.turns.quiet_flowed();
        }
    }

    /// Whether the latest claim got no message: the source had nothing ready then.
    pub fn latest_claim_empty(&self) -> bool {
        self.empty.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Where and how this store connects.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// The schema that holds this store's outbox (`outbox_schema` of its connection string).
    pub fn schema(&self) -> &str {
        &self.target.schema
    }

    /// `sql`, written against schema `outbox`, for this store's schema
    /// ([`naming::in_schema`]): the text itself for the default schema.
    fn sql<'a>(&self, sql: &'a str) -> std::borrow::Cow<'a, str> {
        naming::in_schema(sql, &self.target.schema)
    }

    async fn client(&self) -> Result<deadpool_postgres::Object> {
        self.pool.get().await.map_err(|e| self.unavailable(e))
    }

    fn unavailable(&self, e: deadpool_postgres::PoolError) -> StoreError {
        let reason = match e {
            deadpool_postgres::PoolError::Backend(e) => {
                return StoreError::connect_failed(&self.target, e);
            }
            deadpool_postgres::PoolError::Timeout(_) => {
                "no connection became free in time (pool exhausted or the server is not \
                 answering)"
                    .to_owned()
            }
            ref other => other.to_string(),
        };
        StoreError::Unavailable {
            target: self.target.describe(),
            reason,
            source: Box::new(e),
        }
    }

    /// `SELECT 1`: is the database reachable?
    pub async fn ping(&self) -> Result<()> {
        self.client().await?.simple_query("SELECT 1").await?;
        Ok(())
    }

    /// Closes the pool's connections that nobody used for `idle`; returns how many.
    pub fn close_idle(&self, idle: Duration) -> usize {
        self.pool
            .retain(|_, metrics| metrics.last_used() < idle)
            .removed
            .len()
    }

    pub fn pool_status(&self) -> PoolStatus {
        let s = self.pool.status();
        PoolStatus {
            size: s.size,
            available: s.available,
            max_size: s.max_size,
        }
    }
}

/// `url` (a `postgres://` URL) with its database name replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
    let (main, query) = url
        .split_once('?')
        .map_or((url, None), |(m, q)| (m, Some(q)));
    let scheme_end = main.find("://").map_or(0, |i| i + 3);
    let base = main[scheme_end..]
        .find('/')
        .map_or(main, |i| &main[..scheme_end + i]);
    match query {
        Some(q) => format!("{base}/{db}?{q}"),
        None => format!("{base}/{db}"),
    }
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn swaps_the_database_name_and_keeps_the_query() {
        assert_eq!(
            with_database("postgres://u@h:5432/postgres?sslmode=require", "x"),
            "postgres://u@h:5432/x?sslmode=require"
        );
        assert_eq!(with_database("postgres://u@h", "x"), "postgres://u@h/x");
    }
}

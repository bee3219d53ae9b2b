//! The one module that talks SQL. It owns the connection pool, calls the `outbox.*`
//! functions with one statement each, converts rows into domain types and turns the
//! SQLSTATEs of the SQL API (`P7002` lease lost, `P7001` invalid argument) into typed errors.
//! Lease checks are never made here: the database makes them.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio_postgres::{AsyncMessage, Row};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::connection::{Target, describe_chain};
use crate::message::{
    ClaimedMessage, Completion, CompletionResult, LeaseToken, NewMessage, OutboxId, Payload,
    WorkerId,
};
use crate::secret::redact_url;

/// Channel that `outbox.enqueue` notifies when a message is ready.
pub const NOTIFY_CHANNEL: &str = "outbox_new";

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

/// Figures of the `outbox.status` view.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Status {
    pub ready: i64,
    pub delayed: i64,
    pub in_flight: i64,
    pub expired_leases: i64,
    pub dead_letters: i64,
    /// Age of the oldest ready message, in seconds (None when nothing is ready).
    pub oldest_ready_age_secs: Option<f64>,
}

/// Which dead letters an operator verb looks at; `None` matches everything.
#[derive(Clone, Debug, Default)]
pub struct DeadLetterFilter {
    /// These dead letters only.
    pub ids: Option<Vec<Uuid>>,
    pub topic: Option<String>,
    /// Dead-lettered at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// The last error contains this text (any case).
    pub error_contains: Option<String>,
}

/// A row of `outbox.dead_letters`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeadLetter {
    pub outbox_id: Uuid,
    pub topic: String,
    pub message_key: Option<String>,
    pub content_type: String,
    pub headers: serde_json::Value,
    #[serde(skip)]
    pub payload: Vec<u8>,
    pub payload_bytes: i64,
    pub created_at: DateTime<Utc>,
    pub dead_lettered_at: DateTime<Utc>,
    pub attempt_count: i32,
    pub max_attempts: i32,
    pub last_error: Option<String>,
}

/// A row of `outbox.attempts`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AttemptRecord {
    pub attempt_no: i32,
    pub state: String,
    pub worker_id: String,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// Result of one `repair_expired_leases` pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Repair {
    pub requeued: i32,
    pub dead_lettered: i32,
}

/// A row of `outbox.observe`.
#[derive(Clone, Debug)]
pub struct ObservationRow {
    pub observed_at: DateTime<Utc>,
    /// Whether this call computed it (rather than reading another process's).
    pub refreshed: bool,
    /// The figures, shaped as documented on `outbox.observe`.
    pub snapshot: serde_json::Value,
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
}

impl Store {
    /// Builds a pool of at most `max_connections` to `url` (TLS as its `sslmode` and the
    /// `PG*` variables say; see [`crate::connection`]). Connections are opened lazily, so this
    /// fails only on a malformed URL; use [`Store::ping`] to check reachability.
    pub fn connect(url: &str, max_connections: usize) -> Result<Self> {
        let mut target = Target::parse(url)
            .map_err(|e| StoreError::InvalidUrl(format!("{e} (in {})", redact_url(url))))?;
        let config = &mut target.config;
        if config.get_application_name().is_none() {
            config.application_name("outbox-relay");
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
            .wait_timeout(Some(Duration::from_secs(30)))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| StoreError::InvalidUrl(e.to_string()))?;
        Ok(Self {
            pool,
            target: Arc::new(target),
        })
    }

    /// Where and how this store connects.
    pub fn target(&self) -> &Target {
        &self.target
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

    /// Applies the embedded migrations that are not applied yet; returns their names.
    /// A session advisory lock makes processes that start together migrate one at a time.
    /// A login that cannot own the schema (such as one holding only `outbox_relay`) is
    /// refused before anything runs, with a message that says which role to use.
    pub async fn migrate(&self) -> Result<Vec<String>> {
        let mut client = self.client().await?;
        let row = client
            .query_one(
                "SELECT current_user::text, \
                        CASE WHEN n.oid IS NULL \
                             THEN has_database_privilege(current_database(), 'CREATE') \
                             ELSE pg_has_role(n.nspowner, 'USAGE') END, \
                        pg_get_userbyid(n.nspowner)::text \
                   FROM (SELECT 1) AS one \
                   LEFT JOIN pg_namespace AS n ON n.nspname = 'outbox'",
                &[],
            )
            .await?;
        let (user, allowed, owner): (String, bool, Option<String>) =
            (row.get(0), row.get(1), row.get(2));
        if !allowed {
            return Err(StoreError::Migration(match owner {
                Some(owner) => format!(
                    "login {user:?} cannot change schema outbox, which belongs to {owner:?}: run \
                     `outbox-relay migrate` as {owner:?} (the DDL role); the relayer itself \
                     needs only a login in outbox_relay"
                ),
                None => format!(
                    "login {user:?} cannot create schema outbox (no CREATE right on the \
                     database): run `outbox-relay migrate` as the database owner (the DDL role)"
                ),
            }));
        }
        client
            .execute("SELECT pg_advisory_lock(hashtext('outbox.migrate'))", &[])
            .await?;
        let report = crate::schema::runner().run_async(&mut **client).await;
        client
            .execute("SELECT pg_advisory_unlock(hashtext('outbox.migrate'))", &[])
            .await?;
        let report = report.map_err(|e| StoreError::Migration(e.to_string()))?;
        Ok(report
            .applied_migrations()
            .iter()
            .map(|m| m.to_string())
            .collect())
    }

    /// The schema's version, checked against what this build needs: an error names the
    /// version found, the version needed and the command that fixes it. A newer schema is
    /// accepted (migrations only add), so a fleet can be upgraded after its schema.
    pub async fn check_schema(&self) -> Result<i32> {
        let needed = crate::schema::version();
        let client = self.client().await?;
        let row = client
            .query_one(
                "SELECT to_regnamespace('outbox') IS NOT NULL, \
                        to_regprocedure('outbox.schema_version()') IS NOT NULL, \
                        current_database()::text, current_user::text",
                &[],
            )
            .await?;
        let (schema, function, database, user): (bool, bool, String, String) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let fix = "run `outbox-relay migrate` (as the schema owner)";
        if !schema {
            return Err(StoreError::Schema(format!(
                "schema outbox does not exist in database {database:?} (never migrated); this \
                 build needs version {needed}: {fix}"
            )));
        }
        let found = if function {
            match client
                .query_one("SELECT outbox.schema_version()", &[])
                .await
            {
                Ok(row) => row.get::<_, Option<i32>>(0),
                Err(e) if e.code().is_some_and(|c| c.code() == "42501") => {
                    return Err(StoreError::Schema(format!(
                        "login {user:?} may not use schema outbox: grant it one of the roles \
                         outbox_relay, outbox_producer or outbox_reader"
                    )));
                }
                Err(e) => return Err(e.into()),
            }
        } else {
            // Before version 5 there was no schema_version(); the history table says which.
            client
                .query_opt(
                    "SELECT max(version) FROM refinery_schema_history \
                      WHERE has_table_privilege('refinery_schema_history', 'SELECT')",
                    &[],
                )
                .await
                .ok()
                .flatten()
                .and_then(|row| row.get::<_, Option<i32>>(0))
        };
        match found {
            Some(found) if found >= needed => Ok(found),
            Some(found) => Err(StoreError::Schema(format!(
                "schema outbox is at version {found}, this build needs {needed}: {fix}"
            ))),
            None => Err(StoreError::Schema(format!(
                "schema outbox predates version 5, this build needs {needed}: {fix}"
            ))),
        }
    }

    /// `SELECT 1`: is the database reachable?
    pub async fn ping(&self) -> Result<()> {
        self.client().await?.simple_query("SELECT 1").await?;
        Ok(())
    }

    pub fn pool_status(&self) -> PoolStatus {
        let s = self.pool.status();
        PoolStatus {
            size: s.size,
            available: s.available,
            max_size: s.max_size,
        }
    }

    /// `outbox.enqueue` on a connection of the pool, in a transaction of its own.
    pub async fn enqueue(&self, message: &NewMessage) -> Result<OutboxId> {
        let client = self.client().await?;
        Ok(enqueue(&**client, message).await?)
    }

    /// `outbox.claim_outbox_batch`: leases up to `batch_size` ready messages of `topics`
    /// (all when `None`) whose topic matches none of the LIKE patterns in `exclude`, within
    /// the byte limits of `sizes`.
    pub async fn claim(
        &self,
        batch_size: i32,
        worker: &WorkerId,
        lease_secs: i32,
        topics: Option<&[String]>,
        exclude: Option<&[String]>,
        sizes: ClaimSizes,
    ) -> Result<Vec<ClaimedMessage>> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached("SELECT * FROM outbox.claim_outbox_batch($1, $2, $3, $4, $5, $6, $7)")
            .await?;
        let rows = client
            .query(
                &stmt,
                &[
                    &batch_size,
                    &worker.as_str(),
                    &lease_secs,
                    &topics,
                    &exclude,
                    &sizes.max_batch_bytes,
                    &sizes.max_message_bytes,
                ],
            )
            .await?;
        Ok(rows.iter().map(claimed_from_row).collect())
    }

    /// `outbox.complete_outbox_batch`: one round trip for a whole batch. Lost leases come
    /// back as `lease_lost` rows, in input order.
    pub async fn complete(
        &self,
        worker: &WorkerId,
        completions: &[Completion],
    ) -> Result<Vec<CompletionResult>> {
        let ids: Vec<Uuid> = completions.iter().map(|c| c.id.0).collect();
        let tokens: Vec<Uuid> = completions.iter().map(|c| c.lease_token.0).collect();
        let states: Vec<&str> = completions.iter().map(|c| c.state.as_sql()).collect();
        let errors: Vec<Option<&str>> = completions.iter().map(|c| c.error.as_deref()).collect();
        let retry_ats: Vec<Option<DateTime<Utc>>> =
            completions.iter().map(|c| c.retry_at).collect();
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(
                "SELECT * FROM outbox.complete_outbox_batch(\
                 $1, $2, $3, $4::text[]::outbox.attempt_state[], $5, $6)",
            )
            .await?;
        let rows = client
            .query(
                &stmt,
                &[
                    &worker.as_str(),
                    &ids,
                    &tokens,
                    &states,
                    &errors,
                    &retry_ats,
                ],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| CompletionResult {
                id: OutboxId(r.get(0)),
                attempt_no: r.get(1),
                lease_lost: r.get(2),
                dead_lettered: r.get(3),
            })
            .collect())
    }

    /// `outbox.extend_outbox_leases`: returns the leases still held and their new expiry.
    pub async fn extend(
        &self,
        worker: &WorkerId,
        leases: &[(OutboxId, LeaseToken)],
        lease_secs: i32,
    ) -> Result<Vec<(OutboxId, DateTime<Utc>)>> {
        let (ids, tokens) = split_leases(leases);
        let client = self.client().await?;
        let stmt = client
            .prepare_cached("SELECT * FROM outbox.extend_outbox_leases($1, $2, $3, $4)")
            .await?;
        let rows = client
            .query(&stmt, &[&worker.as_str(), &ids, &tokens, &lease_secs])
            .await?;
        Ok(rows
            .iter()
            .map(|r| (OutboxId(r.get(0)), r.get(1)))
            .collect())
    }

    /// `outbox.release_outbox_leases`: gives back undispatched messages; returns how many.
    pub async fn release(
        &self,
        worker: &WorkerId,
        leases: &[(OutboxId, LeaseToken)],
    ) -> Result<i32> {
        let (ids, tokens) = split_leases(leases);
        let client = self.client().await?;
        let stmt = client
            .prepare_cached("SELECT outbox.release_outbox_leases($1, $2, $3)")
            .await?;
        let row = client
            .query_one(&stmt, &[&worker.as_str(), &ids, &tokens])
            .await?;
        Ok(row.get(0))
    }

    /// `outbox.repair_expired_leases`: one pass over expired leases.
    pub async fn repair(&self, limit: i32) -> Result<Repair> {
        let client = self.client().await?;
        let row = client
            .query_one("SELECT * FROM outbox.repair_expired_leases($1)", &[&limit])
            .await?;
        Ok(Repair {
            requeued: row.get(0),
            dead_lettered: row.get(1),
        })
    }

    /// `outbox.start_replay`: records a replay of what `filter` selects (with `reason`) and
    /// returns its id; nothing moves until [`Store::replay_step`].
    pub async fn start_replay(
        &self,
        filter: &DeadLetterFilter,
        reason: Option<&str>,
    ) -> Result<i64> {
        let client = self.client().await?;
        let row = client
            .query_one(
                "SELECT outbox.start_replay($1, $2, $3, $4, $5)",
                &[
                    &filter.ids,
                    &filter.topic,
                    &filter.since,
                    &filter.error_contains,
                    &reason,
                ],
            )
            .await?;
        Ok(row.get(0))
    }

    /// `outbox.replay_step`: moves up to `limit` more dead letters of replay `replay_id`;
    /// returns how many (0: done).
    pub async fn replay_step(&self, replay_id: i64, limit: i32) -> Result<i32> {
        let client = self.client().await?;
        let row = client
            .query_one("SELECT outbox.replay_step($1, $2)", &[&replay_id, &limit])
            .await?;
        Ok(row.get(0))
    }

    /// `outbox.observe`: the fleet's latest observation, refreshed first when it is older
    /// than `max_age` and no other process is refreshing it; `None` before the first one.
    /// The snapshot comes back as the JSON the function returned; `observe` reads it.
    pub async fn observe(
        &self,
        top_topics: i32,
        max_age: Duration,
    ) -> Result<Option<ObservationRow>> {
        let client = self.client().await?;
        let row = client
            .query_one(
                "SELECT observed_at, refreshed, snapshot \
                 FROM outbox.observe($1, make_interval(secs => $2))",
                &[&top_topics, &max_age.as_secs_f64()],
            )
            .await?;
        let Some(observed_at) = row.get::<_, Option<DateTime<Utc>>>(0) else {
            return Ok(None);
        };
        Ok(Some(ObservationRow {
            observed_at,
            refreshed: row.get(1),
            snapshot: row.get(2),
        }))
    }

    /// Dead letters matching `filter`, newest first, at most `limit` (payloads not loaded).
    pub async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: i64,
    ) -> Result<Vec<DeadLetter>> {
        let client = self.client().await?;
        let rows = client
            .query(
                &format!(
                    "SELECT {DEAD_LETTER_COLUMNS}, ''::bytea FROM {DEAD_LETTERS_MATCHING} \
                     ORDER BY dead_lettered_at DESC, outbox_id LIMIT $5"
                ),
                &[
                    &filter.ids,
                    &filter.topic,
                    &filter.since,
                    &filter.error_contains,
                    &limit,
                ],
            )
            .await?;
        Ok(rows.iter().map(dead_letter).collect())
    }

    /// How many dead letters match `filter`.
    pub async fn dead_letter_count(&self, filter: &DeadLetterFilter) -> Result<i64> {
        let client = self.client().await?;
        let row = client
            .query_one(
                &format!("SELECT count(*) FROM {DEAD_LETTERS_MATCHING}"),
                &[
                    &filter.ids,
                    &filter.topic,
                    &filter.since,
                    &filter.error_contains,
                ],
            )
            .await?;
        Ok(row.get(0))
    }

    /// One dead letter with its payload and every attempt, oldest first.
    pub async fn dead_letter(
        &self,
        id: OutboxId,
    ) -> Result<Option<(DeadLetter, Vec<AttemptRecord>)>> {
        let client = self.client().await?;
        let Some(row) = client
            .query_opt(
                &format!(
                    "SELECT {DEAD_LETTER_COLUMNS}, payload FROM outbox.dead_letters \
                     WHERE outbox_id = $1"
                ),
                &[&id.0],
            )
            .await?
        else {
            return Ok(None);
        };
        let attempts = client
            .query(
                "SELECT attempt_no, state::text, worker_id, error, created_at \
                 FROM outbox.attempts WHERE outbox_id = $1 ORDER BY attempt_no",
                &[&id.0],
            )
            .await?
            .iter()
            .map(|r| AttemptRecord {
                attempt_no: r.get(0),
                state: r.get(1),
                worker_id: r.get(2),
                error: r.get(3),
                created_at: r.get(4),
            })
            .collect();
        Ok(Some((dead_letter(&row), attempts)))
    }

    /// The `outbox.status` view.
    pub async fn status(&self) -> Result<Status> {
        let client = self.client().await?;
        let row = client
            .query_one(
                "SELECT ready, delayed, in_flight, expired_leases, dead_letters, \
                 extract(epoch FROM oldest_ready_age)::float8 FROM outbox.status",
                &[],
            )
            .await?;
        Ok(Status {
            ready: row.get(0),
            delayed: row.get(1),
            in_flight: row.get(2),
            expired_leases: row.get(3),
            dead_letters: row.get(4),
            oldest_ready_age_secs: row.get(5),
        })
    }

    /// Keeps a dedicated connection listening on [`NOTIFY_CHANNEL`] and calls
    /// `wake.notify_one()` for every notification, reconnecting (with backoff) when the
    /// connection drops, until `shutdown` is cancelled. After every (re)connect it wakes once,
    /// since notifications sent while disconnected are lost.
    pub async fn listen(&self, wake: Arc<Notify>, shutdown: CancellationToken) {
        let mut backoff = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            let ended = tokio::select! {
                ended = self.listen_once(&wake) => ended,
                () = shutdown.cancelled() => return,
            };
            if let Err(e) = ended {
                tracing::warn!(error = %e, retry_in_ms = crate::telemetry::millis(backoff),
                    "notification listener lost its connection; polling until it is back");
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = shutdown.cancelled() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(10));
        }
    }

    async fn listen_once(&self, wake: &Arc<Notify>) -> Result<()> {
        let (client, mut connection) = self
            .target
            .config
            .connect(self.target.tls.clone())
            .await
            .map_err(|e| StoreError::connect_failed(&self.target, e))?;
        let forward = wake.clone();
        let mut driver = tokio::spawn(async move {
            let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                if let AsyncMessage::Notification(_) = message? {
                    forward.notify_one();
                }
            }
            Ok::<(), tokio_postgres::Error>(())
        });
        client
            .batch_execute(&format!("LISTEN {NOTIFY_CHANNEL}"))
            .await?;
        wake.notify_one();
        let ended = (&mut driver).await;
        drop(client);
        match ended {
            Ok(result) => Ok(result?),
            Err(e) => Err(StoreError::Unavailable {
                target: self.target.describe(),
                reason: "the notification listener's task ended".to_owned(),
                source: Box::new(e),
            }),
        }
    }
}

fn split_leases(leases: &[(OutboxId, LeaseToken)]) -> (Vec<Uuid>, Vec<Uuid>) {
    leases.iter().map(|(id, token)| (id.0, token.0)).unzip()
}

/// Byte limits of a claim (`None`: no limit).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClaimSizes {
    /// The batch stops before the message that would take its payloads past this (the
    /// first message is always taken).
    pub max_batch_bytes: Option<i64>,
    /// Larger payloads are not loaded: the message comes back with `payload_withheld`.
    pub max_message_bytes: Option<i64>,
}

fn claimed_from_row(r: &Row) -> ClaimedMessage {
    let payload: Option<Vec<u8>> = r.get("payload");
    ClaimedMessage {
        payload_withheld: payload.is_none(),
        payload_bytes: r.get("payload_bytes"),
        id: OutboxId(r.get("outbox_id")),
        lease_token: LeaseToken(r.get("lease_token")),
        topic: r.get("topic"),
        key: r.get("message_key"),
        payload: payload.unwrap_or_default(),
        content_type: r.get("content_type"),
        headers: r.get("headers"),
        attempt_no: r.get("attempt_no"),
        created_at: r.get("created_at"),
        lease_expires_at: r.get("lease_expires_at"),
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

const DEAD_LETTER_COLUMNS: &str = "outbox_id, topic, message_key, content_type, headers, \
     octet_length(payload)::bigint, created_at, dead_lettered_at, attempt_count, max_attempts, \
     last_error";

/// The dead letters a [`DeadLetterFilter`] selects (`$1` ids, `$2` topic, `$3` since,
/// `$4` error text): the filter is defined once, in SQL, for listing and replaying alike.
const DEAD_LETTERS_MATCHING: &str =
    "outbox.dead_letters_matching($1::uuid[], $2::text, $3::timestamptz, $4::text) AS d";

fn dead_letter(r: &Row) -> DeadLetter {
    DeadLetter {
        outbox_id: r.get(0),
        topic: r.get(1),
        message_key: r.get(2),
        content_type: r.get(3),
        headers: r.get(4),
        payload_bytes: r.get(5),
        created_at: r.get(6),
        dead_lettered_at: r.get(7),
        attempt_count: r.get(8),
        max_attempts: r.get(9),
        last_error: r.get(10),
        payload: r.get(11),
    }
}

/// `outbox.enqueue` on the caller's own connection or transaction, so the message commits
/// (and wakes the relayers) with the caller's other writes, or not at all. Takes a
/// `tokio_postgres::Transaction` or `Client`; from a `deadpool_postgres` pool, pass
/// `&*transaction` or `&**client`. The login needs the `outbox_producer` role.
///
/// ```no_run
/// # async fn order_placed(pool: deadpool_postgres::Pool) -> anyhow::Result<()> {
/// use outbox_relay::message::NewMessage;
///
/// let mut client = pool.get().await?;
/// let tx = client.transaction().await?;
/// tx.execute("UPDATE orders SET state = 'placed' WHERE id = $1", &[&42_i64]).await?;
/// let id = outbox_relay::store::enqueue(
///     &*tx,
///     &NewMessage {
///         topic: "orders.placed".into(),
///         key: Some("order-42".into()),
///         payload: serde_json::json!({"order_id": 42}).into(),
///         headers: Some(serde_json::json!({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})),
///         ..NewMessage::default()
///     },
/// )
/// .await?;
/// tx.commit().await?; // the order and its message, together
/// println!("enqueued {id}");
/// # Ok(())
/// # }
/// ```
pub async fn enqueue(
    client: &impl tokio_postgres::GenericClient,
    message: &NewMessage,
) -> std::result::Result<OutboxId, tokio_postgres::Error> {
    let common: [&(dyn tokio_postgres::types::ToSql + Sync); 6] = [
        &message.topic,
        &message.key,
        &message.headers,
        &message.available_at,
        &message.id.map(|id| id.0),
        &message.max_attempts,
    ];
    let row =
        match &message.payload {
            Payload::Json(json) => client
                .query_one(
                    "SELECT outbox.enqueue($1, $7::jsonb, $2, coalesce($3::jsonb, '{}'), $4, $5, \
                     coalesce($6, 10))",
                    &[&common[..], &[json]].concat(),
                )
                .await?,
            Payload::Bytes { data, content_type } => client
                .query_one(
                    "SELECT outbox.enqueue($1, $7::bytea, $2, coalesce($3::jsonb, '{}'), $4, $5, \
                     coalesce($6, 10), $8)",
                    &[&common[..], &[data, content_type]].concat(),
                )
                .await?,
        };
    Ok(OutboxId(row.get(0)))
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

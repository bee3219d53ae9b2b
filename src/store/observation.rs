//! What the database says about the outbox as a whole: `outbox.observe` (the fleet's
//! snapshot, computed by one process per interval; `observe` reads its JSON), the
//! `outbox.status` view, the destinations' circuits as the relayers report them
//! (`outbox.report_circuits`, the `outbox.circuits` view; `outbox-relay status`), and the
//! topics the relayers claim and their routes (`outbox.report_coverage`) with the topics
//! none claims or all leave out behind an open circuit (`outbox.stalled_topics`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::types::Type;

use super::{Result, Store};
use crate::message::WorkerId;

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

/// A row of `outbox.observe`.
#[derive(Clone, Debug)]
pub struct ObservationRow {
    pub observed_at: DateTime<Utc>,
    /// Whether this call computed it (rather than reading another process's).
    pub refreshed: bool,
    /// The figures, shaped as documented on `outbox.observe`.
    pub snapshot: serde_json::Value,
}

/// One destination's circuit as one relayer reports it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct CircuitReport {
    pub destination: String,
    /// `closed`, `open` or `half-open`.
    pub state: String,
    /// When the circuit entered the state, by the relayer's clock.
    pub since: DateTime<Utc>,
}

/// A row of the `outbox.circuits` view.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ReportedCircuit {
    pub worker_id: String,
    #[serde(flatten)]
    pub report: CircuitReport,
    pub reported_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// Not renewed before `expires_at`: the relayer stopped, or cannot reach the database.
    pub stale: bool,
}

/// A row of `outbox.stalled_topics`: a topic whose ready messages wait because no running
/// relayer claims them, or because every relayer that claims them leaves them out while
/// their destination's circuit is open.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StalledTopic {
    pub topic: String,
    /// `uncovered` (no running relayer claims the topic) or `circuit_open` (every relayer
    /// claiming it has the circuit of its destination open or half-open).
    pub cause: String,
    /// For `circuit_open`, those destinations; empty for `uncovered`.
    pub destinations: Vec<String>,
    /// Messages of the topic ready for longer than the bound asked for.
    pub ready: i64,
    /// How long the oldest of them has been ready, in seconds.
    pub oldest_ready_age_secs: f64,
    /// Keys with a message of this topic pending before a message of another topic: by
    /// per-key order, those wait for this topic's.
    pub held_keys: i64,
    /// The other topics those waiting messages are on.
    pub held_topics: Vec<String>,
}

impl StalledTopic {
    /// The `cause` of a topic no running relayer claims.
    pub const UNCOVERED: &'static str = "uncovered";
    /// The `cause` of a topic held behind open circuits.
    pub const CIRCUIT_OPEN: &'static str = "circuit_open";

    /// No running relayer claims it.
    pub fn is_uncovered(&self) -> bool {
        self.cause == Self::UNCOVERED
    }
}

impl Store {
    /// `outbox.report_coverage`: the topics `worker` claims (`include`: the routes' `LIKE`
    /// patterns, `None` for every topic; `topics`: the exact topics it is limited to) and
    /// its routes (each route's `LIKE` pattern and destination name, in order), holding
    /// for `ttl` unless renewed; a zero `ttl` withdraws the report.
    pub async fn report_coverage(
        &self,
        worker: &WorkerId,
        include: Option<&[String]>,
        topics: Option<&[String]>,
        routes: (&[String], &[String]),
        ttl: Duration,
    ) -> Result<()> {
        let (patterns, destinations) = routes;
        self.client()
            .await?
            .query_typed(
                &self.sql(
                    "SELECT outbox.report_coverage($1, $2, $3, make_interval(secs => $4), $5, $6)",
                ),
                &[
                    (&worker.as_str(), Type::TEXT),
                    (&include, Type::TEXT_ARRAY),
                    (&topics, Type::TEXT_ARRAY),
                    (&ttl.as_secs_f64(), Type::FLOAT8),
                    (&patterns, Type::TEXT_ARRAY),
                    (&destinations, Type::TEXT_ARRAY),
                ],
            )
            .await?;
        Ok(())
    }

    /// `outbox.stalled_topics`: topics with messages ready for at least `older_than` that
    /// no running relayer claims, or that every relayer claiming them leaves out behind an
    /// open circuit, oldest first.
    pub async fn stalled_topics(&self, older_than: Duration) -> Result<Vec<StalledTopic>> {
        let rows = self
            .client()
            .await?
            .query_typed(
                &self.sql(
                    "SELECT topic, cause, destinations, ready, \
                            extract(epoch FROM oldest_ready_age)::float8, held_keys, held_topics \
                       FROM outbox.stalled_topics(make_interval(secs => $1))",
                ),
                &[(&older_than.as_secs_f64(), Type::FLOAT8)],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| StalledTopic {
                topic: r.get(0),
                cause: r.get(1),
                destinations: r.get(2),
                ready: r.get(3),
                oldest_ready_age_secs: r.get(4),
                held_keys: r.get(5),
                held_topics: r.get(6),
            })
            .collect())
    }

    /// `outbox.report_circuits`: `worker`'s circuits, every destination of it, holding for
    /// `ttl` unless renewed; its reports of other destinations are deleted (none: all).
    pub async fn report_circuits(
        &self,
        worker: &WorkerId,
        circuits: &[CircuitReport],
        ttl: Duration,
    ) -> Result<()> {
        let destinations: Vec<&str> = circuits.iter().map(|c| c.destination.as_str()).collect();
        let states: Vec<&str> = circuits.iter().map(|c| c.state.as_str()).collect();
        let since: Vec<DateTime<Utc>> = circuits.iter().map(|c| c.since).collect();
        self.client()
            .await?
            .query_typed(
                &self.sql(
                    "SELECT outbox.report_circuits($1, $2, $3, $4, make_interval(secs => $5))",
                ),
                &[
                    (&worker.as_str(), Type::TEXT),
                    (&destinations, Type::TEXT_ARRAY),
                    (&states, Type::TEXT_ARRAY),
                    (&since, Type::TIMESTAMPTZ_ARRAY),
                    (&ttl.as_secs_f64(), Type::FLOAT8),
                ],
            )
            .await?;
        Ok(())
    }

    /// The `outbox.circuits` view, by destination, then state and worker.
    pub async fn circuits(&self) -> Result<Vec<ReportedCircuit>> {
        let rows = self
            .client()
            .await?
            .query_typed(
                &self.sql(
                    "SELECT worker_id, destination, state, since, reported_at, expires_at, stale \
                 FROM outbox.circuits ORDER BY destination, stale, state, worker_id",
                ),
                &[],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| ReportedCircuit {
                worker_id: r.get(0),
                report: CircuitReport {
                    destination: r.get(1),
                    state: r.get(2),
                    since: r.get(3),
                },
                reported_at: r.get(4),
                expires_at: r.get(5),
                stale: r.get(6),
            })
            .collect())
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
            .query_typed_one(
                &self.sql(
                    "SELECT observed_at, refreshed, snapshot \
                 FROM outbox.observe($1, make_interval(secs => $2))",
                ),
                &[
                    (&top_topics, Type::INT4),
                    (&max_age.as_secs_f64(), Type::FLOAT8),
                ],
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

    /// The `outbox.status` view.
    pub async fn status(&self) -> Result<Status> {
        let client = self.client().await?;
        let row = client
            .query_typed_one(
                &self.sql(
                    "SELECT ready, delayed, in_flight, expired_leases, dead_letters, \
                 extract(epoch FROM oldest_ready_age)::float8 FROM outbox.status",
                ),
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
}

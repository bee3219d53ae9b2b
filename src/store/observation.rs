//! What the database says about the outbox as a whole: `outbox.observe` (the fleet's
//! snapshot, computed by one process per interval; `observe` reads its JSON) and the
//! `outbox.status` view (`outbox-relay status`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::types::Type;

use super::{Result, Store};

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

impl Store {
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
                "SELECT observed_at, refreshed, snapshot \
                 FROM outbox.observe($1, make_interval(secs => $2))",
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
}

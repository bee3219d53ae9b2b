//! The calls through which a fleet shares many outboxes (`schema/09_sources.sql`): each
//! outbox's slots (`outbox.serve_source`, `outbox.leave_source`, the `outbox.source_holders`
//! view), and finding outboxes: the databases of a server, or a catalogue query's rows.

use std::time::Duration;

use tokio_postgres::types::Type;

use super::{Result, Store};
use crate::message::WorkerId;

/// What one `outbox.serve_source` call answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceTurn {
    /// The slot held and its token (the count of its takeovers); None when none is held.
    pub held: Option<(i32, i64)>,
    /// Relayers whose membership of this outbox has not lapsed, the caller included.
    pub members: i32,
    /// The workers holding a slot, in slot order.
    pub holders: Vec<String>,
}

impl Store {
    /// `outbox.serve_source`: renews `worker`'s membership for `member_ttl` and keeps or
    /// takes a slot among `slots` (`want`) for `ttl`, or gives its slot back.
    pub async fn serve_source(
        &self,
        worker: &WorkerId,
        slots: i32,
        want: bool,
        ttl: Duration,
        member_ttl: Duration,
    ) -> Result<SourceTurn> {
        let row = self
            .client()
            .await?
            .query_typed_one(
                &self.sql(
                    "SELECT slot, token, members, holders \
                 FROM outbox.serve_source($1, $2, $3, make_interval(secs => $4), \
                                          make_interval(secs => $5))",
                ),
                &[
                    (&worker.as_str(), Type::TEXT),
                    (&slots, Type::INT4),
                    (&want, Type::BOOL),
                    (&ttl.as_secs_f64(), Type::FLOAT8),
                    (&member_ttl.as_secs_f64(), Type::FLOAT8),
                ],
            )
            .await?;
        let slot: Option<i32> = row.get(0);
        let token: Option<i64> = row.get(1);
        Ok(SourceTurn {
            held: slot.zip(token),
            members: row.get(2),
            holders: row.get(3),
        })
    }

    /// `outbox.leave_source`: `worker` gives back its slot and its membership at once.
    pub async fn leave_source(&self, worker: &WorkerId) -> Result<()> {
        self.client()
            .await?
            .query_typed(
                &self.sql("SELECT outbox.leave_source($1)"),
                &[(&worker.as_str(), Type::TEXT)],
            )
            .await?;
        Ok(())
    }

    /// The workers serving this outbox now (the `outbox.source_holders` view), in slot order.
    pub async fn source_holders(&self) -> Result<Vec<String>> {
        let rows = self
            .client()
            .await?
            .query_typed(
                &self.sql("SELECT worker_id FROM outbox.source_holders ORDER BY slot"),
                &[],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// The databases of this server that accept connections, templates excepted, by name.
    pub async fn databases(&self) -> Result<Vec<String>> {
        let rows = self
            .client()
            .await?
            .query_typed(
                "SELECT datname::text FROM pg_catalog.pg_database \
                 WHERE datallowconn AND NOT datistemplate ORDER BY datname",
                &[],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Whether this database holds the store's outbox schema (`outbox` unless its
    /// connection string names another; such a schema must hold the outbox's messages
    /// table, so that an application's schema of the same name is not taken for one).
    pub async fn has_outbox(&self) -> Result<bool> {
        Ok(self
            .client()
            .await?
            .query_typed_one(
                "SELECT to_regnamespace($1) IS NOT NULL \
                    AND ($1 = 'outbox' OR to_regclass($1 || '.messages') IS NOT NULL)",
                &[(&self.schema(), Type::TEXT)],
            )
            .await?
            .get(0))
    }

    /// The rows of a catalogue query: (name, connection string, outbox schema) of each
    /// source; the query returns two text columns, or three when it names each source's
    /// schema (NULL in the third: the default).
    pub async fn catalogue(&self, query: &str) -> Result<Vec<(String, String, Option<String>)>> {
        let rows = self.client().await?.simple_query(query).await?;
        let mut sources = Vec::new();
        for row in rows {
            if let tokio_postgres::SimpleQueryMessage::Row(row) = row {
                let schema = if row.len() > 2 {
                    row.try_get(2).ok().flatten().map(str::to_owned)
                } else {
                    None
                };
                match (row.try_get(0), row.try_get(1)) {
                    (Ok(Some(name)), Ok(Some(url))) if row.len() <= 3 => {
                        sources.push((name.to_owned(), url.to_owned(), schema));
                    }
                    _ => {
                        return Err(super::StoreError::Schema(format!(
                            "the sources catalogue query must return two non-NULL text \
                             columns (name, connection string) and optionally a third (the \
                             outbox schema); it returned a row with {} column(s) or a NULL",
                            row.len()
                        )));
                    }
                }
            }
        }
        Ok(sources)
    }
}

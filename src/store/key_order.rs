//! The scope of a key's order (`schema/03_enqueue.sql`): `outbox.set_key_order_scope`,
//! `outbox.unset_key_order_scope` and the `outbox.key_order_scopes` view, the rules by which
//! enqueue orders a key's messages across the whole outbox or per topic.

use chrono::{DateTime, Utc};
use tokio_postgres::types::Type;

use super::{Result, Store};

/// One rule, as `outbox.key_order_scopes` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyOrderScope {
    /// The topics it applies to, a SQL `LIKE` pattern.
    pub topic_pattern: String,
    /// `global` (the whole outbox) or `topic` (per topic).
    pub scope: String,
    pub set_at: DateTime<Utc>,
    /// The login that set it.
    pub set_by: String,
}

impl Store {
    /// `outbox.set_key_order_scope`: the topics of the `LIKE` pattern get `scope` for the
    /// messages enqueued from now on; returns the pattern's scope before (None: no rule).
    pub async fn set_key_order_scope(
        &self,
        topic_pattern: &str,
        scope: &str,
    ) -> Result<Option<String>> {
        let row = self
            .client()
            .await?
            .query_typed_one(
                &self.sql("SELECT outbox.set_key_order_scope($1, $2)"),
                &[(&topic_pattern, Type::TEXT), (&scope, Type::TEXT)],
            )
            .await?;
        Ok(row.get(0))
    }

    /// `outbox.unset_key_order_scope`: removes the rule of the `LIKE` pattern; whether it
    /// had one.
    pub async fn unset_key_order_scope(&self, topic_pattern: &str) -> Result<bool> {
        let row = self
            .client()
            .await?
            .query_typed_one(
                &self.sql("SELECT outbox.unset_key_order_scope($1)"),
                &[(&topic_pattern, Type::TEXT)],
            )
            .await?;
        Ok(row.get(0))
    }

    /// The rules (`outbox.key_order_scopes`), most specific first.
    pub async fn key_order_scopes(&self) -> Result<Vec<KeyOrderScope>> {
        let rows = self
            .client()
            .await?
            .query_typed(
                &self.sql(
                    "SELECT topic_pattern, scope, set_at, set_by FROM outbox.key_order_scopes",
                ),
                &[],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| KeyOrderScope {
                topic_pattern: r.get(0),
                scope: r.get(1),
                set_at: r.get(2),
                set_by: r.get(3),
            })
            .collect())
    }
}

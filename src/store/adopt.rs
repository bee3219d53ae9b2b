//! Adopted tables (`schema/10_adopt.sql`): `outbox.adopt_table`, `outbox.unadopt_table` and
//! the `outbox.adopted_tables` view, through which an application's own outbox table is
//! relayed without changing its producers.

use tokio_postgres::types::Type;

use super::{Result, Store};

/// One adopted table, as `outbox.adopted_tables` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct AdoptedTable {
    /// The table, schema-qualified.
    pub table: String,
    /// The resolved mapping its trigger holds.
    pub mapping: serde_json::Value,
    /// Whether its trigger is enabled (rows inserted while it is not are not relayed).
    pub enabled: bool,
}

impl Store {
    /// `outbox.adopt_table`: adopts `table` with `preset` (None: the mapping alone), with
    /// `mapping`'s keys over the preset's; returns the resolved mapping.
    pub async fn adopt_table(
        &self,
        table: &str,
        preset: Option<&str>,
        mapping: Option<&serde_json::Value>,
    ) -> Result<serde_json::Value> {
        let row = self
            .client()
            .await?
            .query_typed_one(
                &self.sql("SELECT outbox.adopt_table($1::regclass, $2, $3)"),
                &[
                    (&table, Type::TEXT),
                    (&preset, Type::TEXT),
                    (&mapping, Type::JSONB),
                ],
            )
            .await?;
        Ok(row.get(0))
    }

    /// `outbox.unadopt_table`: ends the adoption of `table`; whether it was adopted.
    pub async fn unadopt_table(&self, table: &str) -> Result<bool> {
        let row = self
            .client()
            .await?
            .query_typed_one(
                &self.sql("SELECT outbox.unadopt_table($1::regclass)"),
                &[(&table, Type::TEXT)],
            )
            .await?;
        Ok(row.get(0))
    }

    /// The adopted tables (`outbox.adopted_tables`), by name.
    pub async fn adopted_tables(&self) -> Result<Vec<AdoptedTable>> {
        let rows = self
            .client()
            .await?
            .query_typed(
                &self.sql(
                    "SELECT table_name, mapping, enabled FROM outbox.adopted_tables \
                     ORDER BY table_name",
                ),
                &[],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| AdoptedTable {
                table: r.get(0),
                mapping: r.get(1),
                enabled: r.get(2),
            })
            .collect())
    }
}

//! How the leasing calls send their statements. Named statements, prepared once per
//! connection and cached, skip parsing and planning on every call; transaction poolers
//! (PgBouncer before 1.21 in transaction mode, Supavisor in transaction mode) hand each
//! transaction a different server connection, where a named statement does not exist or
//! already exists under another client's name. Unnamed statements with their parameter types
//! (`query_typed`: parse, bind and execute in one round trip) work everywhere.
//!
//! `auto` (the default) starts named and turns unnamed for good, saying so once, when the
//! start-up probe finds a transaction pooler ([`Store::detect_pooling`](super::Store)) or
//! when a named statement comes back refused (SQLSTATE 26000, 42P05): nothing ran, so the
//! call is repeated unnamed. The other statements of the store are always unnamed.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};

use super::{Result, Store};

/// How the leasing calls send their statements (`statements` setting).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Statements {
    /// Named while they work; unnamed from the first sign of a transaction pooler.
    #[default]
    Auto,
    /// Always named and cached per connection (direct connections, session poolers).
    Named,
    /// Always unnamed with explicit parameter types (transaction poolers).
    Unnamed,
}

impl Statements {
    /// The values of the setting, as written.
    pub const VALUES: &'static str = "auto, named or unnamed";

    pub fn as_str(self) -> &'static str {
        match self {
            Statements::Auto => "auto",
            Statements::Named => "named",
            Statements::Unnamed => "unnamed",
        }
    }
}

impl std::str::FromStr for Statements {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Statements::Auto),
            "named" => Ok(Statements::Named),
            "unnamed" => Ok(Statements::Unnamed),
            other => Err(format!("{other:?} is not one of {}", Statements::VALUES)),
        }
    }
}

/// The setting and what `auto` has come to.
pub(super) struct Mode {
    setting: Statements,
    unnamed: AtomicBool,
}

impl Mode {
    pub(super) fn new(setting: Statements) -> Self {
        Mode {
            setting,
            unnamed: AtomicBool::new(setting == Statements::Unnamed),
        }
    }
}

/// A named statement the server connection refused because it does not exist there
/// (26000), exists there already (42P05) or is another client's with other parameters
/// (08P01 naming a prepared statement): the marks of a transaction pooler. In each case the
/// server refused before executing anything.
fn named_statement_refused(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_some_and(|db| match db.code().code() {
        "26000" | "42P05" => true,
        "08P01" => db.message().contains("prepared statement"),
        _ => false,
    })
}

impl Store {
    /// Whether the leasing calls are sent unnamed now.
    pub fn unnamed_statements(&self) -> bool {
        self.statements.unnamed.load(Ordering::Relaxed)
    }

    /// The `statements` setting this store was given.
    pub fn statements_setting(&self) -> Statements {
        self.statements.setting
    }

    /// In `auto`, turns the leasing calls unnamed for the rest of the process, saying once
    /// why (`reason`). Does nothing when the setting is `named` or `unnamed`.
    pub(super) fn prefer_unnamed(&self, reason: &str) {
        if self.statements.setting == Statements::Auto
            && !self.statements.unnamed.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                reason,
                "sending the leasing statements unnamed from now on (statements = \"auto\"); \
                 set statements = \"unnamed\" to start that way, see docs/poolers.md"
            );
            crate::telemetry::unnamed_statements(true);
        }
    }

    /// One leasing call: `sql` (written against schema `outbox`, sent for the store's schema)
    /// with `params` (each with its Postgres type), named and cached or unnamed as
    /// [`Statements`] says, in one of the store's turns when it has them.
    pub(super) async fn leasing_query(
        &self,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>> {
        let call = self.leasing_call().await?;
        self.leasing_query_on(&call, sql, params).await
    }

    /// [`Store::leasing_query`] without a turn: a lease extension, which keeps the leases of
    /// batches already at their destinations and must not queue behind other sources' claims.
    pub(super) async fn extending_query(
        &self,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>> {
        let client = self.client().await?;
        self.leasing_query_on(&client, sql, params).await
    }

    async fn leasing_query_on(
        &self,
        client: &deadpool_postgres::Object,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>> {
        let sql = &*self.sql(sql);
        if !self.unnamed_statements() {
            let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
            let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
            let named = async {
                let statement = client.prepare_typed_cached(sql, &types).await?;
                client.query(&statement, &values).await
            };
            match named.await {
                Ok(rows) => return Ok(rows),
                Err(e)
                    if self.statements.setting == Statements::Auto
                        && named_statement_refused(&e) =>
                {
                    self.prefer_unnamed(&format!(
                        "a server connection refused a named statement ({}): the database \
                         URL goes through a transaction pooler",
                        crate::connection::describe_chain(&e)
                    ));
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(client.query_typed(sql, params).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::Statements;

    #[test]
    fn the_setting_reads_its_three_values_and_names_them_when_refused() {
        assert_eq!("auto".parse(), Ok(Statements::Auto));
        assert_eq!("named".parse(), Ok(Statements::Named));
        assert_eq!("unnamed".parse(), Ok(Statements::Unnamed));
        let err = "prepared".parse::<Statements>().unwrap_err();
        assert!(
            err.contains("\"prepared\"") && err.contains("auto, named or unnamed"),
            "{err}"
        );
    }
}

//! What sits between the relayer and Postgres, found out at start: a direct connection (or
//! a session pooler, which keeps one server process per session), a transaction pooler
//! (PgBouncer, Supavisor or RDS Proxy multiplexing, pgcat, PgDog in transaction mode) or a
//! pooler in statement mode. A transaction pooler needs unnamed statements and a
//! `listen_url`; a statement pooler cannot serve an outbox at all (producers enqueue inside
//! their own transactions), which is said at once instead of failing later.

use tokio_postgres::{Client, SimpleQueryMessage};

use super::{Result, Store, StoreError};

/// The error of a statement pooler, in the words a user needs.
pub const STATEMENT_POOLING: &str = "the database URL reaches a connection pooler in \
     statement mode, which refuses transactions: producers cannot enqueue inside their own \
     transactions and `migrate` cannot run; point the URL at a pool in transaction or session \
     mode (see docs/poolers.md)";

/// How long the probe waits for the first session's second answer.
const PROBE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// What the connections of a store go through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// Each session keeps its server process: a direct connection or a session pooler.
    Session,
    /// Sessions share server processes between transactions: a transaction pooler.
    Transaction,
}

/// Whether `e` is a pooler refusing a transaction because it pools by statement
/// (PgBouncer: "transaction blocks not allowed in statement pooling mode").
pub(super) fn statement_pooling(e: &tokio_postgres::Error) -> bool {
    crate::connection::describe_chain(e).contains("statement pooling mode")
}

async fn backend_pid(
    client: &Client,
    sql: &str,
) -> std::result::Result<i64, tokio_postgres::Error> {
    let mut pid = 0;
    for message in client.simple_query(sql).await? {
        if let SimpleQueryMessage::Row(row) = message {
            pid = row.get(0).and_then(|p| p.parse().ok()).unwrap_or(0);
        }
    }
    Ok(pid)
}

impl Store {
    /// Finds out what the store's URL goes through, with two sessions of its own: the first
    /// asks for its server process, the second opens a transaction and asks for its own,
    /// and the first asks again while that transaction is open. Directly or behind a session
    /// pooler, each session keeps its server process: the two differ and the first repeats.
    /// Behind a transaction pooler a session holds a server process for one transaction at
    /// a time: the second session is usually given the first one's (pools hand out the most
    /// recently used first), and the first is then given another; either sign counts. A
    /// pooler that refuses the transaction pools by statement: [`StoreError::Pooler`].
    /// In `statements = "auto"`, a transaction pooler turns the leasing calls unnamed.
    pub async fn detect_pooling(&self) -> Result<Pooling> {
        let first = self.probe_session().await?;
        let second = self.probe_session().await?;
        let before = backend_pid(&first, "SELECT pg_backend_pid()").await?;
        let held = match backend_pid(&second, "BEGIN; SELECT pg_backend_pid()").await {
            Ok(pid) => pid,
            Err(e) if statement_pooling(&e) => {
                return Err(StoreError::Pooler(STATEMENT_POOLING.to_owned()));
            }
            Err(e) => return Err(e.into()),
        };
        // A pool of one server connection cannot serve the first session while the second
        // holds it: no answer in time is a transaction pooler too.
        let after =
            match tokio::time::timeout(PROBE_WAIT, backend_pid(&first, "SELECT pg_backend_pid()"))
                .await
            {
                Ok(pid) => Some(pid?),
                Err(_) => None,
            };
        second.batch_execute("COMMIT").await?;
        let pooling = if held == before || after != Some(before) {
            Pooling::Transaction
        } else {
            Pooling::Session
        };
        tracing::debug!(before, held, ?after, ?pooling, "connection pooling probe");
        if pooling == Pooling::Transaction {
            const FOUND: &str = "the database URL goes through a transaction pooler (two \
                 sessions shared one server process)";
            if self.statements_setting() == super::Statements::Named {
                tracing::warn!(
                    reason = FOUND,
                    "statements = \"named\" here fails whenever the pooler hands a call to \
                     another server connection (SQLSTATE 26000 or 42P05): set statements to \
                     \"auto\" or \"unnamed\" (see docs/poolers.md)"
                );
            }
            self.prefer_unnamed(FOUND);
        }
        crate::telemetry::unnamed_statements(self.unnamed_statements());
        Ok(pooling)
    }

    /// A session of its own on the store's URL, outside the pool, for a probe.
    async fn probe_session(&self) -> Result<Client> {
        let (client, connection) = super::session(&self.target).await?;
        tokio::spawn(connection);
        Ok(client)
    }
}

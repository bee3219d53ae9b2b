//! The schema this build embeds: applying its migrations, and checking that a database is
//! at the version this build needs before the relayer uses it.
//!
//! refinery's runner is driven through [`Locked`], one open transaction that holds the
//! migration lock: the history it reads, the migrations it applies and the history rows it
//! writes all commit together or not at all. No named statement is used, so a migrate works
//! through a transaction pooler.

use refinery::Migration;
use refinery_core::traits::r#async::{AsyncQuery, AsyncTransaction};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio_postgres::SimpleQueryMessage;

use super::{Result, Store, StoreError};

impl Store {
    /// Applies the embedded migrations that are not applied yet; returns their names.
    /// Everything happens in one transaction that first takes a transaction-scoped advisory
    /// lock: processes that start together migrate one at a time (the later ones wait, then
    /// read the history the first committed and find nothing to do), and nothing survives
    /// the transaction, so a migrate cancelled half-way through a transaction pooler leaves
    /// no lock on the pooled server connection.
    /// A login that cannot own the schema (such as one holding only `outbox_relay`) is
    /// refused before anything runs, with a message that says which role to use.
    pub async fn migrate(&self) -> Result<Vec<String>> {
        let schema = self.schema();
        let mut client = self.client().await?;
        let row = client
            .query_typed_one(
                "SELECT current_user::text, \
                        CASE WHEN n.oid IS NULL \
                             THEN has_database_privilege(current_database(), 'CREATE') \
                             ELSE pg_has_role(n.nspowner, 'USAGE') END, \
                        pg_get_userbyid(n.nspowner)::text \
                   FROM (SELECT 1) AS one \
                   LEFT JOIN pg_namespace AS n ON n.nspname = $1",
                &[(&schema, tokio_postgres::types::Type::TEXT)],
            )
            .await?;
        let (user, allowed, owner): (String, bool, Option<String>) =
            (row.get(0), row.get(1), row.get(2));
        if !allowed {
            return Err(StoreError::Migration(match owner {
                Some(owner) => format!(
                    "login {user:?} cannot change schema {schema}, which belongs to {owner:?}: run \
                     `outbox-relay migrate` as {owner:?} (the DDL role); the relayer itself \
                     needs only a login in outbox_relay"
                ),
                None => format!(
                    "login {user:?} cannot create schema {schema} (no CREATE right on the \
                     database): run `outbox-relay migrate` as the database owner (the DDL role)"
                ),
            }));
        }
        // READ COMMITTED whatever the database's default: a migrate that waited for the lock
        // must read the history the one before it committed.
        let tx = (**client)
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
            .start()
            .await
            .map_err(refused_transaction)?;
        // Transaction-scoped: released by the commit, the rollback or the end of the
        // connection, so a migrate killed half-way strands nothing, even on a pooled server
        // connection that outlives its client.
        // One lock per schema: the outboxes of several schemas in one database migrate
        // independently.
        let free = simple_value(
            &tx,
            &self.sql("SELECT pg_try_advisory_xact_lock(hashtext('outbox.migrate'))"),
        )
        .await?
            == "t";
        if !free {
            tracing::info!("another migrate holds the migration lock; waiting for it to finish");
            tx.batch_execute(&self.sql("SELECT pg_advisory_xact_lock(hashtext('outbox.migrate'))"))
                .await?;
        }
        // refinery's history table is not schema-qualified: a session without a schema to
        // create it in (an empty search_path) gets the default one, `public`, for this
        // transaction only.
        if schema == crate::connection::DEFAULT_SCHEMA {
            if simple_value(&tx, "SELECT current_schema() IS NULL").await? == "t" {
                tx.batch_execute("SET LOCAL search_path = public").await?;
            }
        } else {
            // Another schema keeps its history in itself (SCHEMA.refinery_schema_history),
            // so the schema is created first, and the migrations that name the history table
            // unqualified find that one. A schema that exists without that table belongs to
            // something else: the migrations would change the rights on its tables.
            let state = simple_value(
                &tx,
                &format!(
                    "SELECT CASE WHEN to_regnamespace('{schema}') IS NULL THEN 'absent' \
                                 WHEN to_regclass('{schema}.refinery_schema_history') IS NULL \
                                 THEN 'foreign' ELSE 'outbox' END"
                ),
            )
            .await?;
            if state == "foreign" {
                return Err(StoreError::Migration(format!(
                    "schema {schema} exists and holds no outbox (it has no \
                     {schema}.refinery_schema_history): give the outbox a schema of its own \
                     (outbox_schema)"
                )));
            }
            tx.batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {schema}; SET LOCAL search_path = {schema}"
            ))
            .await?;
        }
        let mut locked = Locked(tx);
        let report = runner_for(schema)
            .run_async(&mut locked)
            .await
            .map_err(|e| StoreError::Migration(e.to_string()))?;
        locked.0.commit().await?;
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
        let schema = self.schema();
        let client = self.client().await?;
        let row = client
            .query_typed_one(
                "SELECT s.n IS NOT NULL, \
                        CASE WHEN has_schema_privilege(s.n, 'USAGE') \
                             THEN to_regprocedure($1 || '.schema_version()') IS NOT NULL \
                             ELSE false END, \
                        coalesce(has_schema_privilege(s.n, 'USAGE'), false), \
                        current_database()::text, current_user::text \
                   FROM (SELECT to_regnamespace($1) AS n) AS s",
                &[(&schema, tokio_postgres::types::Type::TEXT)],
            )
            .await?;
        let (exists, function, usage, database, user): (bool, bool, bool, String, String) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        let fix = if self.default_database {
            "no database URL was given, and the default is the server's postgres database: \
             set DATABASE_URL or --database-url to the outbox's database (and run `outbox-relay \
             migrate` with it if it was never migrated)"
        } else {
            "run `outbox-relay migrate` (as the schema owner)"
        };
        let denied = || {
            StoreError::Schema(format!(
                "login {user:?} may not use schema {schema}: grant it one of the roles \
                 outbox_relay, outbox_producer or outbox_reader"
            ))
        };
        if !exists {
            return Err(StoreError::Schema(format!(
                "schema {schema} does not exist in database {database:?} (never migrated); this \
                 build needs version {needed}: {fix}"
            )));
        }
        if !usage {
            return Err(denied());
        }
        let found = if function {
            match client
                .query_typed_one(&self.sql("SELECT outbox.schema_version()"), &[])
                .await
            {
                Ok(row) => row.get::<_, Option<i32>>(0),
                Err(e) if e.code().is_some_and(|c| c.code() == "42501") => {
                    return Err(denied());
                }
                Err(e) => return Err(e.into()),
            }
        } else if schema != crate::connection::DEFAULT_SCHEMA {
            // Every outbox in another schema was built by a release that has
            // schema_version(): without it, the schema holds something else.
            return Err(StoreError::Schema(format!(
                "schema {schema} in database {database:?} holds no outbox (it has no \
                 {schema}.schema_version()): {fix}, or name the outbox's own schema"
            )));
        } else {
            // Before version 5 there was no schema_version(); the history table says which.
            client
                .query_typed_opt(
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
                "schema {schema} is at version {found}, this build needs {needed}: {fix}"
            ))),
            None => Err(StoreError::Schema(format!(
                "schema {schema} predates version 5, this build needs {needed}: {fix}"
            ))),
        }
    }
}

/// The runner that builds the outbox in `schema`: for the default schema, the embedded
/// migrations as they are; for another, the same migrations with that schema's names
/// ([`super::naming::migration_in_schema`]), recorded in `SCHEMA.refinery_schema_history`.
fn runner_for(schema: &str) -> refinery::Runner {
    if schema == crate::connection::DEFAULT_SCHEMA {
        return crate::schema::runner();
    }
    let migrations: Vec<Migration> = crate::schema::runner()
        .get_migrations()
        .iter()
        .map(|m| {
            let sql = super::naming::migration_in_schema(m.sql().unwrap_or_default(), schema);
            Migration::unapplied(&m.to_string(), &sql)
                .expect("an embedded migration's name parses again")
        })
        .collect();
    let mut runner = refinery::Runner::new(&migrations).set_grouped(true);
    runner.set_migration_table_name(format!("{schema}.refinery_schema_history"));
    runner
}

/// A statement a pooler in statement mode refuses (`BEGIN`) is explained as such: nothing
/// that needs a transaction, the producers' included, can work through it.
fn refused_transaction(e: tokio_postgres::Error) -> StoreError {
    if super::pooler::statement_pooling(&e) {
        return StoreError::Migration(super::STATEMENT_POOLING.to_owned());
    }
    e.into()
}

/// refinery's runner inside one open transaction: `execute` runs its statements in the
/// transaction without committing, `query` reads the history in it. The caller commits.
struct Locked<'a>(tokio_postgres::Transaction<'a>);

impl AsyncTransaction for Locked<'_> {
    type Error = tokio_postgres::Error;

    async fn execute<'a, T: Iterator<Item = &'a str> + Send + 'a>(
        &mut self,
        queries: T,
    ) -> std::result::Result<usize, Self::Error> {
        let mut count = 0;
        for query in queries {
            self.0.batch_execute(query).await?;
            count += 1;
        }
        Ok(count)
    }
}

impl AsyncQuery<Vec<Migration>> for Locked<'_> {
    async fn query(&mut self, query: &str) -> std::result::Result<Vec<Migration>, Self::Error> {
        let mut applied = Vec::new();
        for message in self.0.simple_query(query).await? {
            let SimpleQueryMessage::Row(row) = message else {
                continue;
            };
            let field = |i: usize| row.get(i).unwrap_or_default();
            // refinery wrote these columns itself: version and checksum as decimal text,
            // applied_on in RFC 3339. A row that does not parse is not a migration refinery
            // applied; it is reported as diverging from every embedded one.
            applied.push(Migration::applied(
                field(0).parse().unwrap_or(-1),
                field(1).to_owned(),
                OffsetDateTime::parse(field(2), &Rfc3339).unwrap_or(OffsetDateTime::UNIX_EPOCH),
                field(3).parse().unwrap_or(0),
            ));
        }
        Ok(applied)
    }
}

impl refinery::AsyncMigrate for Locked<'_> {}

/// The first column of the first row `sql` returns, as text (simple query protocol).
async fn simple_value(
    client: &impl tokio_postgres::GenericClient,
    sql: &str,
) -> std::result::Result<String, tokio_postgres::Error> {
    for message in client.simple_query(sql).await? {
        if let SimpleQueryMessage::Row(row) = message {
            return Ok(row.get(0).unwrap_or_default().to_owned());
        }
    }
    Ok(String::new())
}

#[cfg(test)]
mod tests {
    use super::runner_for;

    /// What refinery stored for each migration of an outbox in another schema: the
    /// checksum of its rewritten text. The landed migrations (up to V28) must keep theirs,
    /// or every outbox already built in another schema refuses `migrate` from then on.
    #[test]
    fn the_rewritten_landed_migrations_keep_the_checksums_refinery_stored() {
        let sum = runner_for("tenant_a")
            .get_migrations()
            .iter()
            .filter(|m| m.version() <= 28)
            .fold(0_u64, |sum, m| sum.wrapping_add(m.checksum()));
        assert_eq!(
            sum, PINNED,
            "the rewrite for another schema changed the text of a landed migration (see \
             src/store/naming.rs): outboxes in other schemas would refuse migrate"
        );
    }

    /// The wrapping sum of the checksums of V1–V28 rewritten for schema `tenant_a`.
    const PINNED: u64 = 13_600_891_598_578_968_865;
}

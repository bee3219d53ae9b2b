//! The schema this build embeds: applying its migrations, and checking that a database is
//! at the version this build needs before the relayer uses it.

use super::{Result, Store, StoreError};

impl Store {
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
}

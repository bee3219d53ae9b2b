//! The SQL migrations under `schema/migrations/`, embedded in the binary so that `outbox-relay migrate`
//! needs nothing but a database URL.

refinery::embed_migrations!("schema/migrations");

/// The runner for every embedded migration, applied in one transaction.
pub fn runner() -> refinery::Runner {
    migrations::runner().set_grouped(true)
}

/// The schema version this build needs: that of its newest embedded migration.
pub fn version() -> i32 {
    runner()
        .get_migrations()
        .iter()
        .map(|m| m.version())
        .max()
        .unwrap_or(0)
}

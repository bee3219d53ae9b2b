//! The SQL migrations under `schema/`, embedded in the binary so that `outbox-relay migrate`
//! needs nothing but a database URL.

refinery::embed_migrations!("schema");

/// The runner for every embedded migration, applied in one transaction.
pub fn runner() -> refinery::Runner {
    migrations::runner().set_grouped(true)
}

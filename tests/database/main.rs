//! The schema and the store against a real Postgres, each test on a database of its own
//! (a clone of the run's migrated template, see `tests/common`). Postgres alone: `make
//! check` runs them.
//!
//! - [`schema_contract`]: the SQL contract's text: area files = migrations, pins, comments,
//!   grants and the generated reference;
//! - [`schemas`]: outboxes in schemas other than `outbox`;
//! - [`plans`]: the hot path's statements stay index-driven;
//! - [`previous_release`]: the previous release's statements, read from git, work on the
//!   newest schema (the rolling-upgrade rule of docs/upgrades.md);
//! - [`store`]: the store's mapping of the SQL API.

#[path = "../common/mod.rs"]
mod common;

mod plans;
mod previous_release;
mod schema_contract;
mod schemas;
mod store;

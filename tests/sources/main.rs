//! Many outboxes served by one fleet, with real processes against real databases and
//! throwaway clusters. Postgres alone: `make check` runs them.
//!
//! - [`fleet`]: three processes over many databases, kills, budgets and discovery;
//! - [`verbs`]: the operator verbs with `--all-sources`.

#[path = "../common/mod.rs"]
mod common;

mod fleet;
mod verbs;

//! Many outboxes served by one fleet, with real processes against real databases and
//! throwaway clusters. Postgres alone: `make check` runs them.
//!
//! - [`fleet`]: three processes over many databases, kills, budgets and discovery;
//! - [`verbs`]: the operator verbs with `--all-sources`;
//! - [`turns`]: a budget too short for the sources, under faults (the `fleet-turns` chaos
//!   scenario, smaller).

#[path = "../common/mod.rs"]
mod common;

mod fleet;
#[path = "../chaos/fleet_turns.rs"]
mod fleet_turns;
mod turns;
mod verbs;

/// The tests of this binary one at a time under `cargo test`: each runs relayer processes,
/// and a fleet that discovers a server's databases would serve another test's on the same
/// server. Under cargo nextest, where each test is a process of its own,
/// `.config/nextest.toml` says the same.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

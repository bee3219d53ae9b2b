//! A Postgres transactional-outbox relayer. Applications enqueue messages in their own
//! transaction; this crate leases them with fenced leases (the rules live in the SQL
//! functions under `schema/`) and delivers them to a destination.
//!
//! # Layout
//! - [`message`]: domain types: ids, a claimed message, a sink's outcome.
//! - [`schema`]: the embedded SQL migrations.
//! - [`store`]: the only module that talks SQL: pool, SQL API calls, typed errors.

pub mod message;
pub mod schema;
pub mod store;

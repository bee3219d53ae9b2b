//! The SQL contract of DESIGN §3, exercised the way any language would: plain SQL calls to
//! the `outbox.*` functions on a real Postgres, each test on a database of its own. One
//! module per contract area, as the SQL in `schema/` is laid out; the calls they share are
//! in `tests/common/sql.rs`.
//!
//! - [`enqueue`]: ids, headers, bytes, refused reuse, inlining, wake-ups;
//! - [`trace_context`]: the creation trace context taken at enqueue, checked and stored;
//! - [`claim`]: what a claim leases, its budget, the shards' turns, concurrent claimers;
//! - [`topics`]: the claim's topic filters (the topics a relayer covers, those it excludes);
//! - [`floors`]: where claims start their walks, and what the floors never pass;
//! - [`keys`]: per-key order, runs of a key, producers committing behind a head;
//! - [`key_scopes`]: the scope of a key's order (the whole outbox, or per topic), chosen per
//!   topic pattern;
//! - [`completion`]: the lease fences of completion, extension and release;
//! - [`repair`]: expired leases requeued or dead-lettered, and the stale worker fenced;
//! - [`slots`]: the ring of slots of outbox.messages, rotated and truncated;
//! - [`dead_letters`]: dead-lettering, replay and pruning the attempt history;
//! - [`observation`]: the operator's views;
//! - [`roles`]: what each role may do, and what a login cannot hold up;
//! - [`arguments`]: P7001 naming the argument refused;
//! - [`adopt`]: an application's own outbox table relayed by a trigger, and removed cleanly.

#[path = "../common/mod.rs"]
mod common;

mod adopt;
mod arguments;
mod attempt_slots;
mod claim;
mod completion;
mod dead_letters;
mod enqueue;
mod floors;
mod key_scopes;
mod keys;
mod observation;
mod repair;
mod roles;
mod slots;
mod sources;
mod topics;
mod trace_context;

use std::collections::HashSet;

use common::sql::*;
use common::{TestDb, count, sqlstate};
use uuid::Uuid;

//! What the relay needs to run, and nothing else: who this process is, what and how much it
//! claims, how long it holds a lease, how often it looks and repairs, how retries back off
//! and how long it drains at shutdown. The relay owns this type so that it can be built and
//! tested without the process's configuration; `config` validates these values (naming the
//! setting that is out of range) and composes them into the process's settings.

use std::time::Duration;

use crate::message::WorkerId;
use crate::retry::RetrySettings;

/// Validated settings of one process's relay.
#[derive(Clone, Debug)]
pub struct RelaySettings {
    /// This process's name in leases and the attempt log.
    pub worker_id: WorkerId,
    /// Only these topics are claimed; `None` claims every topic.
    pub topics: Option<Vec<String>>,
    /// Messages asked for per claim.
    pub batch_size: i32,
    /// Payload bytes a claim may return in all.
    pub max_batch_bytes: i64,
    /// A larger payload is not relayed: it is dead-lettered with the reason.
    pub max_message_bytes: i64,
    /// Claimed batches that may wait for their destinations at once.
    pub max_batches_in_flight: usize,
    pub lease_secs: i32,
    /// How long an empty outbox is left alone when no notification arrives.
    pub poll_interval: Duration,
    pub retry: RetrySettings,
    pub repair_interval: Duration,
    /// Expired leases repaired per janitor pass.
    pub repair_limit: i32,
    /// How long in-flight deliveries may run after shutdown before they are released.
    pub shutdown_timeout: Duration,
}

impl RelaySettings {
    /// The lease as a `Duration`.
    pub fn lease(&self) -> Duration {
        Duration::from_secs(u64::from(self.lease_secs.unsigned_abs()))
    }
}

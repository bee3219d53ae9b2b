//! What the relayer reports about itself. Metric names are defined here once, and each
//! event is one function that logs and counts together, so a log line and its counter never
//! drift apart. Every log line about a message carries `outbox_id` and `worker_id`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{Label, counter, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::message::{ClaimedMessage, TraceContext, WorkerId};

pub const CLAIMED: &str = "outbox_messages_claimed_total";
pub const DELIVERED: &str = "outbox_messages_delivered_total";
pub const RETRIED: &str = "outbox_messages_retried_total";
pub const DEAD_LETTERED: &str = "outbox_messages_dead_lettered_total";
pub const LEASE_LOST: &str = "outbox_lease_lost_total";
pub const RELEASED: &str = "outbox_messages_released_total";
pub const STALE_BATCHES: &str = "outbox_stale_batches_total";
pub const IN_FLIGHT: &str = "outbox_in_flight_messages";
pub const CLAIM_SECONDS: &str = "outbox_claim_duration_seconds";
pub const COMPLETE_SECONDS: &str = "outbox_complete_duration_seconds";
pub const DISPATCH_SECONDS: &str = "outbox_dispatch_duration_seconds";
pub const DELIVERY_LATENCY_SECONDS: &str = "outbox_delivery_latency_seconds";
pub const REPAIR_REQUEUED: &str = "outbox_repair_requeued_total";
pub const REPAIR_DEAD_LETTERED: &str = "outbox_repair_dead_lettered_total";
pub const DATABASE_ERRORS: &str = "outbox_database_errors_total";
pub const POOL_CONNECTIONS: &str = "outbox_db_pool_connections";
pub const CIRCUIT_STATE: &str = "outbox_destination_circuit_state";
pub const DISPATCH_PANICS: &str = "outbox_dispatch_panics_total";
pub const DISPATCH_DEADLINES: &str = "outbox_dispatch_deadline_exceeded_total";
pub const CLAIM_SECONDS_PER_MESSAGE: &str = "outbox_claim_seconds_per_message";
pub const LEASE_LEFT_SECONDS: &str = "outbox_lease_left_at_completion_seconds";
pub const BUILD_INFO: &str = "outbox_build_info";
pub const LISTENER_HEALTHY: &str = "outbox_listener_healthy";
pub const UNNAMED_STATEMENTS: &str = "outbox_unnamed_statements";
pub const SOURCES: &str = "outbox_sources";
pub const PINNED_SLOTS: &str = "outbox_message_slots_pinned";
pub const HELD_OPEN_SLOTS: &str = "outbox_message_slots_held_open_total";
pub const UNCOVERED_READY: &str = "outbox_uncovered_ready_messages";
pub const UNCOVERED_HELD_KEYS: &str = "outbox_uncovered_held_keys";
pub const CIRCUIT_HELD_READY: &str = "outbox_circuit_held_ready_messages";
pub const CIRCUIT_HELD_KEYS: &str = "outbox_circuit_held_keys";
/// The `state` label values of [`SOURCES`].
pub const SOURCE_STATES: [&str; 7] = [
    "starting",
    "serving",
    "standby",
    "over_budget",
    "queued",
    "waiting",
    "down",
];
// Fleet gauges, rendered from the latest observation (by `observe`).
pub const OBSERVED_AT: &str = "outbox_observation_timestamp_seconds";
pub const BACKLOG: &str = "outbox_backlog_messages";
pub const DEAD_LETTERS: &str = "outbox_dead_letters";
pub const OLDEST_READY_AGE: &str = "outbox_oldest_ready_age_seconds";
pub const ATTEMPTS_LAST_MINUTE: &str = "outbox_attempts_last_minute";
pub const HORIZON_AGE: &str = "outbox_mvcc_horizon_age_seconds";
pub const HORIZON_XID_AGE: &str = "outbox_mvcc_horizon_xid_age";
pub const HORIZON_CULPRIT: &str = "outbox_mvcc_horizon_culprit_age_seconds";
pub const TABLE_TUPLES: &str = "outbox_messages_table_tuples";
pub const LAST_AUTOVACUUM: &str = "outbox_messages_last_autovacuum_timestamp_seconds";
// Many sources: each served source's backlog, rendered from its latest observation by the
// process that serves it (by `observe`).
pub const SOURCE_BACKLOG: &str = "outbox_source_backlog_messages";
pub const SOURCE_OLDEST_READY_AGE: &str = "outbox_source_oldest_ready_age_seconds";

/// Every metric with its kind and HELP text: the one list of metric names.
pub const METRICS: &[(&str, Kind, &str)] = &[
    (
        UNCOVERED_READY,
        Kind::LabelledGauge,
        "Messages ready for longer than observe_uncovered_secs on a topic no running relayer claims, by topic (0 once one does).",
    ),
    (
        UNCOVERED_HELD_KEYS,
        Kind::LabelledGauge,
        "Keys whose messages on other topics wait behind a message of a topic no running relayer claims, by that topic.",
    ),
    (
        CIRCUIT_HELD_READY,
        Kind::LabelledGauge,
        "Messages ready for longer than observe_uncovered_secs on a topic every running relayer claiming it leaves out while its destination's circuit is open, by topic (0 once one claims it again).",
    ),
    (
        CIRCUIT_HELD_KEYS,
        Kind::LabelledGauge,
        "Keys whose messages on other topics wait behind a message of a topic held by open circuits, by that topic.",
    ),
    (
        CLAIMED,
        Kind::Counter,
        "Messages claimed, by topic (and source, with many sources).",
    ),
    (
        DELIVERED,
        Kind::Counter,
        "Messages acknowledged by their destination, by topic (and source, with many sources).",
    ),
    (
        RETRIED,
        Kind::Counter,
        "Delivery attempts that failed retryably and were scheduled again, by topic (and source, with many sources).",
    ),
    (
        DEAD_LETTERED,
        Kind::Counter,
        "Messages moved to dead letters by a completion: refused for good, or their last retry failed, by topic (and source, with many sources).",
    ),
    (
        LEASE_LOST,
        Kind::Counter,
        "Outcomes the database refused because the lease was no longer this worker's, by topic (and source, with many sources).",
    ),
    (
        RELEASED,
        Kind::Counter,
        "Messages given back without an attempt (open circuit, shutdown, stale batch), by topic (and source, with many sources).",
    ),
    (
        STALE_BATCHES,
        Kind::Counter,
        "Batches not published because their leases may have expired.",
    ),
    (
        IN_FLIGHT,
        Kind::Gauge,
        "Messages claimed by this process and not yet completed (by source, with many sources).",
    ),
    (
        CLAIM_SECONDS,
        Kind::Histogram,
        "Time of one claim_outbox_batch_seq call.",
    ),
    (
        COMPLETE_SECONDS,
        Kind::Histogram,
        "Time of one complete_outbox_batch call.",
    ),
    (
        DISPATCH_SECONDS,
        Kind::Histogram,
        "Time a destination took to answer a batch, by destination.",
    ),
    (
        DELIVERY_LATENCY_SECONDS,
        Kind::Histogram,
        "Time from enqueue to the destination's acknowledgement.",
    ),
    (
        REPAIR_REQUEUED,
        Kind::Counter,
        "Expired leases requeued by repair (zombie requeues).",
    ),
    (
        REPAIR_DEAD_LETTERED,
        Kind::Counter,
        "Messages dead-lettered by repair after their last attempt expired.",
    ),
    (
        DATABASE_ERRORS,
        Kind::Counter,
        "Failed database calls, by operation.",
    ),
    (
        POOL_CONNECTIONS,
        Kind::Gauge,
        "Database pool connections, by state (open, idle, max).",
    ),
    (
        CIRCUIT_STATE,
        Kind::Gauge,
        "Circuit of each destination: 0 closed, 1 open, 2 half-open.",
    ),
    (
        DISPATCH_PANICS,
        Kind::Counter,
        "Batches whose destination panicked while publishing, by destination.",
    ),
    (
        DISPATCH_DEADLINES,
        Kind::Counter,
        "Batches a destination did not answer within its timeout_ms, by destination.",
    ),
    (
        BUILD_INFO,
        Kind::Gauge,
        "Always 1, labelled with the version of this build.",
    ),
    (
        LISTENER_HEALTHY,
        Kind::Gauge,
        "1 when the notification listener heard its own test notification at its last check; \
         0 when it did not (deaf: a transaction pooler; set listen_url) or is disconnected.",
    ),
    (
        UNNAMED_STATEMENTS,
        Kind::Gauge,
        "1 when the leasing calls are sent as unnamed statements (for a transaction pooler).",
    ),
    (
        PINNED_SLOTS,
        Kind::Gauge,
        "Slots of outbox.messages other than the current one that hold a pending message, as \
         this process's last rotation found them: at 3 the ring is stopped and a held horizon's \
         dead rows are no longer given back.",
    ),
    (
        HELD_OPEN_SLOTS,
        Kind::Counter,
        "Rotations of this process that found a slot of outbox.messages with nothing pending \
         but could not truncate it within 50 ms because a session held it open; rising at \
         every rotation (about one per 5 s across the fleet), the ring is stopped.",
    ),
    (
        SOURCES,
        Kind::Gauge,
        "Many sources: the sources this process knows, by state (serving, standby, \
         over_budget, down, starting).",
    ),
    (
        CLAIM_SECONDS_PER_MESSAGE,
        Kind::Histogram,
        "Time of a claim divided by the messages it returned: grows when dead tuples pile up.",
    ),
    (
        LEASE_LEFT_SECONDS,
        Kind::Histogram,
        "Lease time left when a batch's outcomes are reported: near 0 means the destination is getting slower than the lease.",
    ),
    (
        OBSERVED_AT,
        Kind::Observed,
        "When the fleet gauges were last computed (Unix seconds).",
    ),
    (
        BACKLOG,
        Kind::Observed,
        "Pending messages by topic (the largest topics, the rest as other) and state (ready, delayed, in_flight, expired_lease).",
    ),
    (
        DEAD_LETTERS,
        Kind::Observed,
        "Dead letters waiting for a replay, by topic.",
    ),
    (
        OLDEST_READY_AGE,
        Kind::Observed,
        "Age of the oldest message ready to be claimed, by topic (0 when none is ready).",
    ),
    (
        ATTEMPTS_LAST_MINUTE,
        Kind::Observed,
        "Attempts recorded by the whole fleet in the last minute, by state.",
    ),
    (
        HORIZON_AGE,
        Kind::Observed,
        "Age of the oldest transaction or snapshot of this database holding back the MVCC horizon (0 when none).",
    ),
    (
        HORIZON_XID_AGE,
        Kind::Observed,
        "Transaction ids since the oldest horizon holder's xmin.",
    ),
    (
        HORIZON_CULPRIT,
        Kind::Observed,
        "Horizon holders past the watchdog's threshold (up to 5), by kind, pid, name and state; the value is how long (0 for a slot).",
    ),
    (
        TABLE_TUPLES,
        Kind::Observed,
        "Live and dead tuples of outbox.messages (from pg_stat_user_tables).",
    ),
    (
        LAST_AUTOVACUUM,
        Kind::Observed,
        "When autovacuum last processed outbox.messages (Unix seconds).",
    ),
    (
        SOURCE_BACKLOG,
        Kind::Observed,
        "Many sources: messages ready to be claimed in each source this process serves \
         (exported by one serving process per source: sum it over the fleet), by source.",
    ),
    (
        SOURCE_OLDEST_READY_AGE,
        Kind::Observed,
        "Many sources: age of the oldest ready message of each source this process serves \
         (0 when none is ready), by source.",
    ),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    /// A gauge with one series per label value (a topic) and none before its first value:
    /// described from the start, absent until something sets it.
    LabelledGauge,
    Histogram,
    /// A gauge computed from the database by one process per interval and rendered from
    /// the latest observation, not through the recorder.
    Observed,
}

/// The HELP text of a metric of [`METRICS`].
pub fn help(name: &str) -> &'static str {
    METRICS
        .iter()
        .find(|(n, _, _)| *n == name)
        .map_or("", |(_, _, help)| help)
}

/// Installs the global Prometheus recorder (once per process) and returns its handle.
pub fn install() -> PrometheusHandle {
    static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let buckets = [
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0,
            ];
            let handle = PrometheusBuilder::new()
                .set_buckets(&buckets)
                .expect("non-empty buckets")
                .install_recorder()
                .expect("the metrics recorder is installed once");
            register();
            // The recorder keeps every histogram sample until something drains them into
            // the buckets: a scrape, or this upkeep. Without it a process that is never
            // scraped (or runs with --no-telemetry) grows by about 18 bytes per message.
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(UPKEEP_EVERY);
                        upkeep.run_upkeep();
                    }
                })
                .expect("spawn the metrics upkeep thread");
            handle
        })
        .clone()
}

/// How often histogram samples are folded into their buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Describes every metric and creates the counters, so that they read 0 from the start
/// rather than being absent until their first event.
fn register() {
    for &(name, kind, help) in METRICS {
        match kind {
            Kind::Counter => {
                metrics::describe_counter!(name, help);
                counter!(name).absolute(0);
            }
            Kind::Gauge | Kind::LabelledGauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, help),
            Kind::Observed => {}
        }
    }
    gauge!(IN_FLIGHT).set(0.0);
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    // Until the listener's first check and the start-up probe say otherwise.
    gauge!(LISTENER_HEALTHY).set(0.0);
    gauge!(UNNAMED_STATEMENTS).set(0.0);
    // Until this process's first rotation with the turn says otherwise.
    gauge!(PINNED_SLOTS).set(0.0);
    // No source known until a many-source process finds some.
    for state in SOURCE_STATES {
        gauge!(SOURCES, "state" => state).set(0.0);
    }
}

/// The label value under which sources beyond the first [`SourceLabels`] cap are counted.
pub const OTHER_SOURCE: &str = "other";

/// The `source` label values of a many-source process: the first `cap` distinct sources it
/// labels keep their name for the life of the process, the others are `other`, so that a
/// fleet serving thousands of sources exports at most `cap` + 1 values per process.
#[derive(Debug)]
pub struct SourceLabels {
    cap: usize,
    named: Mutex<Vec<Arc<LabelValue>>>,
    other: Arc<LabelValue>,
}

/// One value of the `source` label, and what the gauges under it add up.
#[derive(Debug)]
struct LabelValue {
    value: Arc<str>,
    /// Messages in flight of each source under this value.
    in_flight: Mutex<HashMap<Arc<str>, usize>>,
}

impl LabelValue {
    fn new(value: &str) -> Arc<Self> {
        Arc::new(Self {
            value: Arc::from(value),
            in_flight: Mutex::default(),
        })
    }
}

impl SourceLabels {
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            named: Mutex::new(Vec::new()),
            other: LabelValue::new(OTHER_SOURCE),
        }
    }

    /// The label of source `name`: its name while fewer than `cap` others were named
    /// before it, `other` afterwards.
    pub fn label(&self, name: &str) -> Source {
        let mut named = self.named.lock().unwrap_or_else(|e| e.into_inner());
        let label = match named.iter().find(|n| &*n.value == name) {
            Some(n) => n.clone(),
            None if named.len() < self.cap => {
                let n = LabelValue::new(name);
                named.push(n.clone());
                n
            }
            None => self.other.clone(),
        };
        Source(Some(SourceName {
            name: Arc::from(name),
            label,
        }))
    }
}

/// Which source the messages of a relay come from. The default (one database) adds no
/// `source` label, so that a one-database process exports the series it always did.
#[derive(Clone, Debug, Default)]
pub struct Source(Option<SourceName>);

#[derive(Clone, Debug)]
struct SourceName {
    /// The source's name, for the logs.
    name: Arc<str>,
    /// Its `source` label value: the name, or `other` beyond the cap.
    label: Arc<LabelValue>,
}

impl Source {
    /// The source's name (None with one database).
    pub fn name(&self) -> Option<&str> {
        self.0.as_ref().map(|s| &*s.name)
    }

    /// Its `source` label value (None with one database).
    pub fn label(&self) -> Option<&str> {
        self.0.as_ref().map(|s| &*s.label.value)
    }

    /// `topic`, and `source` when there is one.
    fn labels(&self, topic: &str) -> Vec<Label> {
        self.with("topic", topic)
    }

    /// `name` = `value`, and `source` when there is one.
    fn with(&self, name: &'static str, value: &str) -> Vec<Label> {
        let mut labels = vec![Label::new(name, value.to_owned())];
        labels.extend(self.only());
        labels
    }

    /// `source` when there is one; no label with one database.
    fn only(&self) -> Vec<Label> {
        self.label()
            .map(|source| Label::new("source", source.to_owned()))
            .into_iter()
            .collect()
    }
}

fn by_topic<'a>(messages: impl Iterator<Item = &'a ClaimedMessage>) -> HashMap<&'a str, u64> {
    let mut counts = HashMap::new();
    for m in messages {
        *counts.entry(m.topic.as_str()).or_insert(0) += 1;
    }
    counts
}

pub fn batch_claimed(worker: &WorkerId, source: &Source, batch: &[ClaimedMessage], took: Duration) {
    histogram!(CLAIM_SECONDS).record(took.as_secs_f64());
    if !batch.is_empty() {
        #[allow(clippy::cast_precision_loss)] // a batch holds at most 10,000 messages
        histogram!(CLAIM_SECONDS_PER_MESSAGE).record(took.as_secs_f64() / batch.len() as f64);
    }
    for (topic, n) in by_topic(batch.iter()) {
        counter!(CLAIMED, source.labels(topic)).increment(n);
    }
    tracing::debug!(worker_id = %worker, source = source.name(), messages = batch.len(), took_ms = millis(took), "claimed a batch");
}

pub fn batch_dispatched(destination: &str, source: &Source, took: Duration) {
    histogram!(DISPATCH_SECONDS, source.with("destination", destination))
        .record(took.as_secs_f64());
}

pub fn dispatch_deadline(destination: &str, source: &Source, deadline: Duration, messages: usize) {
    counter!(DISPATCH_DEADLINES, source.with("destination", destination)).increment(1);
    tracing::warn!(
        destination,
        source = source.name(),
        messages,
        timeout_ms = millis(deadline),
        "destination did not answer within its deadline; the batch is retryable"
    );
}

pub fn dispatch_panicked(
    destination: &str,
    source: &Source,
    batch: &[ClaimedMessage],
    panic: &str,
) {
    counter!(DISPATCH_PANICS, source.with("destination", destination)).increment(1);
    let ids: Vec<String> = batch.iter().map(|m| m.id.to_string()).collect();
    tracing::error!(
        destination,
        source = source.name(),
        outbox_ids = ids.join(","),
        panic,
        "destination panicked while publishing; releasing the batch's leases"
    );
}

/// A batch task ended in a panic outside the destination (a defect of the relay itself):
/// its leases run out and repair requeues them.
pub fn batch_task_panicked(worker: &WorkerId, panic: &str) {
    counter!(DISPATCH_PANICS, "destination" => "").increment(1);
    tracing::error!(worker_id = %worker, panic, "a batch task panicked; its leases will be repaired when they expire");
}

/// Lease time left when a batch's outcomes go to the database.
pub fn lease_left(left: Duration) {
    histogram!(LEASE_LEFT_SECONDS).record(left.as_secs_f64());
}

pub fn batch_completed(took: Duration) {
    histogram!(COMPLETE_SECONDS).record(took.as_secs_f64());
}

pub fn in_flight(source: &Source, messages: usize) {
    #[allow(clippy::cast_precision_loss)] // a message count is far below 2^52
    match &source.0 {
        None => gauge!(IN_FLIGHT).set(messages as f64),
        // The sources under one label (`other`) add up.
        Some(s) => {
            let mut by_source = s.label.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            by_source.insert(s.name.clone(), messages);
            let sum: usize = by_source.values().sum();
            gauge!(IN_FLIGHT, "source" => s.label.value.to_string()).set(sum as f64);
        }
    }
}

pub fn delivered<'a>(
    worker: &WorkerId,
    source: &Source,
    messages: impl Iterator<Item = &'a ClaimedMessage>,
) {
    let now = chrono::Utc::now();
    let mut counts: HashMap<&str, u64> = HashMap::new();
    for m in messages {
        *counts.entry(m.topic.as_str()).or_insert(0) += 1;
        let latency = (now - m.created_at).to_std().unwrap_or_default();
        histogram!(DELIVERY_LATENCY_SECONDS).record(latency.as_secs_f64());
        tracing::trace!(outbox_id = %m.id, worker_id = %worker, source = source.name(), topic = %m.topic, attempt_no = m.attempt_no, "delivered");
    }
    for (topic, n) in counts {
        counter!(DELIVERED, source.labels(topic)).increment(n);
    }
}

pub fn retry_scheduled(
    worker: &WorkerId,
    source: &Source,
    m: &ClaimedMessage,
    reason: &str,
    delay: Duration,
) {
    counter!(RETRIED, source.labels(&m.topic)).increment(1);
    let trace = m.trace_context();
    tracing::warn!(outbox_id = %m.id, worker_id = %worker, source = source.name(), topic = %m.topic, attempt_no = m.attempt_no,
        trace_id = trace.as_ref().map(TraceContext::trace_id), creation_span_id = trace.as_ref().map(TraceContext::parent_id),
        retry_in_ms = millis(delay), reason, "delivery failed; will retry (dead-lettered if out of attempts)");
}

pub fn rejected(worker: &WorkerId, source: &Source, m: &ClaimedMessage, reason: &str) {
    counter!(DEAD_LETTERED, source.labels(&m.topic)).increment(1);
    let trace = m.trace_context();
    tracing::warn!(outbox_id = %m.id, worker_id = %worker, source = source.name(), topic = %m.topic, attempt_no = m.attempt_no,
        trace_id = trace.as_ref().map(TraceContext::trace_id), creation_span_id = trace.as_ref().map(TraceContext::parent_id),
        reason, "destination rejected the message; dead-lettered");
}

pub fn retries_exhausted(worker: &WorkerId, source: &Source, m: &ClaimedMessage, reason: &str) {
    counter!(DEAD_LETTERED, source.labels(&m.topic)).increment(1);
    let trace = m.trace_context();
    tracing::warn!(outbox_id = %m.id, worker_id = %worker, source = source.name(), topic = %m.topic, attempt_no = m.attempt_no,
        trace_id = trace.as_ref().map(TraceContext::trace_id), creation_span_id = trace.as_ref().map(TraceContext::parent_id),
        reason, "last attempt failed; dead-lettered");
}

pub fn lease_lost(worker: &WorkerId, source: &Source, m: &ClaimedMessage) {
    counter!(LEASE_LOST, source.labels(&m.topic)).increment(1);
    let trace = m.trace_context();
    tracing::info!(outbox_id = %m.id, worker_id = %worker, source = source.name(), topic = %m.topic, attempt_no = m.attempt_no,
        trace_id = trace.as_ref().map(TraceContext::trace_id), creation_span_id = trace.as_ref().map(TraceContext::parent_id),
        "lease lost before completion; the outcome belongs to whoever holds it now");
}

pub fn released(
    worker: &WorkerId,
    source: &Source,
    batch: &[ClaimedMessage],
    released: i32,
    reason: &str,
) {
    for (topic, n) in by_topic(batch.iter()) {
        counter!(RELEASED, source.labels(topic)).increment(n);
    }
    tracing::info!(worker_id = %worker, source = source.name(), messages = batch.len(), released, reason,
        "gave undelivered messages back without an attempt (claimable again at once)");
}

pub fn stale_batch(worker: &WorkerId, batch: &[ClaimedMessage], claimed_ago: Duration) {
    counter!(STALE_BATCHES).increment(1);
    tracing::warn!(worker_id = %worker, messages = batch.len(), claimed_ms_ago = millis(claimed_ago),
        "not publishing a batch whose leases may have expired (this process was paused or starved); giving it back");
}

/// One repair pass: `requeued` expired leases given back, `dead_lettered` out of attempts.
pub fn repaired(worker: &WorkerId, requeued: i32, dead_lettered: i32) {
    counter!(REPAIR_REQUEUED).increment(u64::from(requeued.unsigned_abs()));
    counter!(REPAIR_DEAD_LETTERED).increment(u64::from(dead_lettered.unsigned_abs()));
    if requeued > 0 || dead_lettered > 0 {
        tracing::info!(worker_id = %worker, requeued, dead_lettered,
            "repaired expired leases");
    }
}

/// One `rotate_messages` call: logged when it truncated a slot or found one busy; the
/// pinned slots set [`PINNED_SLOTS`] (when this call had the turn; by `source` with many
/// sources), and a warning says so when all three are pinned.
pub fn rotated(
    worker: &WorkerId,
    source: &Source,
    current: i32,
    truncated: Option<i32>,
    busy: Option<i32>,
    pinned: Option<i32>,
) {
    if let Some(pinned) = pinned {
        gauge!(PINNED_SLOTS, source.only()).set(f64::from(pinned));
        if pinned >= 3 {
            tracing::warn!(worker_id = %worker, source = source.name(), current_slot = current,
                "every slot of outbox.messages but the current one holds a pending message \
                 (delayed, parked or behind a slow key): producers stay in the current slot \
                 and a held MVCC horizon's dead rows are not given back until one is done; \
                 see outbox.in_flight and outbox.topic_lag");
        }
    }
    if let Some(slot) = truncated {
        tracing::debug!(worker_id = %worker, source = source.name(), slot, current_slot = current,
            "truncated a slot of outbox.messages");
    }
    if let Some(slot) = busy {
        counter!(HELD_OPEN_SLOTS, source.only()).increment(1);
        tracing::debug!(worker_id = %worker, source = source.name(), slot,
            "a slot of outbox.messages with nothing pending was held open; truncated later");
    }
}

pub fn database_error(
    worker: &WorkerId,
    source: &Source,
    operation: &'static str,
    error: &dyn std::fmt::Display,
) {
    counter!(DATABASE_ERRORS, source.with("operation", operation)).increment(1);
    tracing::warn!(worker_id = %worker, source = source.name(), operation, error = %error,
        "database call failed");
}

/// The database pool's connections: `open` now, `idle` among them, at most `max`.
pub fn pool(open: usize, idle: usize, max: usize) {
    #[allow(clippy::cast_precision_loss)] // pool sizes are tiny
    {
        gauge!(POOL_CONNECTIONS, "state" => "open").set(open as f64);
        gauge!(POOL_CONNECTIONS, "state" => "idle").set(idle as f64);
        gauge!(POOL_CONNECTIONS, "state" => "max").set(max as f64);
    }
}

/// The `outbox_destination_circuit_state` gauge's values (its HELP text says the same).
const CIRCUIT_CLOSED: f64 = 0.0;
const CIRCUIT_OPEN: f64 = 1.0;
const CIRCUIT_HALF_OPEN: f64 = 2.0;

/// A destination's circuit starts closed.
pub fn circuit_started(destination: &str, source: &Source) {
    gauge!(CIRCUIT_STATE, source.with("destination", destination)).set(CIRCUIT_CLOSED);
}

pub fn circuit_opened(destination: &str, source: &Source) {
    gauge!(CIRCUIT_STATE, source.with("destination", destination)).set(CIRCUIT_OPEN);
    tracing::warn!(
        destination,
        source = source.name(),
        "circuit open: not claiming its topics until a probe succeeds"
    );
}

pub fn circuit_half_open(destination: &str, source: &Source) {
    gauge!(CIRCUIT_STATE, source.with("destination", destination)).set(CIRCUIT_HALF_OPEN);
    tracing::info!(
        destination,
        source = source.name(),
        "circuit half-open: the next message is a probe"
    );
}

pub fn circuit_closed(destination: &str, source: &Source) {
    gauge!(CIRCUIT_STATE, source.with("destination", destination)).set(CIRCUIT_CLOSED);
    tracing::info!(
        destination,
        source = source.name(),
        "circuit closed: destination is back"
    );
}

/// Who holds back the MVCC horizon, as the watchdog reports it (plain values: the figures
/// of one horizon holder of an observation, and the operator's advice about it).
#[derive(Clone, Copy, Debug)]
pub struct HorizonCulprit<'a> {
    pub kind: &'a str,
    pub pid: Option<i32>,
    pub name: Option<&'a str>,
    pub state: Option<&'a str>,
    pub age_seconds: Option<f64>,
    pub xid_age: Option<i64>,
    pub query: Option<&'a str>,
}

pub fn horizon_held(h: HorizonCulprit<'_>, advice: &str, threshold: Duration) {
    tracing::warn!(
        kind = %h.kind,
        pid = h.pid,
        name = h.name.unwrap_or(""),
        state = h.state.unwrap_or(""),
        age_seconds = h.age_seconds,
        xid_age = h.xid_age,
        query = h.query.unwrap_or(""),
        threshold_secs = threshold.as_secs(),
        advice = %advice,
        "MVCC horizon held: dead rows of outbox.messages cannot be vacuumed and claims slow down"
    );
}

pub fn horizon_released(h: HorizonCulprit<'_>) {
    tracing::info!(kind = %h.kind, pid = h.pid, name = h.name.unwrap_or(""),
        "MVCC horizon no longer held by it");
}

/// A topic whose ready messages no running relayer claims, named once when found: `ready`
/// messages, the oldest ready for `oldest_secs`, holding `held_keys` keys whose messages on
/// `held_topics` wait behind them.
pub fn topic_uncovered(
    source: &Source,
    topic: &str,
    ready: i64,
    oldest_secs: f64,
    held_keys: i64,
    held_topics: &[String],
) {
    tracing::warn!(
        source = source.name(),
        topic = %topic,
        ready,
        oldest_ready_age_secs = oldest_secs.round(),
        held_keys,
        held_topics = %held_topics.join(","),
        "topic claimed by no running relayer: its ready messages wait (and, by per-key order, \
         the later messages of their keys on held_topics); start a relayer whose routes cover it"
    );
}

/// A topic named by [`topic_uncovered`] is claimed again (or has nothing ready any more).
pub fn topic_covered_again(source: &Source, topic: &str) {
    tracing::info!(source = source.name(), topic = %topic, "topic no longer uncovered");
    uncovered_topic(source, topic, 0, 0);
}

/// The gauges of one uncovered topic (of `source`, with many).
#[allow(clippy::cast_precision_loss)] // counts far below 2^52
pub fn uncovered_topic(source: &Source, topic: &str, ready: i64, held_keys: i64) {
    gauge!(UNCOVERED_READY, source.labels(topic)).set(ready as f64);
    gauge!(UNCOVERED_HELD_KEYS, source.labels(topic)).set(held_keys as f64);
}

/// A topic every running relayer claiming it leaves out while the circuit of its
/// destination is open, named once when found: `ready` messages wait for `destinations`,
/// the oldest for `oldest_secs`, holding `held_keys` keys whose messages on `held_topics`
/// wait behind them.
pub fn topic_held_by_circuits(
    source: &Source,
    topic: &str,
    destinations: &[String],
    ready: i64,
    oldest_secs: f64,
    held_keys: i64,
    held_topics: &[String],
) {
    tracing::warn!(
        source = source.name(),
        topic = %topic,
        destinations = %destinations.join(","),
        ready,
        oldest_ready_age_secs = oldest_secs.round(),
        held_keys,
        held_topics = %held_topics.join(","),
        "topic held behind an open circuit: its ready messages wait for its destination, and \
         by per-key order so do the later messages of held_keys keys on held_topics; bring \
         the destination back, or route the topic elsewhere"
    );
}

/// A topic named by [`topic_held_by_circuits`] is claimed again (or has nothing ready).
pub fn topic_no_longer_held_by_circuits(source: &Source, topic: &str) {
    tracing::info!(source = source.name(), topic = %topic, "topic no longer held behind an open circuit");
    circuit_held_topic(source, topic, 0, 0);
}

/// The gauges of one topic held by open circuits (of `source`, with many).
#[allow(clippy::cast_precision_loss)] // counts far below 2^52
pub fn circuit_held_topic(source: &Source, topic: &str, ready: i64, held_keys: i64) {
    gauge!(CIRCUIT_HELD_READY, source.labels(topic)).set(ready as f64);
    gauge!(CIRCUIT_HELD_KEYS, source.labels(topic)).set(held_keys as f64);
}

/// Whether the notification listener hears its own test notification.
pub fn listener_healthy(healthy: bool) {
    gauge!(LISTENER_HEALTHY).set(if healthy { 1.0 } else { 0.0 });
}

/// Whether the leasing calls are sent unnamed.
pub fn unnamed_statements(unnamed: bool) {
    gauge!(UNNAMED_STATEMENTS).set(if unnamed { 1.0 } else { 0.0 });
}

/// Many sources: how many sources this process knows in each state.
pub fn sources(counts: &std::collections::BTreeMap<&'static str, usize>) {
    for (&state, &count) in counts {
        gauge!(SOURCES, "state" => state).set(count as f64);
    }
}

/// A duration in whole milliseconds as a log field: a number (u64), never a Debug string.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_sources_keep_their_name_and_the_rest_are_other() {
        let labels = SourceLabels::new(2);
        assert_eq!(labels.label("a").label(), Some("a"));
        assert_eq!(labels.label("b").label(), Some("b"));
        let c = labels.label("c");
        assert_eq!((c.name(), c.label()), (Some("c"), Some(OTHER_SOURCE)));
        // A named source keeps its name when it comes back.
        assert_eq!(labels.label("a").label(), Some("a"));
        assert_eq!(labels.label("d").label(), Some(OTHER_SOURCE));
    }

    #[test]
    fn the_sources_counted_as_other_add_up_their_messages_in_flight() {
        let labels = SourceLabels::new(1);
        let (a, b, c) = (labels.label("a"), labels.label("b"), labels.label("c"));
        in_flight(&a, 5);
        in_flight(&b, 3);
        in_flight(&c, 4);
        in_flight(&b, 1);
        let other = &c.0.as_ref().unwrap().label;
        let sum: usize = other.in_flight.lock().unwrap().values().sum();
        assert_eq!(sum, 5);
        let named = &a.0.as_ref().unwrap().label;
        assert_eq!(named.in_flight.lock().unwrap().values().sum::<usize>(), 5);
    }

    #[test]
    fn one_database_adds_no_source_label() {
        let labels = Source::default().labels("orders");
        assert_eq!(labels, vec![Label::new("topic", "orders")]);
        let labels = SourceLabels::new(1).label("billing").labels("orders");
        assert_eq!(
            labels,
            vec![
                Label::new("topic", "orders"),
                Label::new("source", "billing")
            ]
        );
    }
}

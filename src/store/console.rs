//! What the browser console (`crate::console`) reads and writes, one call per panel of a
//! page. Every call runs in a transaction of its own under `SET LOCAL statement_timeout`,
//! so that no page waits on a slow statement longer than the console's setting, and a
//! statement cancelled by it comes back as an error that says so
//! ([`StoreError::is_statement_timeout`]). Nothing here counts without a bound: counts stop
//! at [`COUNT_CAP`] + 1 rows, lists are keyset-paginated on `outbox_id` (the primary key of
//! `outbox.messages` and `outbox.dead_letters`), and the backlog per topic is read from the
//! fleet's observation (`outbox.observe`) rather than counted again.
//!
//! Every read goes through views and functions granted to `outbox_reader`: the message and
//! dead-letter screens call the SECURITY DEFINER functions of `schema/11_console.sql`
//! (`outbox.console_messages` and its siblings), which bound their limits and read a
//! payload only when asked, so a console login needs no right on a table. A replay is the
//! audited `start_replay` + `replay_step` of `outbox-relay replay`, the one write, whose
//! two functions are all it needs beyond `outbox_reader` (docs/console.md).

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};
use uuid::Uuid;

use super::dead_letters::DeadLetterFilter;
use super::{AttemptRecord, ObservationRow, ReportedCircuit, Result, Store, StoreError};

/// The most rows a console count reads: a larger count is shown as "more than 10,000".
pub const COUNT_CAP: i64 = 10_000;

/// A count read with at most [`COUNT_CAP`] + 1 rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CappedCount {
    /// The count, at most [`COUNT_CAP`].
    pub count: i64,
    /// More than [`COUNT_CAP`] rows matched.
    pub more: bool,
}

impl CappedCount {
    fn of(n: i64) -> Self {
        CappedCount {
            count: n.min(COUNT_CAP),
            more: n > COUNT_CAP,
        }
    }
}

impl std::fmt::Display for CappedCount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.more {
            write!(f, "more than {}", thousands(COUNT_CAP))
        } else {
            write!(f, "{}", thousands(self.count))
        }
    }
}

/// `n` with a comma every three digits.
pub fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// Where a pending message stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MessageState {
    /// Claimable now.
    Ready,
    /// Leased by a relayer.
    Leased,
    /// Behind an earlier message of its key.
    Waiting,
    /// Not before its `available_at` (a delay or a retry's backoff).
    Scheduled,
}

impl MessageState {
    pub const ALL: [MessageState; 4] = [
        MessageState::Ready,
        MessageState::Leased,
        MessageState::Waiting,
        MessageState::Scheduled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MessageState::Ready => "ready",
            MessageState::Leased => "leased",
            MessageState::Waiting => "waiting",
            MessageState::Scheduled => "scheduled",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

/// Which pending messages the Messages page lists; `None` matches everything.
#[derive(Clone, Debug, Default)]
pub struct MessageFilter {
    pub id: Option<Uuid>,
    pub topic: Option<String>,
    pub key: Option<String>,
    pub state: Option<MessageState>,
    /// Created at least this long ago.
    pub older_than: Option<Duration>,
    /// The keyset cursor: messages with a smaller `outbox_id` than this (the next page).
    pub before: Option<Uuid>,
}

/// How many pending messages `outbox.console_messages` searches below its cursor for a
/// filter that no id or key bounds (`outbox.console_search_window()`).
pub const SEARCH_WINDOW: i64 = 100_000;

impl MessageFilter {
    /// Whether `outbox.console_messages` searches this filter in a window of
    /// [`SEARCH_WINDOW`] messages (a topic, state or age without an id or key): a short page
    /// then means no more match in that window, not none at all.
    pub fn windowed(&self) -> bool {
        self.id.is_none()
            && self.key.is_none()
            && (self.topic.is_some() || self.state.is_some() || self.older_than.is_some())
    }
}

/// A pending message as the Messages page lists it.
#[derive(Clone, Debug)]
pub struct MessageRow {
    pub outbox_id: Uuid,
    pub topic: String,
    pub message_key: Option<String>,
    pub state: String,
    pub created_at: DateTime<Utc>,
    pub available_at: DateTime<Utc>,
    pub attempt_count: i32,
    pub claimed_by: Option<String>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

/// One pending message in full.
#[derive(Clone, Debug)]
pub struct MessageDetail {
    pub row: MessageRow,
    pub content_type: String,
    pub headers: serde_json::Value,
    /// The payload; `None` when it was not read (payloads are sensitive).
    pub payload: Option<Vec<u8>>,
    /// The payload's stored size, read either way.
    pub payload_bytes: i64,
    pub max_attempts: i32,
    /// Messages of the same key enqueued before it and still pending.
    pub ahead: Option<CappedCount>,
    /// The head of its key (the one delivered next), when it is not that head itself.
    pub key_head: Option<Uuid>,
}

/// One dead letter in full.
#[derive(Clone, Debug)]
pub struct DeadLetterDetail {
    pub topic: String,
    pub message_key: Option<String>,
    pub content_type: String,
    pub headers: serde_json::Value,
    /// The payload; `None` when it was not read (payloads are sensitive).
    pub payload: Option<Vec<u8>>,
    /// The payload's stored size, read either way.
    pub payload_bytes: i64,
    pub created_at: DateTime<Utc>,
    pub dead_lettered_at: DateTime<Utc>,
    pub attempt_count: i32,
    pub max_attempts: i32,
    pub last_error: Option<String>,
}

/// A dead letter as the Dead letters page lists it.
#[derive(Clone, Debug)]
pub struct DeadLetterRow {
    pub outbox_id: Uuid,
    pub topic: String,
    pub message_key: Option<String>,
    pub dead_lettered_at: DateTime<Utc>,
    pub attempt_count: i32,
    pub last_error: Option<String>,
}

/// Delivered attempts in one minute of the last hour.
#[derive(Clone, Debug)]
pub struct MinuteRate {
    pub minute: DateTime<Utc>,
    pub delivered: i64,
    pub failed: i64,
}

/// A worker as the observation snapshot saw it (its `workers` list, `outbox.observe`): the
/// leases it held and its attempts of the minute before.
#[derive(Clone, Debug)]
pub struct WorkerRow {
    pub worker_id: String,
    pub leases_held: i64,
    pub next_lease_expiry: Option<DateTime<Utc>>,
    /// Its attempts that delivered in the last minute.
    pub delivered_1m: i64,
    /// Its attempts that did not deliver (retryable, failed, zombie requeue) in the last
    /// minute.
    pub not_delivered_1m: i64,
    pub last_attempt_at: Option<DateTime<Utc>>,
}

impl WorkerRow {
    /// The `workers` list of an observation snapshot; empty when the snapshot has none
    /// (one stored by a relayer of a schema before V40).
    pub fn from_snapshot(snapshot: &serde_json::Value) -> Vec<WorkerRow> {
        let time = |v: &serde_json::Value| {
            v.as_str()
                .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                .map(|t| t.with_timezone(&Utc))
        };
        snapshot["workers"]
            .as_array()
            .map(|workers| {
                workers
                    .iter()
                    .map(|w| {
                        let attempts = w["attempts_last_minute"].as_object();
                        let count = |delivered: bool| {
                            attempts.map_or(0, |a| {
                                a.iter()
                                    .filter(|(state, _)| (*state == "DISPATCHED") == delivered)
                                    .map(|(_, n)| n.as_i64().unwrap_or(0))
                                    .sum()
                            })
                        };
                        WorkerRow {
                            worker_id: w["worker_id"].as_str().unwrap_or("").to_owned(),
                            leases_held: w["leases_held"].as_i64().unwrap_or(0),
                            next_lease_expiry: time(&w["next_lease_expiry"]),
                            delivered_1m: count(true),
                            not_delivered_1m: count(false),
                            last_attempt_at: time(&w["last_attempt_at"]),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// A row of `outbox.source_holders`.
#[derive(Clone, Debug)]
pub struct HolderRow {
    pub slot: i32,
    pub worker_id: String,
    pub acquired_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

/// A row of `outbox.recent_failures`.
#[derive(Clone, Debug)]
pub struct FailureRow {
    pub outbox_id: Uuid,
    pub topic: Option<String>,
    pub attempt_no: i32,
    pub state: String,
    pub worker_id: String,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub now_in: String,
}

/// A row of `outbox.replay_log`.
#[derive(Clone, Debug)]
pub struct ReplayRow {
    pub replay_id: i64,
    pub started_at: DateTime<Utc>,
    pub replayed_by: String,
    pub reason: Option<String>,
    pub replayed: i64,
}

impl StoreError {
    /// Whether Postgres cancelled the statement for running past its statement timeout
    /// (SQLSTATE 57014).
    pub fn is_statement_timeout(&self) -> bool {
        matches!(self, StoreError::Database { source, .. }
            if source.code().is_some_and(|c| c.code() == "57014"))
    }

    /// Whether Postgres refused this login a right (SQLSTATE 42501).
    pub fn is_permission_denied(&self) -> bool {
        matches!(self, StoreError::Database { source, .. }
            if source.code().is_some_and(|c| c.code() == "42501"))
    }
}

/// Parameters of one statement: values with their types.
type Params<'a> = Vec<(&'a (dyn ToSql + Sync), Type)>;

impl Store {
    /// `sql` with `params`, in a transaction of its own (read-only when `read_only`) whose
    /// statements may each run for `timeout` at most.
    async fn console_query(
        &self,
        timeout: Duration,
        read_only: bool,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<Vec<Row>> {
        let mut client = self.client().await?;
        let tx = client
            .build_transaction()
            .read_only(read_only)
            .start()
            .await?;
        tx.batch_execute(&format!(
            "SET LOCAL statement_timeout = {}",
            timeout.as_millis().max(1)
        ))
        .await?;
        let rows = tx.query_typed(&self.sql(sql), params).await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// `outbox.observe`, as [`Store::observe`], under the console's timeout. It asks for the
    /// relayers' default number of topics (`observe_top_topics`, 10): a snapshot the console
    /// refreshes is the one the fleet reads and exports, and a larger number there would
    /// make every relayer export that many topic series until the next refresh.
    pub async fn console_observe(
        &self,
        timeout: Duration,
        max_age: Duration,
    ) -> Result<Option<ObservationRow>> {
        let rows = self
            .console_query(
                timeout,
                false,
                "SELECT observed_at, refreshed, snapshot \
                   FROM outbox.observe(10, make_interval(secs => $1))",
                &vec![(&max_age.as_secs_f64(), Type::FLOAT8)],
            )
            .await?;
        Ok(rows.first().and_then(|row| {
            let observed_at: Option<DateTime<Utc>> = row.get(0);
            observed_at.map(|observed_at| ObservationRow {
                observed_at,
                refreshed: row.get(1),
                snapshot: row.get(2),
            })
        }))
    }

    /// The stored observation snapshot as it is (`outbox.latest_observation`), never
    /// computed: one row's read at any backlog. `None` before the first refresh.
    pub async fn console_latest_observation(
        &self,
        timeout: Duration,
    ) -> Result<Option<ObservationRow>> {
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT observed_at, snapshot FROM outbox.latest_observation()",
                &vec![],
            )
            .await?;
        Ok(rows.first().map(|row| ObservationRow {
            observed_at: row.get(0),
            refreshed: false,
            snapshot: row.get(1),
        }))
    }

    /// Delivered and not-delivered attempts per whole minute of the last hour, as the
    /// observation's refreshes counted them (`outbox.observed_attempt_rates`), oldest
    /// minute first; minutes not counted left out.
    pub async fn console_rates(&self, timeout: Duration) -> Result<Vec<MinuteRate>> {
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT minute, delivered, not_delivered FROM outbox.observed_attempt_rates()",
                &vec![],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| MinuteRate {
                minute: r.get(0),
                delivered: r.get(1),
                failed: r.get(2),
            })
            .collect())
    }

    /// The `outbox.circuits` view under the console's timeout.
    pub async fn console_circuits(&self, timeout: Duration) -> Result<Vec<ReportedCircuit>> {
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT worker_id, destination, state, since, reported_at, expires_at, stale \
                   FROM outbox.circuits ORDER BY destination, stale, state, worker_id",
                &vec![],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| ReportedCircuit {
                worker_id: r.get(0),
                report: super::CircuitReport {
                    destination: r.get(1),
                    state: r.get(2),
                    since: r.get(3),
                },
                reported_at: r.get(4),
                expires_at: r.get(5),
                stale: r.get(6),
            })
            .collect())
    }

    /// The `outbox.source_holders` view: who serves this source now.
    pub async fn console_holders(&self, timeout: Duration) -> Result<Vec<HolderRow>> {
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT slot, worker_id, acquired_at, expires_at \
                   FROM outbox.source_holders ORDER BY slot",
                &vec![],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| HolderRow {
                slot: r.get(0),
                worker_id: r.get(1),
                acquired_at: r.get(2),
                expires_at: r.get(3),
            })
            .collect())
    }

    /// The `outbox.recent_failures` view (the latest 100 attempts that did not deliver).
    pub async fn console_failures(&self, timeout: Duration) -> Result<Vec<FailureRow>> {
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT outbox_id, topic, attempt_no, state::text, worker_id, error, \
                        created_at, now_in \
                   FROM outbox.recent_failures ORDER BY created_at DESC",
                &vec![],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| FailureRow {
                outbox_id: r.get(0),
                topic: r.get(1),
                attempt_no: r.get(2),
                state: r.get(3),
                worker_id: r.get(4),
                error: r.get(5),
                created_at: r.get(6),
                now_in: r.get(7),
            })
            .collect())
    }

    /// The latest `limit` replays of `outbox.replay_log`.
    pub async fn console_replays(&self, timeout: Duration, limit: i64) -> Result<Vec<ReplayRow>> {
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT replay_id, started_at, replayed_by, reason, replayed \
                   FROM outbox.replay_log ORDER BY replay_id DESC LIMIT $1",
                &vec![(&limit, Type::INT8)],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| ReplayRow {
                replay_id: r.get(0),
                started_at: r.get(1),
                replayed_by: r.get(2),
                reason: r.get(3),
                replayed: r.get(4),
            })
            .collect())
    }

    /// Pending messages matching `filter`, newest first (`outbox_id` descending, on the
    /// primary key), at most `limit` (1 to 1001): `outbox.console_messages`.
    pub async fn console_messages(
        &self,
        timeout: Duration,
        filter: &MessageFilter,
        limit: i64,
    ) -> Result<Vec<MessageRow>> {
        let older_than = filter
            .older_than
            .map(|d| format!("{} milliseconds", d.as_millis()));
        let state = filter.state.map(MessageState::as_str);
        let limit = i32::try_from(limit).unwrap_or(i32::MAX);
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT outbox_id, topic, message_key, state, created_at, available_at, \
                        attempt_count, claimed_by, lease_expires_at, last_error \
                   FROM outbox.console_messages($1, $2, $3, $4, $5::text::interval, $6, $7)",
                &vec![
                    (&filter.id, Type::UUID),
                    (&filter.topic, Type::TEXT),
                    (&filter.key, Type::TEXT),
                    (&state, Type::TEXT),
                    (&older_than, Type::TEXT),
                    (&filter.before, Type::UUID),
                    (&limit, Type::INT4),
                ],
            )
            .await?;
        Ok(rows.iter().map(message_row).collect())
    }

    /// Where the search window of `console_messages` below `before` ends: the cursor of
    /// the next window (`outbox.console_window_end`); `None` when the window reached the
    /// oldest pending message.
    pub async fn console_window_end(
        &self,
        timeout: Duration,
        before: Option<Uuid>,
    ) -> Result<Option<Uuid>> {
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT outbox.console_window_end($1)",
                &vec![(&before, Type::UUID)],
            )
            .await?;
        Ok(rows.first().and_then(|r| r.get(0)))
    }

    /// One pending message in full with its key's position, or `None` when it is not
    /// pending: `outbox.console_message`. Its payload is read only `with_payload`.
    pub async fn console_message(
        &self,
        timeout: Duration,
        id: Uuid,
        with_payload: bool,
    ) -> Result<Option<MessageDetail>> {
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT outbox_id, topic, message_key, state, created_at, available_at, \
                        attempt_count, claimed_by, lease_expires_at, last_error, \
                        content_type, headers, payload, payload_bytes, max_attempts, ahead, \
                        key_head \
                   FROM outbox.console_message($1, $2)",
                &vec![(&id, Type::UUID), (&with_payload, Type::BOOL)],
            )
            .await?;
        Ok(rows.first().map(|r| {
            let head: Option<Uuid> = r.get(16);
            MessageDetail {
                row: message_row(r),
                content_type: r.get(10),
                headers: r.get(11),
                payload: r.get(12),
                payload_bytes: r.get(13),
                max_attempts: r.get(14),
                ahead: r.get::<_, Option<i64>>(15).map(CappedCount::of),
                key_head: head.filter(|h| *h != id),
            }
        }))
    }

    /// One dead letter in full, or `None` when `id` is not a dead letter:
    /// `outbox.console_dead_letter`. Its payload is read only `with_payload`.
    pub async fn console_dead_letter(
        &self,
        timeout: Duration,
        id: Uuid,
        with_payload: bool,
    ) -> Result<Option<DeadLetterDetail>> {
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT topic, message_key, content_type, headers, payload, payload_bytes, \
                        created_at, dead_lettered_at, attempt_count, max_attempts, last_error \
                   FROM outbox.console_dead_letter($1, $2)",
                &vec![(&id, Type::UUID), (&with_payload, Type::BOOL)],
            )
            .await?;
        Ok(rows.first().map(|r| DeadLetterDetail {
            topic: r.get(0),
            message_key: r.get(1),
            content_type: r.get(2),
            headers: r.get(3),
            payload: r.get(4),
            payload_bytes: r.get(5),
            created_at: r.get(6),
            dead_lettered_at: r.get(7),
            attempt_count: r.get(8),
            max_attempts: r.get(9),
            last_error: r.get(10),
        }))
    }

    /// Every attempt of message `id` (up to 1,000), oldest first: `outbox.console_attempts`.
    pub async fn console_attempts(
        &self,
        timeout: Duration,
        id: Uuid,
    ) -> Result<Vec<AttemptRecord>> {
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT attempt_no, state, worker_id, error, created_at \
                   FROM outbox.console_attempts($1, 1000)",
                &vec![(&id, Type::UUID)],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| AttemptRecord {
                attempt_no: r.get(0),
                state: r.get(1),
                worker_id: r.get(2),
                error: r.get(3),
                created_at: r.get(4),
            })
            .collect())
    }

    /// Dead letters matching `filter` (ids, topic, since, error text), newest first
    /// (`outbox_id` descending, on the primary key), after the cursor `before`, at most
    /// `limit` (1 to 1001): `outbox.console_dead_letters`.
    pub async fn console_dead_letters(
        &self,
        timeout: Duration,
        filter: &DeadLetterFilter,
        before: Option<Uuid>,
        limit: i64,
    ) -> Result<Vec<DeadLetterRow>> {
        let limit = i32::try_from(limit).unwrap_or(i32::MAX);
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT outbox_id, topic, message_key, dead_lettered_at, attempt_count, \
                        last_error \
                   FROM outbox.console_dead_letters($1, $2, $3, $4, $5, $6)",
                &vec![
                    (&filter.ids, Type::UUID_ARRAY),
                    (&filter.topic, Type::TEXT),
                    (&filter.since, Type::TIMESTAMPTZ),
                    (&filter.error_contains, Type::TEXT),
                    (&before, Type::UUID),
                    (&limit, Type::INT4),
                ],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| DeadLetterRow {
                outbox_id: r.get(0),
                topic: r.get(1),
                message_key: r.get(2),
                dead_lettered_at: r.get(3),
                attempt_count: r.get(4),
                last_error: r.get(5),
            })
            .collect())
    }

    /// How many dead letters match `filter`, read with at most [`COUNT_CAP`] + 1 rows:
    /// `outbox.console_dead_letter_count`.
    pub async fn console_dead_letter_count(
        &self,
        timeout: Duration,
        filter: &DeadLetterFilter,
    ) -> Result<CappedCount> {
        let rows = self
            .console_query(
                timeout,
                true,
                "SELECT outbox.console_dead_letter_count($1, $2, $3, $4)",
                &vec![
                    (&filter.ids, Type::UUID_ARRAY),
                    (&filter.topic, Type::TEXT),
                    (&filter.since, Type::TIMESTAMPTZ),
                    (&filter.error_contains, Type::TEXT),
                ],
            )
            .await?;
        Ok(CappedCount::of(rows[0].get(0)))
    }

    /// The audited replay of `outbox-relay replay`: `outbox.start_replay` with `filter`
    /// and `reason`, then `outbox.replay_step` until nothing is left, each under the
    /// console's timeout. Returns the replay's id and how many moved.
    pub async fn console_replay(
        &self,
        timeout: Duration,
        filter: &DeadLetterFilter,
        reason: &str,
    ) -> Result<(i64, i64)> {
        let rows = self
            .console_query(
                timeout,
                false,
                "SELECT outbox.start_replay($1, $2, $3, $4, $5)",
                &vec![
                    (&filter.ids, Type::UUID_ARRAY),
                    (&filter.topic, Type::TEXT),
                    (&filter.since, Type::TIMESTAMPTZ),
                    (&filter.error_contains, Type::TEXT),
                    (&reason, Type::TEXT),
                ],
            )
            .await?;
        let replay_id: i64 = rows[0].get(0);
        let step: i32 = 1000;
        let mut moved: i64 = 0;
        loop {
            let rows = self
                .console_query(
                    timeout,
                    false,
                    "SELECT outbox.replay_step($1, $2)",
                    &vec![(&replay_id, Type::INT8), (&step, Type::INT4)],
                )
                .await?;
            let n: i32 = rows[0].get(0);
            moved += i64::from(n);
            if n < step {
                return Ok((replay_id, moved));
            }
        }
    }
}

fn message_row(r: &Row) -> MessageRow {
    MessageRow {
        outbox_id: r.get(0),
        topic: r.get(1),
        message_key: r.get(2),
        state: r.get(3),
        created_at: r.get(4),
        available_at: r.get(5),
        attempt_count: r.get(6),
        claimed_by: r.get(7),
        lease_expires_at: r.get(8),
        last_error: r.get(9),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_past_the_cap_say_more_than() {
        assert_eq!(CappedCount::of(10_001).to_string(), "more than 10,000");
        assert_eq!(CappedCount::of(10_000).to_string(), "10,000");
        assert_eq!(CappedCount::of(7).to_string(), "7");
    }

    #[test]
    fn message_states_are_named_both_ways() {
        for s in MessageState::ALL {
            assert_eq!(MessageState::parse(s.as_str()), Some(s));
        }
        assert_eq!(MessageState::parse("delivered"), None);
    }
}

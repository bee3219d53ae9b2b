//! Dead letters for the operator verbs (`dead-letters list|show`, `replay`): one filter,
//! defined once in SQL (`outbox.dead_letters_matching`), to list, count and replay them.

use chrono::{DateTime, Utc};
use tokio_postgres::Row;
use tokio_postgres::types::Type;
use uuid::Uuid;

use super::{Result, Store};
use crate::message::OutboxId;

/// Which dead letters an operator verb looks at; `None` matches everything.
#[derive(Clone, Debug, Default)]
pub struct DeadLetterFilter {
    /// These dead letters only.
    pub ids: Option<Vec<Uuid>>,
    pub topic: Option<String>,
    /// Dead-lettered at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// The last error contains this text (any case).
    pub error_contains: Option<String>,
}

/// A row of `outbox.dead_letters`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeadLetter {
    pub outbox_id: Uuid,
    pub topic: String,
    pub message_key: Option<String>,
    pub content_type: String,
    pub headers: serde_json::Value,
    #[serde(skip)]
    pub payload: Vec<u8>,
    pub payload_bytes: i64,
    pub created_at: DateTime<Utc>,
    pub dead_lettered_at: DateTime<Utc>,
    pub attempt_count: i32,
    pub max_attempts: i32,
    pub last_error: Option<String>,
}

/// A row of `outbox.attempts`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AttemptRecord {
    pub attempt_no: i32,
    pub state: String,
    pub worker_id: String,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
}

impl Store {
    /// `outbox.start_replay`: records a replay of what `filter` selects (with `reason`) and
    /// returns its id; nothing moves until [`Store::replay_step`].
    pub async fn start_replay(
        &self,
        filter: &DeadLetterFilter,
        reason: Option<&str>,
    ) -> Result<i64> {
        let client = self.client().await?;
        let row = client
            .query_typed_one(
                &self.sql("SELECT outbox.start_replay($1, $2, $3, $4, $5)"),
                &[
                    (&filter.ids, Type::UUID_ARRAY),
                    (&filter.topic, Type::TEXT),
                    (&filter.since, Type::TIMESTAMPTZ),
                    (&filter.error_contains, Type::TEXT),
                    (&reason, Type::TEXT),
                ],
            )
            .await?;
        Ok(row.get(0))
    }

    /// `outbox.replay_step`: moves up to `limit` more dead letters of replay `replay_id`;
    /// returns how many (0: done).
    pub async fn replay_step(&self, replay_id: i64, limit: i32) -> Result<i32> {
        let client = self.client().await?;
        let row = client
            .query_typed_one(
                &self.sql("SELECT outbox.replay_step($1, $2)"),
                &[(&replay_id, Type::INT8), (&limit, Type::INT4)],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Dead letters matching `filter`, newest first, at most `limit` (payloads not loaded).
    pub async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: i64,
    ) -> Result<Vec<DeadLetter>> {
        let client = self.client().await?;
        let rows = client
            .query_typed(
                &self.sql(&format!(
                    "SELECT {DEAD_LETTER_COLUMNS}, ''::bytea FROM {DEAD_LETTERS_MATCHING} \
                     ORDER BY dead_lettered_at DESC, outbox_id LIMIT $5"
                )),
                &[
                    (&filter.ids, Type::UUID_ARRAY),
                    (&filter.topic, Type::TEXT),
                    (&filter.since, Type::TIMESTAMPTZ),
                    (&filter.error_contains, Type::TEXT),
                    (&limit, Type::INT8),
                ],
            )
            .await?;
        Ok(rows.iter().map(dead_letter).collect())
    }

    /// How many dead letters match `filter`.
    pub async fn dead_letter_count(&self, filter: &DeadLetterFilter) -> Result<i64> {
        let client = self.client().await?;
        let row = client
            .query_typed_one(
                &self.sql(&format!("SELECT count(*) FROM {DEAD_LETTERS_MATCHING}")),
                &[
                    (&filter.ids, Type::UUID_ARRAY),
                    (&filter.topic, Type::TEXT),
                    (&filter.since, Type::TIMESTAMPTZ),
                    (&filter.error_contains, Type::TEXT),
                ],
            )
            .await?;
        Ok(row.get(0))
    }

    /// How many messages were dead-lettered after `from` and up to `to`, whatever made them
    /// dead letters (a permanent refusal, the last attempt of the budget, a lease repair).
    /// Read from `outbox.dead_letters` when the login may (outbox_relay, the owner); a login
    /// that may read the views only (outbox_reader) gets the dead letters among the latest
    /// 100 attempts that did not deliver (`outbox.recent_failures`), which misses some only
    /// when more than 100 such attempts fall in the range.
    pub async fn dead_lettered_between(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<i64> {
        let client = self.client().await?;
        let all = client
            .query_typed_one(
                &self.sql(
                    "SELECT count(*) FROM outbox.dead_letters_matching(NULL, NULL, $1, NULL) \
                      WHERE dead_lettered_at > $1 AND dead_lettered_at <= $2",
                ),
                &[(&from, Type::TIMESTAMPTZ), (&to, Type::TIMESTAMPTZ)],
            )
            .await;
        let row = match all {
            Ok(row) => row,
            Err(e) if e.code().is_some_and(|c| c.code() == "42501") => {
                client
                    .query_typed_one(
                        &self.sql(
                            "SELECT count(DISTINCT outbox_id) FROM outbox.recent_failures \
                              WHERE now_in = 'dead_letter' AND created_at > $1 \
                                AND created_at <= $2",
                        ),
                        &[(&from, Type::TIMESTAMPTZ), (&to, Type::TIMESTAMPTZ)],
                    )
                    .await?
            }
            Err(e) => return Err(e.into()),
        };
        Ok(row.get(0))
    }

    /// One dead letter with its payload and every attempt, oldest first.
    pub async fn dead_letter(
        &self,
        id: OutboxId,
    ) -> Result<Option<(DeadLetter, Vec<AttemptRecord>)>> {
        let client = self.client().await?;
        let Some(row) = client
            .query_typed_opt(
                &self.sql(&format!(
                    "SELECT {DEAD_LETTER_COLUMNS}, payload FROM outbox.dead_letters \
                     WHERE outbox_id = $1"
                )),
                &[(&id.0, Type::UUID)],
            )
            .await?
        else {
            return Ok(None);
        };
        let attempts = client
            .query_typed(
                &self.sql(
                    "SELECT attempt_no, state::text, worker_id, error, created_at \
                 FROM outbox.attempts WHERE outbox_id = $1 ORDER BY attempt_no",
                ),
                &[(&id.0, Type::UUID)],
            )
            .await?
            .iter()
            .map(|r| AttemptRecord {
                attempt_no: r.get(0),
                state: r.get(1),
                worker_id: r.get(2),
                error: r.get(3),
                created_at: r.get(4),
            })
            .collect();
        Ok(Some((dead_letter(&row), attempts)))
    }
}

const DEAD_LETTER_COLUMNS: &str = "outbox_id, topic, message_key, content_type, headers, \
     octet_length(payload)::bigint, created_at, dead_lettered_at, attempt_count, max_attempts, \
     last_error";

/// The dead letters a [`DeadLetterFilter`] selects (`$1` ids, `$2` topic, `$3` since,
/// `$4` error text): the filter is defined once, in SQL, for listing and replaying alike.
const DEAD_LETTERS_MATCHING: &str =
    "outbox.dead_letters_matching($1::uuid[], $2::text, $3::timestamptz, $4::text) AS d";

fn dead_letter(r: &Row) -> DeadLetter {
    DeadLetter {
        outbox_id: r.get(0),
        topic: r.get(1),
        message_key: r.get(2),
        content_type: r.get(3),
        headers: r.get(4),
        payload_bytes: r.get(5),
        created_at: r.get(6),
        dead_lettered_at: r.get(7),
        attempt_count: r.get(8),
        max_attempts: r.get(9),
        last_error: r.get(10),
        payload: r.get(11),
    }
}

//! The leasing functions, the relayer's hot path: `claim_outbox_batch_seq`,
//! `complete_outbox_batch`, `extend_outbox_leases`, `release_outbox_leases` and
//! `repair_expired_leases`. The fences (token, worker, expiry) are checked by the database;
//! a lost lease comes back as a row or as [`StoreError::LeaseLost`](super::StoreError).

use chrono::{DateTime, Utc};
use tokio_postgres::Row;
use tokio_postgres::types::Type;
use uuid::Uuid;

use super::{Result, Store};
use crate::message::{
    ClaimedMessage, Completion, CompletionResult, LeaseToken, OutboxId, WorkerId,
};

/// Byte limits of a claim (`None`: no limit).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClaimSizes {
    /// The batch stops before the message that would take its payloads past this (the
    /// first message is always taken).
    pub max_batch_bytes: Option<i64>,
    /// Larger payloads are not loaded: the message comes back with `payload_withheld`.
    pub max_message_bytes: Option<i64>,
}

/// The claim's topic patterns (SQL `LIKE`; `None`: no filter of that kind).
#[derive(Clone, Copy, Debug, Default)]
pub struct TopicFilter<'a> {
    /// Claim only topics matching one of these: the topics this relayer's routes cover.
    pub include: Option<&'a [String]>,
    /// Claim no topic matching one of these: destinations that admit no work now.
    pub exclude: Option<&'a [String]>,
}

/// Result of one `repair_expired_leases` pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Repair {
    pub requeued: i32,
    pub dead_lettered: i32,
}

impl Store {
    /// `outbox.claim_outbox_batch_seq`: leases up to `batch_size` ready messages of `topics`
    /// (all when `None`) whose topic matches one of the LIKE patterns of `filter.include`
    /// (all when `None`) and none of those of `filter.exclude`, within the byte limits of
    /// `sizes`.
    pub async fn claim(
        &self,
        batch_size: i32,
        worker: &WorkerId,
        lease_secs: i32,
        topics: Option<&[String]>,
        filter: TopicFilter<'_>,
        sizes: ClaimSizes,
    ) -> Result<Vec<ClaimedMessage>> {
        let TopicFilter { include, exclude } = filter;
        let rows = self
            .leasing_query(
                "SELECT * FROM outbox.claim_outbox_batch_seq($1, $2, $3, $4, $5, $6, $7, $8)",
                &[
                    (&batch_size, Type::INT4),
                    (&worker.as_str(), Type::TEXT),
                    (&lease_secs, Type::INT4),
                    (&topics, Type::TEXT_ARRAY),
                    (&exclude, Type::TEXT_ARRAY),
                    (&sizes.max_batch_bytes, Type::INT8),
                    (&sizes.max_message_bytes, Type::INT8),
                    (&include, Type::TEXT_ARRAY),
                ],
            )
            .await?;
        let claimed: Vec<ClaimedMessage> = rows.iter().map(claimed_from_row).collect();
        let bytes: i64 = claimed.iter().map(|m| m.payload_bytes).sum();
        let full = usize::try_from(batch_size).is_ok_and(|limit| claimed.len() >= limit)
            || sizes.max_batch_bytes.is_some_and(|max| bytes >= max);
        self.claimed(full, !claimed.is_empty());
        Ok(claimed)
    }

    /// `outbox.complete_outbox_batch`: one round trip for a whole batch. Lost leases come
    /// back as `lease_lost` rows, in input order.
    pub async fn complete(
        &self,
        worker: &WorkerId,
        completions: &[Completion],
    ) -> Result<Vec<CompletionResult>> {
        let ids: Vec<Uuid> = completions.iter().map(|c| c.id.0).collect();
        let tokens: Vec<Uuid> = completions.iter().map(|c| c.lease_token.0).collect();
        let states: Vec<&str> = completions.iter().map(|c| c.state.as_sql()).collect();
        let errors: Vec<Option<&str>> = completions.iter().map(|c| c.error.as_deref()).collect();
        let retry_ats: Vec<Option<DateTime<Utc>>> =
            completions.iter().map(|c| c.retry_at).collect();
        let rows = self
            .leasing_query(
                "SELECT * FROM outbox.complete_outbox_batch(\
                 $1, $2, $3, $4::text[]::outbox.attempt_state[], $5, $6)",
                &[
                    (&worker.as_str(), Type::TEXT),
                    (&ids, Type::UUID_ARRAY),
                    (&tokens, Type::UUID_ARRAY),
                    (&states, Type::TEXT_ARRAY),
                    (&errors, Type::TEXT_ARRAY),
                    (&retry_ats, Type::TIMESTAMPTZ_ARRAY),
                ],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| CompletionResult {
                id: OutboxId(r.get(0)),
                attempt_no: r.get(1),
                lease_lost: r.get(2),
                dead_lettered: r.get(3),
            })
            .collect())
    }

    /// `outbox.extend_outbox_leases`: returns the leases still held and their new expiry.
    pub async fn extend(
        &self,
        worker: &WorkerId,
        leases: &[(OutboxId, LeaseToken)],
        lease_secs: i32,
    ) -> Result<Vec<(OutboxId, DateTime<Utc>)>> {
        let (ids, tokens) = split_leases(leases);
        let rows = self
            .extending_query(
                "SELECT * FROM outbox.extend_outbox_leases($1, $2, $3, $4)",
                &[
                    (&worker.as_str(), Type::TEXT),
                    (&ids, Type::UUID_ARRAY),
                    (&tokens, Type::UUID_ARRAY),
                    (&lease_secs, Type::INT4),
                ],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| (OutboxId(r.get(0)), r.get(1)))
            .collect())
    }

    /// `outbox.release_outbox_leases`: gives back undispatched messages; returns how many.
    pub async fn release(
        &self,
        worker: &WorkerId,
        leases: &[(OutboxId, LeaseToken)],
    ) -> Result<i32> {
        let (ids, tokens) = split_leases(leases);
        let rows = self
            .leasing_query(
                "SELECT outbox.release_outbox_leases($1, $2, $3)",
                &[
                    (&worker.as_str(), Type::TEXT),
                    (&ids, Type::UUID_ARRAY),
                    (&tokens, Type::UUID_ARRAY),
                ],
            )
            .await?;
        Ok(rows.first().map_or(0, |r| r.get(0)))
    }

    /// `outbox.repair_expired_leases`: one pass over expired leases.
    pub async fn repair(&self, limit: i32) -> Result<Repair> {
        let row = self
            .leasing_call()
            .await?
            .query_typed_one(
                &self.sql("SELECT * FROM outbox.repair_expired_leases($1)"),
                &[(&limit, Type::INT4)],
            )
            .await?;
        Ok(Repair {
            requeued: row.get(0),
            dead_lettered: row.get(1),
        })
    }
}

fn split_leases(leases: &[(OutboxId, LeaseToken)]) -> (Vec<Uuid>, Vec<Uuid>) {
    leases.iter().map(|(id, token)| (id.0, token.0)).unzip()
}

fn claimed_from_row(r: &Row) -> ClaimedMessage {
    let payload: Option<Vec<u8>> = r.get("payload");
    ClaimedMessage {
        payload_withheld: payload.is_none(),
        origin: None,
        payload_bytes: r.get("payload_bytes"),
        id: OutboxId(r.get("outbox_id")),
        lease_token: LeaseToken(r.get("lease_token")),
        topic: r.get("topic"),
        key: r.get("message_key"),
        seq: r.get("seq"),
        payload: payload.unwrap_or_default(),
        content_type: r.get("content_type"),
        headers: r.get("headers"),
        attempt_no: r.get("attempt_no"),
        created_at: r.get("created_at"),
        lease_expires_at: r.get("lease_expires_at"),
    }
}

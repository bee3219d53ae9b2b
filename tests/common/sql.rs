//! Calls of the SQL API shared by the tests of its contract (`tests/sql_api/`): enqueue,
//! claim, complete, repair, each as one plain SQL statement, and what the tests read back.

use std::time::Duration;

use tokio_postgres::Client;
use uuid::Uuid;

use super::TestDb;

#[derive(Clone)]
pub struct Claimed {
    pub id: Uuid,
    pub token: Uuid,
    pub attempt_no: i32,
    pub key: Option<String>,
    /// `None` from the claim kept for the previous release, which does not return it.
    pub seq: Option<i64>,
}

pub async fn enqueue(c: &Client, topic: &str, key: Option<&str>) -> Uuid {
    c.query_one(
        "SELECT outbox.enqueue($1, '{\"n\": 1}'::jsonb, $2)",
        &[&topic, &key],
    )
    .await
    .unwrap()
    .get(0)
}

pub async fn enqueue_with(c: &Client, key: Option<&str>, max_attempts: i32) -> Uuid {
    c.query_one(
        "SELECT outbox.enqueue('t', '{}'::jsonb, $1, p_max_attempts => $2)",
        &[&key, &max_attempts],
    )
    .await
    .unwrap()
    .get(0)
}

/// `outbox.claim_outbox_batch_seq`, the relayer's claim.
pub async fn claim(c: &Client, n: i32, worker: &str, lease_secs: i32) -> Vec<Claimed> {
    c.query(
        "SELECT outbox_id, lease_token, attempt_no, message_key, seq \
         FROM outbox.claim_outbox_batch_seq($1, $2, $3)",
        &[&n, &worker, &lease_secs],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| Claimed {
        id: r.get(0),
        token: r.get(1),
        attempt_no: r.get(2),
        key: r.get(3),
        seq: Some(r.get(4)),
    })
    .collect()
}

/// `outbox.claim_outbox_batch`, the claim kept for relayers of the previous release.
pub async fn claim_kept(c: &Client, n: i32, worker: &str, lease_secs: i32) -> Vec<Claimed> {
    c.query(
        "SELECT outbox_id, lease_token, attempt_no, message_key \
         FROM outbox.claim_outbox_batch($1, $2, $3)",
        &[&n, &worker, &lease_secs],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| Claimed {
        id: r.get(0),
        token: r.get(1),
        attempt_no: r.get(2),
        key: r.get(3),
        seq: None,
    })
    .collect()
}

pub async fn complete(
    c: &Client,
    m: &Claimed,
    worker: &str,
    state: &str,
    error: Option<&str>,
) -> Result<i32, tokio_postgres::Error> {
    c.query_one(
        "SELECT outbox.complete_outbox_attempt($1, $2, $3, $4::text::outbox.attempt_state, $5)",
        &[&m.id, &m.token, &worker, &state, &error],
    )
    .await
    .map(|r| r.get(0))
}

/// Reports one state per claimed message in one `complete_outbox_batch` call (an error text
/// for every state but DISPATCHED, a retry in an hour for RETRYABLE); returns how many
/// leases were reported lost.
pub async fn complete_batch(c: &Client, worker: &str, claimed: &[Claimed], states: &[&str]) -> i64 {
    let ids: Vec<Uuid> = claimed.iter().map(|m| m.id).collect();
    let tokens: Vec<Uuid> = claimed.iter().map(|m| m.token).collect();
    let states: Vec<String> = states.iter().map(|s| (*s).to_owned()).collect();
    c.query_one(
        "SELECT count(*) FILTER (WHERE lease_lost) FROM outbox.complete_outbox_batch($1, $2, $3, \
                $4::text[]::outbox.attempt_state[], \
                ARRAY(SELECT CASE WHEN s <> 'DISPATCHED' THEN 'failed' END \
                        FROM unnest($4::text[]) WITH ORDINALITY AS u(s, i) ORDER BY i), \
                ARRAY(SELECT CASE WHEN s = 'RETRYABLE' THEN now() + interval '1 hour' END \
                        FROM unnest($4::text[]) WITH ORDINALITY AS u(s, i) ORDER BY i))",
        &[&worker, &ids, &tokens, &states],
    )
    .await
    .unwrap()
    .get(0)
}

pub async fn retry_at(c: &Client, m: &Claimed, worker: &str, delay_secs: f64) -> i32 {
    c.query_one(
        "SELECT outbox.complete_outbox_attempt($1, $2, $3, 'RETRYABLE', 'try later', \
         now() + make_interval(secs => $4))",
        &[&m.id, &m.token, &worker, &delay_secs],
    )
    .await
    .unwrap()
    .get(0)
}

/// "attempt_no:STATE" of every attempt of `id`, in order.
pub async fn history(c: &Client, id: Uuid) -> Vec<String> {
    c.query(
        "SELECT attempt_no, state::text FROM outbox.attempts WHERE outbox_id = $1 ORDER BY attempt_no",
        &[&id],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| format!("{}:{}", r.get::<_, i32>(0), r.get::<_, String>(1)))
    .collect()
}

pub async fn expire_leases(c: &Client) {
    c.execute(
        "UPDATE outbox.messages SET lease_expires_at = now() - interval '1 minute' \
         WHERE lease_token IS NOT NULL",
        &[],
    )
    .await
    .unwrap();
}

pub async fn repair(c: &Client) -> (i32, i32) {
    let r = c
        .query_one("SELECT * FROM outbox.repair_expired_leases()", &[])
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

pub async fn enqueue_id(
    c: &Client,
    id: Uuid,
    key: Option<&str>,
) -> Result<Uuid, tokio_postgres::Error> {
    c.query_one(
        "SELECT outbox.enqueue('t', '{}'::jsonb, $2, p_outbox_id => $1)",
        &[&id, &key],
    )
    .await
    .map(|r| r.get(0))
}

/// Claims `n` with the payloads read as text: (key, payload) in the order returned.
pub async fn claim_texts(c: &Client, n: i32) -> Vec<(Option<String>, String, Uuid, Uuid)> {
    c.query(
        "SELECT message_key, convert_from(payload, 'UTF8'), outbox_id, lease_token \
         FROM outbox.claim_outbox_batch_seq($1, 'w', 30)",
        &[&n],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

/// Reports one state per claimed message, in one completion.
pub async fn complete_all(
    c: &Client,
    claimed: &[(Option<String>, String, Uuid, Uuid)],
    states: &[&str],
) {
    let ids: Vec<Uuid> = claimed.iter().map(|m| m.2).collect();
    let tokens: Vec<Uuid> = claimed.iter().map(|m| m.3).collect();
    let states: Vec<String> = states.iter().map(|s| (*s).to_owned()).collect();
    c.query(
        "SELECT * FROM outbox.complete_outbox_batch('w', $1, $2, $3::text[]::outbox.attempt_state[], NULL, \
         (SELECT array_agg(CASE WHEN s = 'RETRYABLE' THEN now() + interval '1 hour' END) FROM unnest($3::text[]) AS s))",
        &[&ids, &tokens, &states],
    )
    .await
    .unwrap();
}

/// The payloads of `key` in a claim, as numbers, in the order returned.
pub fn run_of(claimed: &[(Option<String>, String, Uuid, Uuid)], key: &str) -> Vec<i32> {
    claimed
        .iter()
        .filter(|m| m.0.as_deref() == Some(key))
        .map(|m| m.1.parse().unwrap())
        .collect()
}

/// A producer that enqueued a message of `key` in an open transaction and ran its
/// commit-time check (SET CONSTRAINTS ALL IMMEDIATE), which holds the message before it
/// FOR KEY SHARE until the transaction ends; with the new message's id.
pub async fn producer_committing_behind(db: &TestDb, key: &str) -> (Client, Uuid) {
    let p = db.client().await;
    p.batch_execute("BEGIN").await.unwrap();
    let id = enqueue(&p, "t", Some(key)).await;
    p.batch_execute("SET CONSTRAINTS ALL IMMEDIATE")
        .await
        .unwrap();
    (p, id)
}

/// The backend pid of a session, to watch it from another ([`waits_for_a_lock`]).
pub async fn backend_pid(c: &Client) -> i32 {
    c.query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

/// Whether the session `pid` is waiting for a lock now, as `observer` sees it.
pub async fn waits_for_a_lock(observer: &Client, pid: i32) -> bool {
    observer
        .query_opt(
            "SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'",
            &[&pid],
        )
        .await
        .unwrap()
        .is_some()
}

/// Waits, up to a minute, for the session `pid` to wait for a lock.
pub async fn until_waiting_for_a_lock(observer: &Client, pid: i32, what: &str) {
    super::eventually(Duration::from_secs(60), what, || {
        waits_for_a_lock(observer, pid)
    })
    .await;
}

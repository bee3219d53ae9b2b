//! The test kit shared by the tests and `outbox-relay bench` (which includes this file by
//! path): filling the outbox and waiting on a condition, written once.

#![allow(dead_code)] // each user takes what it needs

use std::time::Duration;

use tokio_postgres::Client;

/// Inserts `n` messages on `topic` in one statement and returns their ids in enqueue order.
/// The payload is `{"n": i}`, padded with a `pad` field to about `payload_bytes` when that is
/// larger; with `keyed_every = Some(k)` every k-th message gets one of `keys` keys.
pub async fn fill_messages(
    c: &Client,
    topic: &str,
    n: i64,
    keyed_every: Option<i64>,
    keys: i64,
    payload_bytes: i32,
) -> Result<Vec<uuid::Uuid>, tokio_postgres::Error> {
    Ok(c.query(
        "INSERT INTO outbox.messages (topic, message_key, payload) \
         SELECT $1, CASE WHEN i % $3::bigint = 0 THEN 'k' || (i % $4::bigint) END, \
                convert_to(CASE WHEN $5::int > 0 \
                                THEN json_build_object('n', i, 'pad', repeat('x', greatest($5::int - 20 - length(i::text), 0))) \
                                ELSE json_build_object('n', i) END::text, 'UTF8') \
           FROM generate_series(1, $2::bigint) AS i RETURNING outbox_id",
        &[&topic, &n, &keyed_every, &keys, &payload_bytes],
    )
    .await?
    .iter()
    .map(|r| r.get(0))
    .collect())
}

/// Polls `check` every 50 ms until it is true; panics naming `what` after `limit`.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + limit;
    while !check().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

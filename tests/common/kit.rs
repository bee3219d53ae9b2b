//! The test kit: filling the outbox (with the library's bulk fill, which `outbox-relay bench`
//! uses too) and waiting on a condition, written once.

#![allow(dead_code)] // each user takes what it needs

use std::time::Duration;

pub use outbox_relay::store::fill_messages_returning_ids;

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

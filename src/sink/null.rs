//! The `null` sink: acknowledges everything, optionally after a fixed latency per batch.
//! It measures the relayer itself in benchmarks, and the latency stands in for a slow
//! destination.

use std::time::Duration;

use futures_util::future::BoxFuture;

use super::Sink;
use crate::message::{ClaimedMessage, Outcome};

pub struct Null {
    latency: Duration,
}

impl Null {
    pub fn new(latency: Duration) -> Self {
        Self { latency }
    }
}

impl Sink for Null {
    fn name(&self) -> &'static str {
        "null"
    }

    fn publish<'a>(&'a self, batch: &'a [ClaimedMessage]) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            if !self.latency.is_zero() {
                tokio::time::sleep(self.latency).await;
            }
            vec![Outcome::Delivered; batch.len()]
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

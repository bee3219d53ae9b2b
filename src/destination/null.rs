//! The `null` destination: acknowledges everything, optionally after a fixed latency per batch.
//! It measures the relayer itself in benchmarks, and the latency stands in for a slow
//! destination.

use std::time::Duration;

use futures_util::future::BoxFuture;

use super::{Destination, Setting, Window};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};

/// `type = "null"`: `latency_ms` per batch, 0..=600000 [default: 0].
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NullConfig {
    pub latency_ms: Option<i64>,
}

impl NullConfig {
    pub(super) fn build(&self, at: Setting<'_>, _deadline: Duration) -> Result<Null, ConfigError> {
        let ms = at.ranged("latency_ms", self.latency_ms, 0, 0, 600_000)?;
        Ok(Null {
            latency: Duration::from_millis(ms.unsigned_abs()),
        })
    }
}

pub struct Null {
    latency: Duration,
}

impl Destination for Null {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            if window.check().is_err() {
                return vec![Window::closed(); batch.len()];
            }
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

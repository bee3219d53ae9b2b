//! Destinations. A sink publishes a batch and answers one [`Outcome`] per message, in batch
//! order, only after the destination acknowledged or refused it. Deciding what is retryable
//! and what is permanent belongs to the sink, which knows its destination's errors.
//!
//! A batch never holds two messages with the same key (the claim returns only the head of
//! each key), so a sink may deliver a batch's messages in any order or in parallel.

mod amqp;
mod http;
mod jsonl;
mod nats;
mod null;
mod redis;

use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::config::SinkSettings;
use crate::message::{ClaimedMessage, Outcome};

pub use amqp::Amqp;
pub use http::Http;
pub use jsonl::JsonLines;
pub use nats::Nats;
pub use null::Null;
pub use redis::RedisStreams;

/// A destination.
pub trait Sink: Send + Sync + 'static {
    /// Short name for logs, metrics and /readyz.
    fn name(&self) -> &'static str;

    /// Publishes `batch` and returns exactly one outcome per message, in the same order.
    fn publish<'a>(&'a self, batch: &'a [ClaimedMessage]) -> BoxFuture<'a, Vec<Outcome>>;

    /// Whether the destination can take messages now (for /readyz); the error says why not.
    fn ready(&self) -> BoxFuture<'_, Result<(), String>>;
}

/// A sink could not be set up; the message names the setting.
#[derive(Debug, thiserror::Error)]
#[error("cannot set up the {sink} sink: {problem}")]
pub struct SinkError {
    pub sink: &'static str,
    pub problem: String,
}

/// Builds the sink the settings name. Network destinations connect on first use.
pub fn from_settings(settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
    Ok(match settings {
        SinkSettings::Stdout => Arc::new(JsonLines::stdout()),
        SinkSettings::File { path, fsync } => Arc::new(JsonLines::file(path, *fsync)?),
        SinkSettings::Null { latency } => Arc::new(Null::new(*latency)),
        SinkSettings::Http {
            url,
            timeout,
            signing_secret,
            headers,
            concurrency,
        } => Arc::new(Http::new(
            url,
            *timeout,
            signing_secret.clone(),
            headers,
            *concurrency,
        )?),
        SinkSettings::Nats {
            url,
            subject,
            timeout,
        } => Arc::new(Nats::new(url, subject, *timeout)?),
        SinkSettings::Amqp {
            url,
            exchange,
            routing_key,
        } => Arc::new(Amqp::new(url, exchange, routing_key)?),
        SinkSettings::Redis {
            url,
            stream,
            maxlen,
            timeout,
        } => Arc::new(RedisStreams::new(url, stream, *maxlen, *timeout)?),
    })
}

/// TLS (HTTPS, AMQPS) uses rustls with the ring provider, installed once per process.
fn install_tls_provider() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        // Err means another provider is installed already, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

//! The `http` destination: one POST per message to a URL template (`{topic}` replaced),
//! with the outbox_id as `Idempotency-Key` and, when a secret is configured, signed the
//! Standard Webhooks way (`webhook-id`, `webhook-timestamp`, `webhook-signature: v1,<base64
//! HMAC-SHA256 of "id.timestamp.body">`) so receivers can verify with the existing libraries.
//! 2xx is delivered; 408, 429, 5xx and transport errors are retryable (honouring
//! `Retry-After` seconds); any other status is permanent.

use std::time::Duration;

use base64::Engine;
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use hmac::{Hmac, Mac};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use sha2::Sha256;

use super::{Sink, SinkError, install_tls_provider};
use crate::message::{ClaimedMessage, Outcome};
use crate::secret::redact_url;

pub struct Http {
    client: reqwest::Client,
    url: String,
    secret: Option<Vec<u8>>,
    headers: HeaderMap,
    concurrency: usize,
}

impl Http {
    pub fn new(
        url: &str,
        timeout: Duration,
        secret: Option<Vec<u8>>,
        headers: &[(String, String)],
        concurrency: usize,
    ) -> Result<Self, SinkError> {
        install_tls_provider();
        let problem = |p: String| SinkError {
            sink: "http",
            problem: p,
        };
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            let name = HeaderName::try_from(name.as_str())
                .map_err(|e| problem(format!("header name {name:?}: {e}")))?;
            let value = HeaderValue::try_from(value.as_str())
                .map_err(|e| problem(format!("header {name} value: {e}")))?;
            map.insert(name, value);
        }
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .pool_max_idle_per_host(concurrency)
            .build()
            .map_err(|e| problem(e.to_string()))?;
        Ok(Self {
            client,
            url: url.to_owned(),
            secret,
            headers: map,
            concurrency,
        })
    }

    async fn send(&self, m: &ClaimedMessage) -> Outcome {
        let id = m.id.to_string();
        let mut headers = self.headers.clone();
        let mut set = |name: &'static str, value: &str| {
            if let Ok(v) = HeaderValue::try_from(value) {
                headers.insert(name, v);
            }
        };
        set("content-type", &m.content_type);
        set("idempotency-key", &id);
        set("outbox-topic", &m.topic);
        set("outbox-attempt", &m.attempt_no.to_string());
        if let Some(key) = &m.key {
            set("outbox-key", key);
        }
        if let Some(secret) = &self.secret {
            let timestamp = chrono::Utc::now().timestamp().to_string();
            set("webhook-id", &id);
            set("webhook-timestamp", &timestamp);
            set(
                "webhook-signature",
                &format!("v1,{}", sign(secret, &id, &timestamp, &m.payload)),
            );
        }
        let url = self.url.replace("{topic}", &m.topic);
        let response = self
            .client
            .post(&url)
            .headers(headers)
            .body(m.payload.clone())
            .send()
            .await;
        match response {
            Err(e) => Outcome::Retryable {
                reason: format!("POST {}: {}", redact_url(&url), e.without_url()),
                retry_after: None,
            },
            Ok(r) => {
                let status = r.status();
                if status.is_success() {
                    return Outcome::Delivered;
                }
                let retry_after = r
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(Duration::from_secs);
                let body: String = r
                    .text()
                    .await
                    .unwrap_or_default()
                    .chars()
                    .take(200)
                    .collect();
                let reason = format!("POST {}: HTTP {status} {body}", redact_url(&url))
                    .trim_end()
                    .to_owned();
                if status.as_u16() == 408 || status.as_u16() == 429 || status.is_server_error() {
                    Outcome::Retryable {
                        reason,
                        retry_after,
                    }
                } else {
                    Outcome::Permanent { reason }
                }
            }
        }
    }
}

/// base64(HMAC-SHA256(secret, "id.timestamp.body")), the Standard Webhooks `v1` signature.
fn sign(secret: &[u8], id: &str, timestamp: &str, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
}

impl Sink for Http {
    fn name(&self) -> &'static str {
        "http"
    }

    fn publish<'a>(&'a self, batch: &'a [ClaimedMessage]) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(
            futures_util::stream::iter(batch)
                .map(|m| self.send(m))
                .buffered(self.concurrency)
                .collect(),
        )
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

//! The `redis` destination: `XADD` to a stream per topic (`{topic}` in the stream name
//! template), fields `outbox_id`, `topic`, `key`, `seq` (keyed messages only), `attempt`,
//! `content_type`, `headers`, `payload`, optionally trimmed with `MAXLEN ~`. A batch is one pipeline whose replies are
//! read one per entry: a message is delivered when Redis answered its entry id, and an entry
//! Redis refuses (a key of another type, say) fails only its own message. Streams do not
//! deduplicate: consumers dedupe on the `outbox_id` field.

use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::aio::MultiplexedConnection;

use super::{Destination, Setting, Window};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};
use crate::secret::redact_url;

/// `type = "redis"`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://` or `rediss://` [default: redis://127.0.0.1:6379].
    pub url: Option<String>,
    /// Stream name template [default: `outbox:{topic}`].
    pub stream: Option<String>,
    /// Trim each stream to about this many entries, 1.. [default: no trimming].
    pub maxlen: Option<i64>,
}

impl RedisConfig {
    pub(super) fn build(
        &self,
        at: Setting<'_>,
        deadline: Duration,
    ) -> Result<RedisStreams, ConfigError> {
        let url = self.url.as_deref().unwrap_or("redis://127.0.0.1:6379");
        let client = redis::Client::open(url)
            .map_err(|e| at.invalid("url", format!("{:?}: {e}", redact_url(url))))?;
        let maxlen = self
            .maxlen
            .map(|n| at.ranged("maxlen", Some(n), 0, 1, i64::MAX))
            .transpose()?;
        Ok(RedisStreams {
            client,
            connection: tokio::sync::Mutex::new(None),
            stream: self
                .stream
                .clone()
                .unwrap_or_else(|| "outbox:{topic}".to_owned()),
            maxlen,
            timeout: deadline,
        })
    }
}

pub struct RedisStreams {
    client: redis::Client,
    connection: tokio::sync::Mutex<Option<MultiplexedConnection>>,
    stream: String,
    maxlen: Option<i64>,
    timeout: Duration,
}

impl RedisStreams {
    async fn connection(&self) -> Result<MultiplexedConnection, String> {
        let mut slot = self.connection.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        let c = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| format!("redis connect: {e}"))?;
        *slot = Some(c.clone());
        Ok(c)
    }

    async fn forget_connection(&self) {
        *self.connection.lock().await = None;
    }
}

/// What Redis's refusal of one entry means: the server is busy or failing over (retry), or
/// the entry can never be written as it is (permanent).
fn refused(e: &redis::RedisError) -> Outcome {
    const TRANSIENT: [&str; 8] = [
        "LOADING",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "MASTERDOWN",
        "READONLY",
        "OOM",
        "BUSY",
        "NOREPLICAS",
    ];
    if e.code().is_some_and(|c| TRANSIENT.contains(&c)) {
        Outcome::Retryable {
            reason: format!("redis XADD: {e}"),
            retry_after: None,
        }
    } else {
        Outcome::Permanent {
            reason: format!("redis XADD refused: {e}"),
        }
    }
}

impl Destination for RedisStreams {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let retry = |reason: String| {
                vec![
                    Outcome::Retryable {
                        reason,
                        retry_after: None
                    };
                    batch.len()
                ]
            };
            let mut connection = match self.connection().await {
                Ok(c) => c,
                Err(reason) => return retry(reason),
            };
            let mut pipe = redis::pipe();
            // Each reply on its own: one refused entry must not fail the others.
            pipe.ignore_errors();
            for m in batch {
                let cmd = pipe
                    .cmd("XADD")
                    .arg(self.stream.replace("{topic}", &m.topic));
                if let Some(n) = self.maxlen {
                    cmd.arg("MAXLEN").arg("~").arg(n);
                }
                cmd.arg("*")
                    .arg("outbox_id")
                    .arg(m.id.to_string())
                    .arg("topic")
                    .arg(&m.topic)
                    .arg("key")
                    .arg(m.key.as_deref().unwrap_or(""));
                if m.key.is_some() {
                    cmd.arg("seq").arg(m.seq);
                }
                cmd.arg("attempt")
                    .arg(m.attempt_no)
                    .arg("content_type")
                    .arg(&m.content_type)
                    .arg("headers")
                    .arg(m.headers.to_string())
                    .arg("payload")
                    .arg(&m.payload[..]);
            }
            // The batch is one pipeline, one call: checked once, as it is sent (connecting
            // may have taken a while).
            if window.check().is_err() {
                return vec![Window::closed(); batch.len()];
            }
            match pipe
                .query_async::<Vec<redis::RedisResult<String>>>(&mut connection)
                .await
            {
                Ok(replies) if replies.len() == batch.len() => replies
                    .iter()
                    .map(|r| match r {
                        Ok(_) => Outcome::Delivered,
                        Err(e) => refused(e),
                    })
                    .collect(),
                Ok(replies) => retry(format!(
                    "redis answered {} replies for {} entries",
                    replies.len(),
                    batch.len()
                )),
                Err(e) => {
                    self.forget_connection().await;
                    retry(format!("redis XADD: {e}"))
                }
            }
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let mut c = self.connection().await?;
            redis::cmd("PING")
                .query_async::<String>(&mut c)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    }
}

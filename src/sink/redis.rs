//! The `redis` destination: `XADD` to a stream per topic (`{topic}` in the stream name
//! template), fields `outbox_id`, `topic`, `key`, `attempt`, `content_type`, `headers`,
//! `payload`, optionally trimmed with `MAXLEN ~`. A batch is one pipeline; a message is
//! delivered when Redis answered its entry id. Streams do not deduplicate: consumers
//! dedupe on the `outbox_id` field.

use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::aio::MultiplexedConnection;

use super::{Sink, SinkError};
use crate::message::{ClaimedMessage, Outcome};

pub struct RedisStreams {
    client: redis::Client,
    connection: tokio::sync::Mutex<Option<MultiplexedConnection>>,
    stream: String,
    maxlen: Option<usize>,
    timeout: Duration,
}

impl RedisStreams {
    pub fn new(
        url: &str,
        stream: &str,
        maxlen: Option<usize>,
        timeout: Duration,
    ) -> Result<Self, SinkError> {
        let client = redis::Client::open(url).map_err(|e| SinkError {
            sink: "redis",
            problem: format!("url: {e}"),
        })?;
        Ok(Self {
            client,
            connection: tokio::sync::Mutex::new(None),
            stream: stream.to_owned(),
            maxlen,
            timeout,
        })
    }

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

impl Sink for RedisStreams {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn publish<'a>(&'a self, batch: &'a [ClaimedMessage]) -> BoxFuture<'a, Vec<Outcome>> {
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
                    .arg(m.key.as_deref().unwrap_or(""))
                    .arg("attempt")
                    .arg(m.attempt_no)
                    .arg("content_type")
                    .arg(&m.content_type)
                    .arg("headers")
                    .arg(m.headers.to_string())
                    .arg("payload")
                    .arg(&m.payload[..]);
            }
            match pipe.query_async::<Vec<String>>(&mut connection).await {
                Ok(ids) if ids.len() == batch.len() => vec![Outcome::Delivered; batch.len()],
                Ok(ids) => retry(format!(
                    "redis answered {} entry ids for {} messages",
                    ids.len(),
                    batch.len()
                )),
                Err(e)
                    if e.kind()
                        == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError)
                        || e.is_unrecoverable_error() && !e.is_io_error() =>
                {
                    vec![
                        Outcome::Permanent {
                            reason: format!("redis XADD refused: {e}")
                        };
                        batch.len()
                    ]
                }
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

//! The `enqueue` verb: its arguments and how they become a [`NewMessage`] (the payload
//! inline, from a file or from standard input, so its size is bounded by the database, not
//! by the argument list; headers, content type, delay, the producer's own id and its trace
//! context), enqueued with its outbox_id printed.

use std::io::Read;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use outbox_relay::message::{NewMessage, OutboxId, Payload, TraceContext};
use outbox_relay::store::Store;

/// Enqueues `message`; prints its outbox_id.
pub async fn run(store: &Store, message: &NewMessage) -> Result<()> {
    let id = store.enqueue(message).await.context("enqueue")?;
    outln!("{id}");
    Ok(())
}

#[derive(clap::Args)]
pub struct Args {
    /// The message's topic (`orders.created`): routes choose its destination by it.
    #[arg(long)]
    topic: String,
    /// Messages with the same key are delivered one at a time, in order.
    #[arg(long)]
    key: Option<String>,
    /// The payload, inline.
    #[arg(long, required_unless_present = "payload_file")]
    payload: Option<String>,
    /// Read the payload from this file, or from standard input with `-`.
    #[arg(long, value_name = "PATH", conflicts_with = "payload")]
    payload_file: Option<PathBuf>,
    /// The payload's content type. A JSON type (application/json, …+json) is checked
    /// here; application/json is stored as JSON, anything else as the bytes given.
    #[arg(long, default_value = "application/json")]
    content_type: String,
    /// A header for the destination, NAME=VALUE (repeatable).
    #[arg(long = "header", value_name = "NAME=VALUE")]
    headers: Vec<String>,
    /// Deliver no sooner than this long from now (by this machine's clock): 250ms, 30s,
    /// 5m, 2h, 1day.
    #[arg(long, value_parser = humantime::parse_duration)]
    delay: Option<std::time::Duration>,
    /// The message's own outbox_id [default: a new UUIDv7].
    #[arg(long)]
    id: Option<uuid::Uuid>,
    /// Attempts before the message is dead-lettered [default: 10].
    #[arg(long)]
    max_attempts: Option<i32>,
    /// The message's creation context, a W3C traceparent
    /// (00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>); sent as the header
    /// traceparent, in place of a --header traceparent=…
    #[arg(long, value_name = "TRACEPARENT")]
    traceparent: Option<String>,
    /// The W3C tracestate of --traceparent (key=value,…).
    #[arg(long, value_name = "TRACESTATE", requires = "traceparent")]
    tracestate: Option<String>,
}

impl Args {
    /// The message these arguments describe; reads the payload file or standard input.
    pub fn message(&self) -> Result<NewMessage> {
        let bytes = match (&self.payload, &self.payload_file) {
            (Some(inline), _) => inline.clone().into_bytes(),
            (None, Some(path)) if path.as_os_str() == "-" => {
                let mut bytes = Vec::new();
                std::io::stdin()
                    .read_to_end(&mut bytes)
                    .context("read the payload from standard input")?;
                bytes
            }
            (None, Some(path)) => std::fs::read(path)
                .with_context(|| format!("read the payload from {}", path.display()))?,
            (None, None) => bail!("give --payload or --payload-file"),
        };
        let essence = self
            .content_type
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        let json = essence == "application/json" || essence.ends_with("+json");
        let payload = if json {
            let value: serde_json::Value = serde_json::from_slice(&bytes).with_context(|| {
                format!(
                    "the payload is not valid JSON (content type {}); give another --content-type for other data",
                    self.content_type
                )
            })?;
            if essence == "application/json" {
                Payload::Json(value)
            } else {
                Payload::Bytes {
                    data: bytes,
                    content_type: self.content_type.clone(),
                }
            }
        } else {
            Payload::Bytes {
                data: bytes,
                content_type: self.content_type.clone(),
            }
        };
        let mut headers = serde_json::Map::new();
        for header in &self.headers {
            match header.split_once('=') {
                Some((name, value)) if !name.trim().is_empty() => {
                    headers.insert(name.trim().to_owned(), value.into());
                }
                _ => bail!("--header {header:?}: expected NAME=VALUE"),
            }
        }
        let available_at = self
            .delay
            .map(|d| chrono::Duration::from_std(d).map(|d| chrono::Utc::now() + d))
            .transpose()
            .context("--delay is too long")?;
        Ok(NewMessage {
            topic: self.topic.clone(),
            key: self.key.clone(),
            payload,
            headers: (!headers.is_empty()).then_some(serde_json::Value::Object(headers)),
            available_at,
            id: self.id.map(OutboxId),
            max_attempts: self.max_attempts,
            // Checked by outbox.enqueue, whose refusal names the argument and the value.
            trace: self.traceparent.as_ref().map(|traceparent| TraceContext {
                traceparent: traceparent.clone(),
                tracestate: self.tracestate.clone(),
            }),
        })
    }
}

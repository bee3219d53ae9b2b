//! The `stdout` and `file` destinations: one JSON object per line per message. A message is
//! reported delivered once its line is written (and, for a file with fsync on, synced to
//! disk). A payload whose content type says JSON but that does not parse is refused for
//! good: writing it would hand every reader a broken line.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde::Serialize;
use serde_json::value::RawValue;

use super::{Destination, Setting, Window};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};

/// `type = "stdout"`: no settings.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StdoutConfig {}

impl StdoutConfig {
    pub(super) fn build(
        &self,
        _at: Setting<'_>,
        _deadline: Duration,
    ) -> Result<JsonLines, ConfigError> {
        Ok(JsonLines {
            name: "stdout",
            target: Arc::new(Target::Stdout),
        })
    }
}

/// `type = "file"`: append to `path` (created if missing), fsync after every batch unless
/// `fsync = false`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub path: PathBuf,
    pub fsync: Option<bool>,
}

impl FileConfig {
    pub(super) fn build(
        &self,
        at: Setting<'_>,
        _deadline: Duration,
    ) -> Result<JsonLines, ConfigError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map_err(|e| {
                at.invalid(
                    "path",
                    format!(
                        "{} cannot be opened for appending: {e}",
                        self.path.display()
                    ),
                )
            })?;
        Ok(JsonLines {
            name: "file",
            target: Arc::new(Target::File {
                path: self.path.clone(),
                file: Mutex::new(file),
                fsync: self.fsync.unwrap_or(true),
            }),
        })
    }
}

enum Target {
    Stdout,
    File {
        path: PathBuf,
        file: Mutex<File>,
        fsync: bool,
    },
}

pub struct JsonLines {
    name: &'static str,
    target: Arc<Target>,
}

/// One output line.
#[derive(Serialize)]
struct Line<'a> {
    outbox_id: String,
    topic: &'a str,
    key: Option<&'a str>,
    /// The per-key sequence; `None` (null) for an unkeyed message.
    seq: Option<i64>,
    attempt_no: i32,
    created_at: chrono::DateTime<chrono::Utc>,
    content_type: &'a str,
    headers: &'a serde_json::Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_text: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_hex: Option<String>,
}

fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json") || essence.ends_with("+json")
}

/// Appends `message`'s line to `out`, or says why it cannot be delivered.
fn render(message: &ClaimedMessage, out: &mut Vec<u8>) -> Result<(), String> {
    let mut line = Line {
        outbox_id: message.id.to_string(),
        topic: &message.topic,
        key: message.key.as_deref(),
        seq: message.key.as_ref().map(|_| message.seq),
        attempt_no: message.attempt_no,
        created_at: message.created_at,
        content_type: &message.content_type,
        headers: &message.headers,
        payload: None,
        payload_text: None,
        payload_hex: None,
    };
    if is_json(&message.content_type) {
        let raw: &RawValue = serde_json::from_slice(&message.payload).map_err(|e| {
            format!(
                "payload is not valid JSON (content type {}): {e}",
                message.content_type
            )
        })?;
        line.payload = Some(raw);
    } else if let Ok(text) = std::str::from_utf8(&message.payload) {
        line.payload_text = Some(text);
    } else {
        line.payload_hex = Some(message.payload.iter().map(|b| format!("{b:02x}")).collect());
    }
    serde_json::to_writer(&mut *out, &line).map_err(|e| format!("cannot encode line: {e}"))?;
    out.push(b'\n');
    Ok(())
}

/// `message` as the JSON object of its line, without the newline (the record of the
/// `kinesis` destination and the detail of `eventbridge`'s event), or why it cannot be sent.
#[cfg_attr(not(feature = "aws"), allow(dead_code))]
pub(super) fn envelope(message: &ClaimedMessage) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(message.payload.len() + 256);
    render(message, &mut out)?;
    out.pop();
    Ok(out)
}

/// Writes the whole buffer with one call per batch, so lines of concurrent batches (and of
/// other processes appending to the same file) never interleave within a batch.
fn write_batch(target: &Target, buf: &[u8]) -> std::io::Result<()> {
    match target {
        Target::Stdout => {
            let mut out = std::io::stdout().lock();
            out.write_all(buf)?;
            out.flush()
        }
        Target::File { file, fsync, .. } => {
            let mut file = file
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            file.write_all(buf)?;
            if *fsync {
                file.sync_data()?;
            }
            Ok(())
        }
    }
}

impl Destination for JsonLines {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let mut buf = Vec::with_capacity(batch.len() * 512);
            let mut outcomes: Vec<Option<Outcome>> = batch
                .iter()
                .map(|m| {
                    render(m, &mut buf)
                        .err()
                        .map(|reason| Outcome::Permanent { reason })
                })
                .collect();
            // The batch is one write, one call: checked once, before it.
            if window.check().is_err() {
                return vec![Window::closed(); batch.len()];
            }
            if !buf.is_empty() {
                let target = self.target.clone();
                let written = tokio::task::spawn_blocking(move || write_batch(&target, &buf))
                    .await
                    .map_err(|e| std::io::Error::other(e.to_string()))
                    .and_then(|r| r);
                let delivered = match written {
                    Ok(()) => Outcome::Delivered,
                    Err(e) => Outcome::Retryable {
                        reason: format!("{} write failed: {e}", self.name),
                        retry_after: None,
                    },
                };
                for o in outcomes.iter_mut().filter(|o| o.is_none()) {
                    *o = Some(delivered.clone());
                }
            }
            // Every message has an outcome now: its render error or the write's result.
            outcomes.into_iter().flatten().collect()
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            match &*self.target {
                Target::Stdout => Ok(()),
                Target::File { path, .. } => std::fs::metadata(path)
                    .map(|_| ())
                    .map_err(|e| format!("{}: {e}", path.display())),
            }
        })
    }
}

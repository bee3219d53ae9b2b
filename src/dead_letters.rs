//! The `dead-letters` verb: what an on-call engineer asks of the dead letters before
//! replaying them: how many match, which ones, and one in full (payload as pretty JSON,
//! text or a hex dump; headers; every attempt with its error).

use anyhow::{Context, Result, bail};
use chrono::{DateTime, Utc};
use outbox_relay::message::OutboxId;
use outbox_relay::store::{AttemptRecord, DeadLetter, DeadLetterFilter, Store};

#[derive(clap::Subcommand)]
pub enum Verb {
    /// The dead letters matching the filters, newest first.
    List {
        #[command(flatten)]
        filter: Filter,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// One dead letter: payload, headers and every attempt with its error.
    Show {
        id: uuid::Uuid,
        /// As one JSON object (the payload as JSON when it is, else as text or hex).
        #[arg(long)]
        json: bool,
    },
    /// How many dead letters match the filters.
    Count {
        #[command(flatten)]
        filter: Filter,
    },
}

#[derive(clap::Args)]
pub struct Filter {
    /// Only this topic.
    #[arg(long)]
    topic: Option<String>,
    /// Dead-lettered within this long (`2h`, `1day`) or since this time (RFC 3339).
    #[arg(long, value_parser = since)]
    since: Option<DateTime<Utc>>,
    /// The last error contains this text (any case).
    #[arg(long)]
    error_contains: Option<String>,
}

impl Filter {
    pub fn store_filter(&self) -> DeadLetterFilter {
        DeadLetterFilter {
            ids: None,
            topic: self.topic.clone(),
            since: self.since,
            error_contains: self.error_contains.clone(),
        }
    }
}

fn since(text: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(ago) = humantime::parse_duration(text) {
        let ago = chrono::Duration::from_std(ago).map_err(|e| e.to_string())?;
        return Ok(Utc::now() - ago);
    }
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| format!("{text:?} is neither a duration (2h, 1day) nor an RFC 3339 time"))
}

pub async fn run(store: &Store, verb: &Verb) -> Result<()> {
    match verb {
        Verb::List {
            filter,
            limit,
            json,
        } => {
            let rows = store
                .dead_letters(&filter.store_filter(), *limit)
                .await
                .context("list dead letters")?;
            for d in &rows {
                if *json {
                    outln!("{}", serde_json::to_string(d)?);
                } else {
                    outln!(
                        "{}  {}  {}  {}/{} attempts  {}",
                        d.outbox_id,
                        d.dead_lettered_at.format("%Y-%m-%d %H:%M:%S"),
                        d.topic,
                        d.attempt_count,
                        d.max_attempts,
                        one_line(d.last_error.as_deref().unwrap_or("-"), 120)
                    );
                }
            }
            Ok(())
        }
        Verb::Count { filter } => {
            let n = store
                .dead_letter_count(&filter.store_filter())
                .await
                .context("count dead letters")?;
            outln!("{n}");
            Ok(())
        }
        Verb::Show { id, json } => {
            let Some((d, attempts)) = store
                .dead_letter(OutboxId(*id))
                .await
                .context("show dead letter")?
            else {
                bail!("no dead letter {id}");
            };
            if *json {
                let mut value = serde_json::to_value(&d)?;
                value["payload"] = payload_json(&d);
                value["attempts"] = serde_json::to_value(&attempts)?;
                outln!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                out!("{}", render(&d, &attempts));
            }
            Ok(())
        }
    }
}

/// `text` on one line, cut to `max` characters.
pub fn one_line(text: &str, max: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &flat[..at]),
        None => flat,
    }
}

fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json")
        || essence.to_ascii_lowercase().ends_with("+json")
}

/// The payload for `show --json`: the document itself when it is JSON, else the text, else
/// `{"hex": …}`.
fn payload_json(d: &DeadLetter) -> serde_json::Value {
    if is_json(&d.content_type)
        && let Ok(v) = serde_json::from_slice(&d.payload)
    {
        return v;
    }
    match std::str::from_utf8(&d.payload) {
        Ok(text) => text.into(),
        Err(_) => {
            serde_json::json!({ "hex": d.payload.iter().map(|b| format!("{b:02x}")).collect::<String>() })
        }
    }
}

fn render(d: &DeadLetter, attempts: &[AttemptRecord]) -> String {
    let mut out = String::new();
    let mut line = |k: &str, v: &str| out.push_str(&format!("{k:<14}{v}\n"));
    line("outbox_id", &d.outbox_id.to_string());
    line("topic", &d.topic);
    line("key", d.message_key.as_deref().unwrap_or("-"));
    line("content type", &d.content_type);
    line("created", &d.created_at.to_rfc3339());
    line(
        "dead-lettered",
        &format!(
            "{} after {} of {} attempts",
            d.dead_lettered_at.to_rfc3339(),
            d.attempt_count,
            d.max_attempts
        ),
    );
    line("last error", d.last_error.as_deref().unwrap_or("-"));
    line("headers", &d.headers.to_string());
    out.push_str(&format!("payload ({} bytes)\n", d.payload_bytes));
    let payload = if is_json(&d.content_type)
        && let Ok(v) = serde_json::from_slice::<serde_json::Value>(&d.payload)
    {
        serde_json::to_string_pretty(&v).unwrap_or_default()
    } else if let Ok(text) = std::str::from_utf8(&d.payload) {
        text.to_owned()
    } else {
        hex_dump(&d.payload)
    };
    for l in payload.lines() {
        out.push_str(&format!("  {l}\n"));
    }
    out.push_str("attempts\n");
    for a in attempts {
        out.push_str(&format!(
            "  {:>3}  {}  {:<14}  {}  {}\n",
            a.attempt_no,
            a.created_at.format("%Y-%m-%d %H:%M:%S%.3f"),
            a.state,
            a.worker_id,
            a.error.as_deref().unwrap_or("")
        ));
    }
    out
}

/// Offset, 16 bytes in hex, and their printable characters.
fn hex_dump(bytes: &[u8]) -> String {
    bytes
        .chunks(16)
        .enumerate()
        .map(|(i, chunk)| {
            let hex: Vec<String> = chunk.iter().map(|b| format!("{b:02x}")).collect();
            let text: String = chunk
                .iter()
                .map(|&b| {
                    if b.is_ascii_graphic() || b == b' ' {
                        b as char
                    } else {
                        '.'
                    }
                })
                .collect();
            format!("{:08x}  {:<47}  {text}\n", i * 16, hex.join(" "))
        })
        .collect()
}

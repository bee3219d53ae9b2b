//! The `dead-letters` verb: what an on-call engineer asks of the dead letters before
//! replaying them: how many match, which ones, and one in full (payload as pretty JSON,
//! text or a hex dump; headers; every attempt with its error); of one outbox, or with
//! `--all-sources` of every source of a many-source configuration, each with its source.

use std::pin::pin;

use anyhow::{Context, Result, bail};
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use outbox_relay::message::OutboxId;
use outbox_relay::sources::SourcesSettings;
use outbox_relay::store::{AttemptRecord, DeadLetter, DeadLetterFilter, Store};

use crate::all_sources::{self, Failed};

/// Sources read at once by `--all-sources` (as `status --all-sources` reads them).
const READ_AT_ONCE: usize = 8;

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
        /// Every source of a many-source configuration, read 8 at a time: the newest
        /// --limit of them all, each line starting with its source (with --json, a
        /// `source` field); exits non-zero naming the sources that could not be read.
        #[arg(long)]
        all_sources: bool,
    },
    /// One dead letter: payload, headers and every attempt with its error.
    Show {
        id: uuid::Uuid,
        /// As one JSON object (the payload as JSON when it is, else as text or hex).
        #[arg(long)]
        json: bool,
        /// Look for it in every source of a many-source configuration, read 8 at a time,
        /// and show it with the source that holds it.
        #[arg(long)]
        all_sources: bool,
    },
    /// How many dead letters match the filters.
    Count {
        #[command(flatten)]
        filter: Filter,
        /// Every source of a many-source configuration, read 8 at a time: a line per
        /// source (`NAME: N`), then `all sources: N`; exits non-zero naming the sources
        /// that could not be read.
        #[arg(long)]
        all_sources: bool,
    },
}

impl Verb {
    /// Whether `--all-sources` was given.
    pub fn all_sources(&self) -> bool {
        match self {
            Verb::List { all_sources, .. }
            | Verb::Show { all_sources, .. }
            | Verb::Count { all_sources, .. } => *all_sources,
        }
    }
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
            ..
        } => {
            let rows = store
                .dead_letters(&filter.store_filter(), *limit)
                .await
                .context("list dead letters")?;
            for d in &rows {
                if *json {
                    outln!("{}", serde_json::to_string(d)?);
                } else {
                    outln!("{}", list_line(d));
                }
            }
            Ok(())
        }
        Verb::Count { filter, .. } => {
            let n = store
                .dead_letter_count(&filter.store_filter())
                .await
                .context("count dead letters")?;
            outln!("{n}");
            Ok(())
        }
        Verb::Show { id, json, .. } => {
            let Some((d, attempts)) = store
                .dead_letter(OutboxId(*id))
                .await
                .context("show dead letter")?
            else {
                bail!("no dead letter {id}");
            };
            show(None, &d, &attempts, *json)
        }
    }
}

/// The verb on every source (`--all-sources`), 8 at a time; after trying them all, an
/// error naming the sources that could not be read.
pub async fn run_all(settings: &SourcesSettings, verb: &Verb) -> Result<()> {
    let sources = all_sources::all(settings).await?;
    let total = sources.len();
    match verb {
        Verb::List {
            filter,
            limit,
            json,
            ..
        } => {
            let filter = filter.store_filter();
            let limit = *limit;
            // Each source's newest `limit`, then the newest `limit` of them all.
            let mut failed = Failed::on_stderr();
            let mut rows: Vec<(String, DeadLetter)> = Vec::new();
            let mut outcomes = pin!(all_sources::each(sources, READ_AT_ONCE, |url| {
                let filter = filter.clone();
                async move {
                    let store = all_sources::store(&url).await?;
                    store
                        .dead_letters(&filter, limit)
                        .await
                        .context("list dead letters")
                }
            }));
            while let Some((name, result)) = outcomes.next().await {
                match result {
                    Ok(found) => rows.extend(found.into_iter().map(|d| (name.clone(), d))),
                    Err(e) => failed.add(&name, &e),
                }
            }
            rows.sort_by(|(source_a, a), (source_b, b)| {
                b.dead_lettered_at
                    .cmp(&a.dead_lettered_at)
                    .then_with(|| source_a.cmp(source_b))
                    .then_with(|| a.outbox_id.cmp(&b.outbox_id))
            });
            rows.truncate(usize::try_from(limit).unwrap_or(0));
            let width = rows.iter().map(|(s, _)| s.len()).max().unwrap_or(0);
            for (source, d) in &rows {
                if *json {
                    outln!("{}", serde_json::to_string(&Sourced { source, item: d })?);
                } else {
                    outln!("{source:<width$}  {}", list_line(d));
                }
            }
            failed.check("read")
        }
        Verb::Count { filter, .. } => {
            let filter = filter.store_filter();
            let mut failed = Failed::inline();
            let mut sum: i64 = 0;
            let mut outcomes = pin!(all_sources::each(sources, READ_AT_ONCE, |url| {
                let filter = filter.clone();
                async move {
                    let store = all_sources::store(&url).await?;
                    store
                        .dead_letter_count(&filter)
                        .await
                        .context("count dead letters")
                }
            }));
            while let Some((name, result)) = outcomes.next().await {
                match result {
                    Ok(n) => {
                        outln!("{name}: {n}");
                        sum += n;
                    }
                    Err(e) => failed.add(&name, &e),
                }
            }
            match failed.count() {
                0 => outln!("all sources: {sum}"),
                n => outln!("all sources: {sum} ({n} of {total} not read)"),
            }
            failed.check("read")
        }
        Verb::Show { id, json, .. } => {
            let id = *id;
            let mut failed = Failed::on_stderr();
            let mut found = 0;
            let mut outcomes = pin!(all_sources::each(sources, READ_AT_ONCE, |url| {
                async move {
                    let store = all_sources::store(&url).await?;
                    store
                        .dead_letter(OutboxId(id))
                        .await
                        .context("show dead letter")
                }
            }));
            while let Some((name, result)) = outcomes.next().await {
                match result {
                    Ok(Some((d, attempts))) => {
                        if found > 0 && !*json {
                            outln!();
                        }
                        show(Some(&name), &d, &attempts, *json)?;
                        found += 1;
                    }
                    Ok(None) => {}
                    Err(e) => failed.add(&name, &e),
                }
            }
            if found == 0 && failed.count() == 0 {
                bail!("no dead letter {id} in any of the {total} sources");
            }
            if found == 0 {
                outln!(
                    "no dead letter {id} in the {} sources read",
                    total - failed.count()
                );
            }
            failed.check("read")
        }
    }
}

/// A row of `--all-sources --json`: the item's fields and its source.
#[derive(serde::Serialize)]
struct Sourced<'a, T: serde::Serialize> {
    source: &'a str,
    #[serde(flatten)]
    item: &'a T,
}

/// A dead letter on one line of `list`: id, when, topic, attempts, last error.
fn list_line(d: &DeadLetter) -> String {
    format!(
        "{}  {}  {}  {}/{} attempts  {}",
        d.outbox_id,
        d.dead_lettered_at.format("%Y-%m-%d %H:%M:%S"),
        d.topic,
        d.attempt_count,
        d.max_attempts,
        one_line(d.last_error.as_deref().unwrap_or("-"), 120)
    )
}

/// A dead letter in full, with the source that holds it when it is one of many.
fn show(
    source: Option<&str>,
    d: &DeadLetter,
    attempts: &[AttemptRecord],
    json: bool,
) -> Result<()> {
    if json {
        let mut value = serde_json::to_value(d)?;
        value["payload"] = payload_json(d);
        value["attempts"] = serde_json::to_value(attempts)?;
        if let Some(source) = source {
            value["source"] = source.into();
        }
        outln!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        if let Some(source) = source {
            outln!("{:<14}{source}", "source");
        }
        out!("{}", render(d, attempts));
    }
    Ok(())
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

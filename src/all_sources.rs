//! `migrate` and `status` across the sources of a many-source fleet (`--all-sources`), and
//! one source by name (`--source NAME`): the sources are found as the fleet finds them (the
//! config file's `[sources.NAME]` tables, `sources_server_url`, the catalogue query; the
//! `OUTBOX_SOURCES_*` variables), each is then handled on a session of its own.

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use futures_util::stream::{self, StreamExt};
use outbox_relay::sources::{SourcesSettings, discover};
use outbox_relay::store::{Status, Store};

/// Every source, name → connection string; an error when none is configured.
pub async fn all(settings: &SourcesSettings) -> Result<BTreeMap<String, String>> {
    if !settings.is_many() {
        bail!(
            "no sources are configured: give [sources.NAME] tables, sources_server_url, or \
             sources_catalogue_url and sources_catalogue_query in the config file (--config), \
             or OUTBOX_SOURCES_SERVER_URL, or OUTBOX_SOURCES_CATALOGUE_URL and \
             OUTBOX_SOURCES_CATALOGUE_QUERY"
        );
    }
    discover(settings)
        .await
        .map_err(|e| anyhow::anyhow!("finding the sources: {e}"))
}

/// The connection string of the source named `name`.
pub async fn one(settings: &SourcesSettings, name: &str) -> Result<String> {
    let mut sources = all(settings).await?;
    match sources.remove(name) {
        Some(url) => Ok(url),
        None => bail!(
            "no source is named {name:?}; the sources are: {}",
            sources.keys().cloned().collect::<Vec<_>>().join(", ")
        ),
    }
}

/// Migrates every source, `parallel` at a time, with a line per source; fails naming the
/// sources that could not be migrated, after trying them all.
pub async fn migrate(settings: &SourcesSettings, parallel: usize) -> Result<()> {
    let sources = all(settings).await?;
    let results: Vec<(String, Result<Vec<String>>)> = stream::iter(sources)
        .map(|(name, url)| async move {
            let applied =
                async { Store::connect(&url, 2)?.migrate().await.context("migrate") }.await;
            (name, applied)
        })
        .buffer_unordered(parallel.max(1))
        .collect()
        .await;
    let mut failed = Vec::new();
    for (name, result) in results {
        match result {
            Ok(applied) if applied.is_empty() => outln!("{name}: schema is up to date"),
            Ok(applied) => outln!("{name}: applied {} ({})", applied.len(), applied.join(", ")),
            Err(e) => {
                outln!("{name}: failed: {}", super::report(&e));
                failed.push(name);
            }
        }
    }
    if !failed.is_empty() {
        bail!(
            "{} of the sources could not be migrated: {}",
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

/// One source's line of `status --all-sources`.
#[derive(serde::Serialize)]
struct Line {
    source: String,
    /// `ok`, or why the source cannot be served.
    health: String,
    schema_version: Option<i32>,
    #[serde(flatten)]
    figures: Option<Status>,
    /// The processes serving it now (`outbox.source_holders`).
    served_by: Vec<String>,
}

async fn line(name: String, url: String) -> Line {
    let figures = async {
        let store = Store::connect(&url, 2)?;
        let version = store.check_schema().await?;
        let status = store.status().await?;
        let holders = store.source_holders().await?;
        Ok::<_, outbox_relay::store::StoreError>((version, status, holders))
    }
    .await;
    match figures {
        Ok((version, status, holders)) => Line {
            source: name,
            health: "ok".to_owned(),
            schema_version: Some(version),
            figures: Some(status),
            served_by: holders,
        },
        Err(e) => Line {
            source: name,
            health: e.to_string(),
            schema_version: None,
            figures: None,
            served_by: Vec::new(),
        },
    }
}

/// Every source: its backlog, oldest ready age, dead letters, who serves it and its health.
pub async fn status(settings: &SourcesSettings, json: bool) -> Result<()> {
    let sources = all(settings).await?;
    let lines: Vec<Line> = stream::iter(sources)
        .map(|(name, url)| line(name, url))
        .buffered(8)
        .collect()
        .await;
    if json {
        outln!("{}", serde_json::to_string_pretty(&lines)?);
        return Ok(());
    }
    let width = lines
        .iter()
        .map(|l| l.source.len())
        .max()
        .unwrap_or(6)
        .max(6);
    row(
        width,
        [
            "SOURCE",
            "READY",
            "DELAYED",
            "IN FLIGHT",
            "DEAD",
            "OLDEST",
            "SERVED BY",
        ]
        .map(str::to_owned),
        "HEALTH",
    );
    for l in &lines {
        let cells = match &l.figures {
            Some(f) => [
                l.source.clone(),
                f.ready.to_string(),
                f.delayed.to_string(),
                f.in_flight.to_string(),
                f.dead_letters.to_string(),
                f.oldest_ready_age_secs
                    .map_or("-".to_owned(), |s| format!("{s:.1}s")),
                if l.served_by.is_empty() {
                    "nobody".to_owned()
                } else {
                    l.served_by.join(",")
                },
            ],
            None => [l.source.as_str(), "-", "-", "-", "-", "-", "-"].map(str::to_owned),
        };
        row(width, cells, &l.health);
    }
    let down = lines.iter().filter(|l| l.figures.is_none()).count();
    if down > 0 {
        outln!("{down} of {} sources cannot be read", lines.len());
    }
    Ok(())
}

/// One line of the `status --all-sources` table.
fn row(
    width: usize,
    [source, ready, delayed, in_flight, dead, oldest, served_by]: [String; 7],
    health: &str,
) {
    outln!(
        "{source:<width$}  {ready:>8} {delayed:>8} {in_flight:>9} {dead:>7} {oldest:>10}  {served_by:<20} {health}"
    );
}

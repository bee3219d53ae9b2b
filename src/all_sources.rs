//! The operator verbs across the sources of a many-source fleet (`--all-sources`: `migrate`,
//! `status` and `repair` here; `dead-letters` and `replay` in their own modules, with the
//! helpers below), and one source by name (`--source NAME`): the sources are found as the
//! fleet finds them (the config file's `[sources.NAME]` tables, `sources_server_url`, the
//! catalogue query; the `OUTBOX_SOURCES_*` variables), each is then handled on a session of
//! its own. A source that fails is named with its cause, the others are tried all the same,
//! and the verb then exits 2 naming the sources that failed.

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use futures_util::stream::{self, Stream, StreamExt};
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

/// A source's store for a verb, once its schema is what this build needs.
pub async fn store(url: &str) -> Result<Store> {
    let store = Store::connect(url, 2)?;
    store.check_schema().await?;
    Ok(store)
}

/// `work` on every source of `sources`, at most `parallel` at a time; the outcomes come
/// in the sources' name order, each as soon as it and those before it are done.
pub fn each<T, W, F>(
    sources: BTreeMap<String, String>,
    parallel: usize,
    work: W,
) -> impl Stream<Item = (String, Result<T>)>
where
    W: Fn(String) -> F,
    F: Future<Output = Result<T>>,
{
    stream::iter(sources)
        .map(move |(name, url)| {
            let done = work(url);
            async move { (name, done.await) }
        })
        .buffered(parallel.max(1))
}

/// The sources a verb could not handle, each named with its cause as it fails.
pub struct Failed {
    names: Vec<String>,
    /// The cause goes to standard error rather than among the verb's output (whose lines
    /// are not a line per source, such as `dead-letters list`).
    on_stderr: bool,
}

impl Failed {
    /// Each cause printed `NAME: failed: …` among the verb's lines.
    pub fn inline() -> Failed {
        Failed {
            names: Vec::new(),
            on_stderr: false,
        }
    }

    /// Each cause printed `NAME: failed: …` on standard error.
    pub fn on_stderr() -> Failed {
        Failed {
            names: Vec::new(),
            on_stderr: true,
        }
    }

    pub fn add(&mut self, name: &str, e: &anyhow::Error) {
        if self.on_stderr {
            eprintln!("{name}: failed: {}", super::report(e));
        } else {
            outln!("{name}: failed: {}", super::report(e));
        }
        self.names.push(name.to_owned());
    }

    pub fn count(&self) -> usize {
        self.names.len()
    }

    /// An error naming the sources that failed, `what` saying what was not done to them
    /// (`migrated`, `read`), when any did.
    pub fn check(self, what: &str) -> Result<()> {
        if !self.names.is_empty() {
            bail!(
                "{} of the sources could not be {what}: {}",
                self.names.len(),
                self.names.join(", ")
            );
        }
        Ok(())
    }
}

/// Migrates every source, `parallel` at a time, with a line per source; fails naming the
/// sources that could not be migrated, after trying them all.
pub async fn migrate(settings: &SourcesSettings, parallel: usize) -> Result<()> {
    let sources = all(settings).await?;
    let mut failed = Failed::inline();
    let mut outcomes = std::pin::pin!(each(sources, parallel, |url| async move {
        Store::connect(&url, 2)?.migrate().await.context("migrate")
    }));
    while let Some((name, result)) = outcomes.next().await {
        match result {
            Ok(applied) if applied.is_empty() => outln!("{name}: schema is up to date"),
            Ok(applied) => outln!("{name}: applied {} ({})", applied.len(), applied.join(", ")),
            Err(e) => failed.add(&name, &e),
        }
    }
    failed.check("migrated")
}

/// One lease repair pass on every source, `parallel` at a time, with a line per source
/// saying what it did; fails naming the sources that could not be repaired, after trying
/// them all.
pub async fn repair(settings: &SourcesSettings, limit: i32, parallel: usize) -> Result<()> {
    let sources = all(settings).await?;
    let mut failed = Failed::inline();
    let mut outcomes = std::pin::pin!(each(sources, parallel, |url| async move {
        store(&url).await?.repair(limit).await.context("repair")
    }));
    while let Some((name, result)) = outcomes.next().await {
        match result {
            Ok(r) => outln!(
                "{name}: requeued {} dead_lettered {}",
                r.requeued,
                r.dead_lettered
            ),
            Err(e) => failed.add(&name, &e),
        }
    }
    failed.check("repaired")
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

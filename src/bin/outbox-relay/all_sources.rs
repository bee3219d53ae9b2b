//! What the operator verbs share to work across the sources of a many-source fleet
//! (`--all-sources`, in `migrate`, `status`, `repair`, `dead-letters` and `replay`, each in
//! its own file) and on one source by name (`--source NAME`): the sources are found as the
//! fleet finds them (the config file's `[sources.NAME]` tables, `sources_server_url`, the
//! catalogue query; the `OUTBOX_SOURCES_*` variables), each is then handled on a session of
//! its own. A source that fails is named with its cause, the others are tried all the same,
//! and the verb then exits 2 naming the sources that failed.

use std::collections::BTreeMap;

use anyhow::{Result, bail};
use futures_util::stream::{self, Stream, StreamExt};
use outbox_relay::sources::{SourcesSettings, discover};
use outbox_relay::store::Store;

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

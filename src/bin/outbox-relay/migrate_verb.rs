//! The `migrate` verb: the embedded schema migrations applied to the database of
//! `--database-url` (or `--source NAME`), or with `--all-sources` to every source of a
//! many-source configuration, a few at a time, a line per source.

use anyhow::{Context, Result};
use futures_util::StreamExt;
use outbox_relay::sources::SourcesSettings;
use outbox_relay::store::Store;

use crate::all_sources::{self, Failed};

/// Applies the migrations to the database of `url`, a line per migration applied.
pub async fn run(url: &str) -> Result<()> {
    let applied = Store::connect(url, 2)?.migrate().await.context("migrate")?;
    if applied.is_empty() {
        outln!("schema is up to date");
    }
    for name in applied {
        outln!("applied {name}");
    }
    Ok(())
}

/// Migrates every source, `parallel` at a time, with a line per source; fails naming the
/// sources that could not be migrated, after trying them all.
pub async fn run_all(settings: &SourcesSettings, parallel: usize) -> Result<()> {
    let sources = all_sources::all(settings).await?;
    let mut failed = Failed::inline();
    let mut outcomes = std::pin::pin!(all_sources::each(sources, parallel, |url| async move {
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

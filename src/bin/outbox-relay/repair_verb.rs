//! The `repair` verb: one lease repair pass, as the janitor of a running relayer makes
//! them (for cron), on one database or with `--all-sources` on every source, printing what
//! it did.

use anyhow::{Context, Result};
use futures_util::StreamExt;
use outbox_relay::sources::SourcesSettings;
use outbox_relay::store::Store;

use crate::all_sources::{self, Failed};

/// One repair pass of at most `limit` expired leases; prints what it did.
pub async fn run(store: &Store, limit: i32) -> Result<()> {
    let r = store.repair(limit).await.context("repair")?;
    outln!("requeued {} dead_lettered {}", r.requeued, r.dead_lettered);
    Ok(())
}

/// One lease repair pass on every source, `parallel` at a time, with a line per source
/// saying what it did; fails naming the sources that could not be repaired, after trying
/// them all.
pub async fn run_all(settings: &SourcesSettings, limit: i32, parallel: usize) -> Result<()> {
    let sources = all_sources::all(settings).await?;
    let mut failed = Failed::inline();
    let mut outcomes = std::pin::pin!(all_sources::each(sources, parallel, |url| async move {
        all_sources::store(&url)
            .await?
            .repair(limit)
            .await
            .context("repair")
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

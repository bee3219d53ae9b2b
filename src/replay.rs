//! The `replay` verb: dead letters back into the outbox, chosen with the same filters as
//! `dead-letters list`, previewed with `--dry-run`, and audited in `outbox.replays` (who,
//! when, why, the filter, how many). A large replay moves in steps, each its own short
//! transaction, with progress on a terminal. `--id`s that are not dead letters are refused by
//! name, and a replay that matches nothing records nothing.

use std::io::{IsTerminal, Write};

use std::collections::HashSet;

use anyhow::{Context, Result, bail};
use outbox_relay::store::{DeadLetterFilter, Store};

use crate::dead_letters::{Filter, one_line};

#[derive(clap::Args)]
pub struct Args {
    /// Replay these dead letters (repeatable); other filters narrow them further.
    #[arg(long = "id")]
    ids: Vec<uuid::Uuid>,
    #[command(flatten)]
    filter: Filter,
    /// Replay every dead letter (required when no filter is given).
    #[arg(long, conflicts_with_all = ["ids", "topic", "since", "error_contains"])]
    all: bool,
    /// Why, for the audit row (`outbox.replay_log`).
    #[arg(long)]
    reason: Option<String>,
    /// Print what would be replayed and change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Dead letters moved per transaction, 1..=100000.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i32).range(1..=100_000))]
    step: i32,
}

/// Dead letters a dry run lists by name; beyond that it gives the count.
const DRY_RUN_SHOWN: i64 = 20;

pub async fn run(store: &Store, args: &Args) -> Result<()> {
    let mut filter = args.filter.store_filter();
    if filter.topic.is_none()
        && filter.since.is_none()
        && filter.error_contains.is_none()
        && args.ids.is_empty()
        && !args.all
    {
        bail!(
            "replay needs a filter (--id, --topic, --since, --error-contains) or --all; \
             preview with --dry-run"
        );
    }
    if !args.ids.is_empty() {
        refuse_unknown_ids(store, &args.ids).await?;
        filter.ids = Some(args.ids.clone());
    }
    let matching = store
        .dead_letter_count(&filter)
        .await
        .context("count dead letters")?;
    if args.dry_run {
        outln!("would replay {matching}");
        for d in store
            .dead_letters(&filter, DRY_RUN_SHOWN)
            .await
            .context("list dead letters")?
        {
            outln!(
                "{}  {}  {}  {}",
                d.outbox_id,
                d.dead_lettered_at.format("%Y-%m-%d %H:%M:%S"),
                d.topic,
                one_line(d.last_error.as_deref().unwrap_or("-"), 100)
            );
        }
        if matching > DRY_RUN_SHOWN {
            outln!("… and {} more", matching - DRY_RUN_SHOWN);
        }
        return Ok(());
    }

    if matching == 0 {
        // No audit row for a replay of nothing.
        outln!("replayed 0 (no dead letter matches)");
        return Ok(());
    }
    let replay_id = store
        .start_replay(&filter, args.reason.as_deref())
        .await
        .context("start replay")?;
    let progress = std::io::stderr().is_terminal() && matching > i64::from(args.step);
    let mut replayed: i64 = 0;
    loop {
        let moved = store
            .replay_step(replay_id, args.step)
            .await
            .with_context(|| format!("replay {replay_id} stopped after {replayed} messages"))?;
        replayed += i64::from(moved);
        if progress {
            eprint!("\rreplaying: {replayed} of about {matching}");
            let _ = std::io::stderr().flush();
        }
        if moved < args.step {
            break;
        }
    }
    if progress {
        eprintln!();
    }
    outln!("replayed {replayed} (replay {replay_id}, see outbox.replay_log)");
    Ok(())
}

/// Fails naming the `--id`s that are not dead letters (never were, or already replayed or
/// delivered): a replay that quietly skips them would read as done.
async fn refuse_unknown_ids(store: &Store, ids: &[uuid::Uuid]) -> Result<()> {
    let only_ids = DeadLetterFilter {
        ids: Some(ids.to_vec()),
        ..DeadLetterFilter::default()
    };
    let limit = i64::try_from(ids.len()).unwrap_or(i64::MAX);
    let found: HashSet<uuid::Uuid> = store
        .dead_letters(&only_ids, limit)
        .await
        .context("look up dead letters")?
        .into_iter()
        .map(|d| d.outbox_id)
        .collect();
    let mut unknown: Vec<String> = ids
        .iter()
        .filter(|id| !found.contains(id))
        .map(ToString::to_string)
        .collect();
    unknown.sort();
    unknown.dedup();
    if !unknown.is_empty() {
        bail!(
            "not dead letters, nothing replayed: {} (see `outbox-relay dead-letters list`)",
            unknown.join(", ")
        );
    }
    Ok(())
}

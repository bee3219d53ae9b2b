//! The `replay` verb: dead letters back into the outbox, chosen with the same filters as
//! `dead-letters list`, previewed with `--dry-run`, and audited in `outbox.replays` (who,
//! when, why, the filter, how many). A large replay moves in steps, each its own short
//! transaction, with progress on a terminal. `--id`s that are not dead letters are refused by
//! name, and a replay that matches nothing records nothing. With `--all-sources`, the same
//! selection is replayed in every source of a many-source configuration, each audited in
//! its own `outbox.replay_log`.

use std::io::{IsTerminal, Write};

use std::collections::HashSet;
use std::pin::pin;

use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use outbox_relay::sources::SourcesSettings;
use outbox_relay::store::{DeadLetterFilter, Store};

use crate::all_sources::{self, Failed};
use crate::dead_letters_verb::{Filter, one_line};

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
    pub dry_run: bool,
    /// Dead letters moved per transaction, 1..=100000.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i32).range(1..=100_000))]
    step: i32,
    /// Replay the selection in every source of a many-source configuration, each with its
    /// own audit row, a line per source with the count replayed (with --dry-run, the count
    /// that would be); not with --id; exits non-zero naming the sources that failed, after
    /// trying them all.
    #[arg(long)]
    pub all_sources: bool,
    /// Sources replayed at once with --all-sources, 1..=64.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    parallel: u16,
}

/// Dead letters a dry run lists by name; beyond that it gives the count.
const DRY_RUN_SHOWN: i64 = 20;

/// The selection of `args`, refused when it has no filter (a replay of everything must say
/// `--all`).
fn selection(args: &Args) -> Result<DeadLetterFilter> {
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
        filter.ids = Some(args.ids.clone());
    }
    Ok(filter)
}

pub async fn run(store: &Store, args: &Args) -> Result<()> {
    let filter = selection(args)?;
    if !args.ids.is_empty() {
        refuse_unknown_ids(store, &args.ids).await?;
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

    let progress = std::io::stderr().is_terminal() && matching > i64::from(args.step);
    match replay(store, &filter, args, matching, progress).await? {
        Replayed::Nothing => outln!("replayed 0 (no dead letter matches)"),
        Replayed::Some {
            replay_id,
            replayed,
        } => {
            outln!(
                "replayed {replayed} (replay {replay_id}, see {}.replay_log)",
                store.schema()
            );
        }
    }
    Ok(())
}

/// What a replay of one outbox did.
enum Replayed {
    /// Nothing matched: nothing was recorded.
    Nothing,
    /// `replayed` dead letters moved by the replay `replay_id` of `outbox.replay_log`.
    Some { replay_id: i64, replayed: i64 },
}

/// Replays the `matching` dead letters `filter` selects in steps of `args.step`, with
/// progress on standard error when `progress`.
async fn replay(
    store: &Store,
    filter: &DeadLetterFilter,
    args: &Args,
    matching: i64,
    progress: bool,
) -> Result<Replayed> {
    if matching == 0 {
        // No audit row for a replay of nothing.
        return Ok(Replayed::Nothing);
    }
    let replay_id = store
        .start_replay(filter, args.reason.as_deref())
        .await
        .context("start replay")?;
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
    Ok(Replayed::Some {
        replay_id,
        replayed,
    })
}

/// `--all-sources`: the selection replayed (or, with `--dry-run`, counted) in every source,
/// `--parallel` at a time, a line per source, then the sum; after trying them all, an error
/// naming the sources that failed.
pub async fn run_all(settings: &SourcesSettings, args: &Args) -> Result<()> {
    if !args.ids.is_empty() {
        bail!(
            "--id names a dead letter of one source: find which with `dead-letters show ID \
             --all-sources`, then replay it with --source NAME; --all-sources replays a \
             selection by --topic, --since, --error-contains, or --all"
        );
    }
    let filter = selection(args)?;
    let sources = all_sources::all(settings).await?;
    let total = sources.len();
    let mut failed = Failed::inline();
    let mut sum: i64 = 0;
    let mut outcomes = pin!(all_sources::each(
        sources,
        usize::from(args.parallel),
        |url| {
            let filter = filter.clone();
            async move {
                let store = all_sources::store(&url).await?;
                let matching = store
                    .dead_letter_count(&filter)
                    .await
                    .context("count dead letters")?;
                if args.dry_run {
                    return Ok((matching, None));
                }
                // No progress line: the sources' replays run side by side.
                match replay(&store, &filter, args, matching, false).await? {
                    Replayed::Nothing => Ok((0, None)),
                    Replayed::Some {
                        replay_id,
                        replayed,
                    } => Ok((replayed, Some(replay_id))),
                }
            }
        }
    ));
    while let Some((name, result)) = outcomes.next().await {
        match result {
            Ok((n, _)) if args.dry_run => {
                outln!("{name}: would replay {n}");
                sum += n;
            }
            Ok((n, Some(replay_id))) => {
                outln!("{name}: replayed {n} (replay {replay_id}, see outbox.replay_log)");
                sum += n;
            }
            Ok((_, None)) => outln!("{name}: replayed 0 (no dead letter matches)"),
            Err(e) => failed.add(&name, &e),
        }
    }
    let verb = if args.dry_run {
        "would replay"
    } else {
        "replayed"
    };
    match failed.count() {
        0 => outln!("all sources: {verb} {sum}"),
        n => outln!("all sources: {verb} {sum} ({n} of {total} failed)"),
    }
    failed.check(if args.dry_run { "read" } else { "replayed" })
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

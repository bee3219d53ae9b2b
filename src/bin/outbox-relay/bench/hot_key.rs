//! `bench --hot-key N`: does one busy key starve the others? Each round drains N unkeyed
//! messages alone, then N messages of one key enqueued together with N unkeyed ones, and
//! compares the unkeyed rate beside the hot key with the rate alone; the hot key's own rate
//! is that of its N messages, delivered in order. Both drains of a round start from the
//! same state (a vacuumed, analyzed table, settled statistics), and their ends are the
//! destination's last acknowledgements, not a poll of the table: a drain of 50,000 takes
//! about a second, so a 100 ms poll alone would move a round's ratio by several per cent.
//! The machine drifts between rounds, so the figure to read is the median of the rounds.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use futures_util::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use outbox_relay::destination::{Destination, Window};
use outbox_relay::message::{ClaimedMessage, Outcome};
use outbox_relay::store::fill_messages;

use super::{
    Options, Recorder, lock, median, per_sec, report, settle, shutdown_relays, start_relays,
};

pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    let n = o.hot_key;
    let mut ratios = Vec::new();
    let mut hot_rates = Vec::new();
    for round in 1..=o.rounds {
        fill_messages(sql, "bench", i64::try_from(n)?, None, 1, 256).await?;
        let alone = drain(url, o, sql, n).await?;
        report(
            &format!("round {round}: unkeyed alone"),
            n,
            n,
            alone.unkeyed,
            o.workers,
        );

        fill_messages(sql, "bench", i64::try_from(n)?, Some(1), 1, 256).await?;
        fill_messages(sql, "bench", i64::try_from(n)?, None, 1, 256).await?;
        let beside = drain(url, o, sql, 2 * n).await?;
        report(
            &format!("round {round}: unkeyed beside the hot key"),
            2 * n,
            n,
            beside.unkeyed,
            o.workers,
        );
        report(
            &format!("round {round}: the hot key (one key, in order)"),
            2 * n,
            n,
            beside.keyed,
            o.workers,
        );
        let ratio = per_sec(n, beside.unkeyed) / per_sec(n, alone.unkeyed);
        outln!("  unkeyed rate beside the hot key / alone = {ratio:.2}");
        // The hot key's deliveries use the same database: its share while the unkeyed
        // drained, and what all deliveries added up to meanwhile, against the rate alone.
        #[allow(clippy::cast_precision_loss)] // message counts are far below 2^52
        let share = beside.keyed_beside as f64 / (beside.keyed_beside + n) as f64;
        outln!(
            "  meanwhile the hot key delivered {} ({:.0} % of the deliveries); all deliveries / unkeyed alone = {:.2}",
            beside.keyed_beside,
            share * 100.0,
            per_sec(n + beside.keyed_beside, beside.unkeyed) / per_sec(n, alone.unkeyed)
        );
        ratios.push(ratio);
        hot_rates.push(per_sec(n, beside.keyed));
    }
    outln!(
        "hot key, median of {} rounds: unkeyed beside the hot key / alone = {:.2} (rounds: {}); the hot key {:.0} msg/s",
        o.rounds,
        median(ratios.iter().copied().map(Some)).unwrap_or_default(),
        ratios
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(", "),
        median(hot_rates.iter().copied().map(Some)).unwrap_or_default()
    );
    Ok(())
}

/// What a drain's destination saw: when the last unkeyed and the last keyed message were
/// acknowledged (from the moment the relays started), and how many keyed ones had been
/// delivered by the last unkeyed one.
struct Ends {
    unkeyed: Duration,
    keyed: Duration,
    keyed_beside: u64,
}

/// Drains what the table holds (`messages` in all) with fresh relays.
async fn drain(
    url: &str,
    o: &Options,
    sql: &tokio_postgres::Client,
    messages: u64,
) -> Result<Ends> {
    sql.batch_execute("VACUUM ANALYZE outbox.messages").await?;
    settle(sql).await;
    let clock = Arc::new(KeyClock::default());
    let recorder = Recorder::new(Some(clock.clone()));
    let target = recorder.target(messages);
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let relays = start_relays(url, o, &recorder, &shutdown)?;
    recorder.reached(target, "hot-key shape").await?;
    shutdown_relays(&shutdown, relays).await;
    let tally = lock(&clock.tally);
    let since = |at: Option<Instant>| at.map_or(Duration::ZERO, |at| at - started);
    Ok(Ends {
        unkeyed: since(tally.last_unkeyed),
        keyed: since(tally.last_keyed),
        keyed_beside: tally.keyed_beside,
    })
}

/// A null destination that notes when it acknowledged the last unkeyed and the last keyed
/// message, and how many keyed ones it had acknowledged by the last unkeyed one. The
/// [`Recorder`] around it counts the deliveries.
#[derive(Default)]
struct KeyClock {
    tally: Mutex<Tally>,
}

#[derive(Default)]
struct Tally {
    keyed: u64,
    keyed_beside: u64,
    last_unkeyed: Option<Instant>,
    last_keyed: Option<Instant>,
}

impl Destination for KeyClock {
    /// Sends nothing anywhere, so it has no call to check the window before (the dispatch
    /// layer checks it before calling this).
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        _: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let keyed = batch.iter().filter(|m| m.key.is_some()).count();
            let now = Instant::now();
            let mut tally = lock(&self.tally);
            tally.keyed += keyed as u64;
            if keyed > 0 {
                tally.last_keyed = Some(now);
            }
            if keyed < batch.len() {
                tally.last_unkeyed = Some(now);
                tally.keyed_beside = tally.keyed;
            }
            vec![Outcome::Delivered; batch.len()]
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

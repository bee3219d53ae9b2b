//! `bench --hot-key N`: does one busy key starve the others? Each round drains N unkeyed
//! messages alone, then N messages of one key enqueued together with N unkeyed ones, and
//! compares the unkeyed rate beside the hot key with the rate alone; the hot key's own rate
//! is that of its N messages, delivered in order. Both drains of a round start from the
//! same state (a vacuumed, analyzed table, settled statistics), and their ends are the
//! destination's last acknowledgements, not a poll of the table: a drain of 50,000 takes
//! about a second, so a 100 ms poll alone would move a round's ratio by a tenth. The
//! machine drifts between rounds, so the figure to read is the median of the rounds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use futures_util::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use outbox_relay::destination::Destination;
use outbox_relay::message::{ClaimedMessage, Outcome};

use super::{
    Options, Recorder, kit, lock, median, per_sec, progress, report, settle, shutdown_relays,
    start_relays,
};

/// A drain that has not finished by then is reported as stuck.
const DRAIN_LIMIT: Duration = Duration::from_secs(600);

pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    let n = o.hot_key;
    let mut ratios = Vec::new();
    let mut hot_rates = Vec::new();
    for round in 1..=o.rounds {
        kit::fill_messages(sql, "bench", i64::try_from(n)?, None, 1, 256).await?;
        let alone = drain(url, o, sql, n, 0).await?;
        report(
            &format!("round {round}: unkeyed alone"),
            n,
            n,
            alone.unkeyed,
            o.workers,
        );

        kit::fill_messages(sql, "bench", i64::try_from(n)?, Some(1), 1, 256).await?;
        kit::fill_messages(sql, "bench", i64::try_from(n)?, None, 1, 256).await?;
        let beside = drain(url, o, sql, n, n).await?;
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
        println!("  unkeyed rate beside the hot key / alone = {ratio:.2}");
        // The hot key's deliveries use the same database: its share while the unkeyed
        // drained, and what all deliveries added up to meanwhile, against the rate alone.
        #[allow(clippy::cast_precision_loss)] // message counts are far below 2^52
        let share = beside.keyed_beside as f64 / (beside.keyed_beside + n) as f64;
        println!(
            "  meanwhile the hot key delivered {} ({:.0} % of the deliveries); all deliveries / unkeyed alone = {:.2}",
            beside.keyed_beside,
            share * 100.0,
            per_sec(n + beside.keyed_beside, beside.unkeyed) / per_sec(n, alone.unkeyed)
        );
        ratios.push(ratio);
        hot_rates.push(per_sec(n, beside.keyed));
    }
    println!(
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

/// When the last unkeyed and the last keyed message of a drain were acknowledged, from the
/// moment the relays started, and how many keyed ones were delivered until the first.
struct Ends {
    unkeyed: Duration,
    keyed: Duration,
    keyed_beside: u64,
}

/// Drains what the table holds (`unkeyed` and `keyed` messages) with fresh relays.
async fn drain(
    url: &str,
    o: &Options,
    sql: &tokio_postgres::Client,
    unkeyed: u64,
    keyed: u64,
) -> Result<Ends> {
    sql.batch_execute("VACUUM ANALYZE outbox.messages").await?;
    settle(sql).await;
    let clock = Arc::new(KeyClock::default());
    let recorder = Recorder::new(Some(clock.clone()));
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let relays = start_relays(url, o, &recorder, &shutdown)?;
    let ends = loop {
        let (u, k) = (
            clock.unkeyed.load(Ordering::SeqCst),
            clock.keyed.load(Ordering::SeqCst),
        );
        if u >= unkeyed && k >= keyed {
            let last = *lock(&clock.last);
            let end = |at: Option<Instant>| at.map_or(Duration::ZERO, |at| at - started);
            break Ends {
                unkeyed: end(last[0]),
                keyed: end(last[1]),
                keyed_beside: clock.keyed_beside.load(Ordering::SeqCst),
            };
        }
        if started.elapsed() > DRAIN_LIMIT {
            progress("");
            bail!(
                "hot-key shape: not drained within {} s: {} of {unkeyed} unkeyed and {} of {keyed} keyed delivered",
                DRAIN_LIMIT.as_secs(),
                u,
                k
            );
        }
        progress(&format!(
            "hot-key shape: {u} of {unkeyed} unkeyed and {k} of {keyed} keyed delivered"
        ));
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    progress("");
    shutdown_relays(&shutdown, relays).await;
    Ok(ends)
}

/// A null destination that counts the unkeyed and the keyed messages it acknowledged and
/// notes when it acknowledged the last of each.
#[derive(Default)]
struct KeyClock {
    unkeyed: AtomicU64,
    keyed: AtomicU64,
    /// The keyed messages acknowledged up to the last acknowledgement of an unkeyed one.
    keyed_beside: AtomicU64,
    /// The last acknowledgement of an unkeyed and of a keyed message.
    last: Mutex<[Option<Instant>; 2]>,
}

impl Destination for KeyClock {
    fn publish<'a>(&'a self, batch: &'a [ClaimedMessage]) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let keyed = batch.iter().filter(|m| m.key.is_some()).count() as u64;
            let unkeyed = batch.len() as u64 - keyed;
            {
                let now = Instant::now();
                let mut last = lock(&self.last);
                let keyed_so_far = self.keyed.fetch_add(keyed, Ordering::SeqCst) + keyed;
                if unkeyed > 0 {
                    last[0] = Some(now);
                    self.keyed_beside.store(keyed_so_far, Ordering::SeqCst);
                }
                if keyed > 0 {
                    last[1] = Some(now);
                }
            }
            self.unkeyed.fetch_add(unkeyed, Ordering::SeqCst);
            vec![Outcome::Delivered; batch.len()]
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

//! Turns for the leasing calls of the sources one process serves on one Postgres server.
//!
//! A server with tens of outbox databases would otherwise run a claim loop's calls for each
//! of them at once and spend its cores switching between them, so every source's store on
//! that server waits for one of the server's turns and holds it while the database runs a
//! claim, completion, release or lease repair. A source whose latest claim came back full
//! (a backlog: its next calls are as long as the batch allows) may hold only some of the
//! turns at once: the rest are kept for sources that are not backlogged, whose calls are
//! short and whose messages wait for them, so that one source's deep backlog does not keep
//! the server's cores from the quiet sources beside it. Each kind waits first come, first
//! served.
//!
//! While quiet sources beside the backlog are flowing (one of their claims returned
//! messages within the last [`QUIET_WINDOW`]), backlogged calls may run only one at a time
//! when the turns were made with [`Turns::adaptive`]: on a server with few cores, the quiet
//! sources' calls otherwise share them with every backlogged call at once
//! (docs/performance.md, "Quiet sources beside a backlog: adaptive turns"). With no quiet
//! traffic, a backlog keeps all of its turns. Only the quiet sources this process serves
//! on the server count.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit};
use tokio::time::Instant;

/// How long after a quiet source's claim returned messages the backlogged calls run one at
/// a time (adaptive turns).
pub const QUIET_WINDOW: Duration = Duration::from_secs(1);

/// One server's turns, shared by the stores of the sources a process serves on it.
#[derive(Debug)]
pub struct Turns {
    /// Every call holds one of these while it runs.
    all: Semaphore,
    /// A backlogged source's call holds one of these too: fewer than `all`.
    backlogged: Semaphore,
    /// With adaptive turns, a backlogged call that starts while quiet sources flow holds
    /// this one too.
    beside_quiet: Option<Semaphore>,
    /// When the turns were made, the origin of `quiet_until`.
    started: Instant,
    /// Milliseconds from `started` to the end of the quiet window of the latest quiet
    /// source's claim that returned messages (0: none yet).
    quiet_until: AtomicU64,
}

impl Turns {
    /// `calls` at once, of which at most `backlogged_calls` from backlogged sources (at
    /// least 1; at most `calls`).
    pub fn new(calls: usize, backlogged_calls: usize) -> Self {
        let calls = calls.max(1);
        Self {
            all: Semaphore::new(calls),
            backlogged: Semaphore::new(backlogged_calls.clamp(1, calls)),
            beside_quiet: None,
            started: Instant::now(),
            quiet_until: AtomicU64::new(0),
        }
    }

    /// The same turns, adaptive: while quiet sources flow (see [`Turns::quiet_flowed`]),
    /// backlogged calls run one at a time, whatever `backlogged_calls` allows.
    #[must_use]
    pub fn adaptive(mut self) -> Self {
        self.beside_quiet = Some(Semaphore::new(1));
        self
    }

    /// Notes that a source that is not backlogged had a claim return messages: the quiet
    /// sources flow for the next [`QUIET_WINDOW`].
    pub fn quiet_flowed(&self) {
        let until = self.started.elapsed() + QUIET_WINDOW;
        self.quiet_until.fetch_max(
            u64::try_from(until.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// When the quiet sources' window ends, if it has not ended yet.
    fn quiet_window_end(&self) -> Option<Instant> {
        let until = Duration::from_millis(self.quiet_until.load(Ordering::Relaxed));
        let end = self.started + until;
        (Instant::now() < end).then_some(end)
    }

    /// Waits for a turn; a backlogged source's call also waits for one of the backlogged
    /// turns, first, so that it never holds a turn of `all` while it waits, and with
    /// adaptive turns, while the quiet sources flow, for the one turn of backlogged calls
    /// beside them (it stops waiting for it when their window ends).
    pub async fn take(&self, backlogged: bool) -> Turn<'_> {
        let (backlogged, beside_quiet) = if backlogged {
            let permit = self.backlogged.acquire().await.expect("never closed");
            let mut beside_quiet = None;
            if let Some(one) = &self.beside_quiet {
                while let Some(end) = self.quiet_window_end() {
                    if let Ok(p) = tokio::time::timeout_at(end, one.acquire()).await {
                        beside_quiet = Some(p.expect("never closed"));
                        break;
                    }
                }
            }
            (Some(permit), beside_quiet)
        } else {
            (None, None)
        };
        Turn {
            _all: self.all.acquire().await.expect("never closed"),
            _backlogged: backlogged,
            _beside_quiet: beside_quiet,
        }
    }
}

/// A turn held until dropped.
pub struct Turn<'a> {
    _all: SemaphorePermit<'a>,
    _backlogged: Option<SemaphorePermit<'a>>,
    _beside_quiet: Option<SemaphorePermit<'a>>,
}

#[cfg(test)]
mod tests {
    use super::Turns;
    use std::time::Duration;

    #[tokio::test]
    async fn backlogged_calls_leave_turns_to_the_others() {
        let turns = Turns::new(4, 2);
        let a = turns.take(true).await;
        let b = turns.take(true).await;
        // A third backlogged call waits, though two turns are free...
        let third = tokio::time::timeout(Duration::from_millis(50), turns.take(true)).await;
        assert!(third.is_err(), "a third backlogged call got a turn");
        // ...which the other sources take at once.
        let c = turns.take(false).await;
        let d = turns.take(false).await;
        let fifth = tokio::time::timeout(Duration::from_millis(50), turns.take(false)).await;
        assert!(fifth.is_err(), "a fifth call got one of 4 turns");
        drop((a, c));
        let _e = turns.take(true).await;
        let _f = turns.take(false).await;
        drop((b, d));
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_turns_run_one_backlogged_call_while_quiet_sources_flow() {
        let turns = Turns::new(4, 2).adaptive();
        // No quiet traffic: the backlog has both of its turns.
        let a = turns.take(true).await;
        let b = turns.take(true).await;
        drop((a, b));
        turns.quiet_flowed();
        let a = turns.take(true).await;
        let second = tokio::time::timeout(Duration::from_millis(50), turns.take(true)).await;
        assert!(
            second.is_err(),
            "a second backlogged call ran beside quiet traffic"
        );
        // The quiet sources' own calls are not held back.
        let q = turns.take(false).await;
        drop((a, q));
        // Once the quiet window has passed, both turns are the backlog's again.
        tokio::time::sleep(super::QUIET_WINDOW + Duration::from_millis(20)).await;
        let a = turns.take(true).await;
        let b = tokio::time::timeout(Duration::from_millis(50), turns.take(true)).await;
        assert!(
            b.is_ok(),
            "the backlog kept one turn after the quiet window"
        );
        drop((a, b));
    }

    #[tokio::test(start_paused = true)]
    async fn a_backlogged_call_held_beside_quiet_traffic_runs_when_the_window_ends() {
        let turns = Turns::new(4, 2).adaptive();
        turns.quiet_flowed();
        let a = turns.take(true).await;
        let b = tokio::time::timeout(
            super::QUIET_WINDOW + Duration::from_millis(500),
            turns.take(true),
        )
        .await;
        assert!(b.is_ok(), "a held call kept waiting after the quiet window");
        drop((a, b));
    }

    #[tokio::test]
    async fn fixed_turns_ignore_quiet_traffic() {
        let turns = Turns::new(4, 2);
        turns.quiet_flowed();
        let a = turns.take(true).await;
        let b = tokio::time::timeout(Duration::from_millis(50), turns.take(true)).await;
        assert!(b.is_ok(), "fixed turns held a backlogged call back");
        drop((a, b));
    }

    #[tokio::test]
    async fn one_turn_serves_every_kind() {
        let turns = Turns::new(1, 0);
        drop(turns.take(true).await);
        drop(turns.take(false).await);
    }
}

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

use tokio::sync::{Semaphore, SemaphorePermit};

/// One server's turns, shared by the stores of the sources a process serves on it.
#[derive(Debug)]
pub struct Turns {
    /// Every call holds one of these while it runs.
    all: Semaphore,
    /// A backlogged source's call holds one of these too: fewer than `all`.
    backlogged: Semaphore,
}

impl Turns {
    /// `calls` at once, of which at most `backlogged_calls` from backlogged sources (at
    /// least 1; at most `calls`).
    pub fn new(calls: usize, backlogged_calls: usize) -> Self {
        let calls = calls.max(1);
        Self {
            all: Semaphore::new(calls),
            backlogged: Semaphore::new(backlogged_calls.clamp(1, calls)),
        }
    }

    /// Waits for a turn; a backlogged source's call also waits for one of the backlogged
    /// turns, first, so that it never holds a turn of `all` while it waits.
    pub async fn take(&self, backlogged: bool) -> Turn<'_> {
        let backlogged = if backlogged {
            Some(self.backlogged.acquire().await.expect("never closed"))
        } else {
            None
        };
        Turn {
            _all: self.all.acquire().await.expect("never closed"),
            _backlogged: backlogged,
        }
    }
}

/// A turn held until dropped.
pub struct Turn<'a> {
    _all: SemaphorePermit<'a>,
    _backlogged: Option<SemaphorePermit<'a>>,
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

    #[tokio::test]
    async fn one_turn_serves_every_kind() {
        let turns = Turns::new(1, 0);
        drop(turns.take(true).await);
        drop(turns.take(false).await);
    }
}

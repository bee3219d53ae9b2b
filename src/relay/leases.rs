//! The leases of the batches in flight: when each was claimed or last extended and its
//! publish [`Window`], so that the lease keeper extends only batches still being worked on
//! and moves their windows, and nothing of a batch whose leases may have run out is
//! published (the stale-publish guard, checked before every call to a destination).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::Relay;
use crate::destination::Window;
use crate::message::{ClaimedMessage, LeaseToken, OutboxId};
use crate::telemetry;

/// A batch in flight, for the lease keeper and the stale-publish guard.
pub(super) struct Leases {
    /// When it was claimed or last extended.
    since: Instant,
    /// Until when this process may still publish it, by its own monotonic clock; shared with
    /// the dispatch of the batch.
    window: Window,
    /// Its dispatch deadline, once it is being published: the lease keeper does not extend
    /// it past this (the destination did not answer; the batch is being given back).
    dispatch_until: Option<Instant>,
    leases: Vec<(OutboxId, LeaseToken)>,
}

/// Leases of the batches in flight.
#[derive(Default)]
pub(super) struct LeaseBook {
    next: AtomicU64,
    batches: Mutex<HashMap<u64, Leases>>,
}

impl LeaseBook {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Leases>> {
        self.batches
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Books a batch whose claim was sent at `asked`; it may be published until
    /// `asked + publish_window`, or later once its leases are extended: the window returned
    /// says until when.
    pub(super) fn insert(
        &self,
        batch: &[ClaimedMessage],
        asked: Instant,
        publish_window: Duration,
    ) -> (u64, Window) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let leases = batch.iter().map(|m| (m.id, m.lease_token)).collect();
        let window = Window::until(asked + publish_window);
        self.lock().insert(
            id,
            Leases {
                since: asked,
                window: window.clone(),
                dispatch_until: None,
                leases,
            },
        );
        (id, window)
    }

    pub(super) fn remove(&self, id: u64) {
        self.lock().remove(&id);
    }

    pub(super) fn messages(&self) -> usize {
        self.lock().values().map(|b| b.leases.len()).sum()
    }

    /// Batch `id` is being published and must be answered by `deadline`.
    pub(super) fn dispatching(&self, id: u64, deadline: Instant) {
        if let Some(batch) = self.lock().get_mut(&id) {
            batch.dispatch_until = Some(deadline);
        }
    }

    /// Batches claimed (or last extended) at least `age` ago and not past their dispatch
    /// deadline, with their leases; marks them extended.
    pub(super) fn due(&self, age: Duration) -> Vec<(u64, Vec<(OutboxId, LeaseToken)>)> {
        let now = Instant::now();
        let mut due = Vec::new();
        for (id, batch) in self.lock().iter_mut() {
            if batch.dispatch_until.is_some_and(|d| now >= d) {
                continue;
            }
            if now.duration_since(batch.since) >= age {
                batch.since = now;
                due.push((*id, batch.leases.clone()));
            }
        }
        due
    }

    /// Lease time batch `id` has left by this process's clock: its publish window ends a
    /// `margin` before the lease does.
    pub(super) fn lease_left(&self, id: u64, margin: Duration) -> Duration {
        self.lock().get(&id).map_or(Duration::ZERO, |b| {
            (b.window.end() + margin).saturating_duration_since(Instant::now())
        })
    }

    /// The outcomes of `messages` of batch `id` are being recorded before the rest of it:
    /// their leases leave the batch, and are neither extended nor counted in flight again.
    pub(super) fn settled(&self, id: u64, messages: &[ClaimedMessage]) {
        if let Some(batch) = self.lock().get_mut(&id) {
            let done: HashSet<OutboxId> = messages.iter().map(|m| m.id).collect();
            batch.leases.retain(|(id, _)| !done.contains(id));
        }
    }

    /// An extension of batch `id`'s leases, sent at `asked`, held `held`: its publish window
    /// moves when every lease the batch still books was held; else a lease it holds was
    /// lost, and nothing more of it may be published. A lease that left the batch since the
    /// extension was asked (its outcome recorded) is not a loss. Returns how many leases the
    /// batch still books that were not held.
    pub(super) fn extended(
        &self,
        id: u64,
        held: &HashSet<OutboxId>,
        asked: Instant,
        publish_window: Duration,
    ) -> usize {
        let mut book = self.lock();
        let Some(batch) = book.get_mut(&id) else {
            return 0;
        };
        let lost = batch
            .leases
            .iter()
            .filter(|(id, _)| !held.contains(id))
            .count();
        if lost == 0 {
            batch.window.extend_to(asked + publish_window);
        } else {
            batch.window.close();
        }
        lost
    }
}

impl Relay {
    /// Extends the leases of batches still in flight, every third of the lease.
    pub(super) async fn keep_leases(self, stop: CancellationToken) {
        let period = self.settings.lease() / 3;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(period) => {}
            }
            let due = self.leases.due(period);
            if due.is_empty() {
                continue;
            }
            let leases: Vec<(OutboxId, LeaseToken)> =
                due.iter().flat_map(|(_, l)| l.iter().copied()).collect();
            let asked = Instant::now();
            match self
                .store
                .extend(self.worker(), &leases, self.settings.lease_secs)
                .await
            {
                Ok(held) => {
                    let held: HashSet<OutboxId> = held.into_iter().map(|(id, _)| id).collect();
                    // A lease whose outcome was recorded meanwhile left its batch: not lost.
                    let lost: usize = due
                        .iter()
                        .map(|(batch, _)| {
                            self.leases
                                .extended(*batch, &held, asked, self.publish_window())
                        })
                        .sum();
                    if lost > 0 {
                        tracing::info!(worker_id = %self.worker(), lost,
                            "some leases were lost before they could be extended");
                    }
                }
                Err(e) => telemetry::database_error(self.worker(), &self.source, "extend", &e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_keeper_stops_extending_a_batch_past_its_dispatch_deadline() {
        let book = LeaseBook::default();
        let asked = Instant::now();
        let book_one = || {
            book.insert(
                &[ClaimedMessage::example(serde_json::Value::Null)],
                asked,
                Duration::from_secs(60),
            )
            .0
        };
        let (waiting, answering, overdue) = (book_one(), book_one(), book_one());
        book.dispatching(answering, Instant::now() + Duration::from_secs(60));
        book.dispatching(overdue, Instant::now());
        let mut due: Vec<u64> = book
            .due(Duration::ZERO)
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        due.sort_unstable();
        assert_eq!(due, vec![waiting, answering]);
    }

    #[test]
    fn an_extension_moves_the_window_the_dispatch_holds() {
        let book = LeaseBook::default();
        let asked = Instant::now();
        let (id, window) = book.insert(
            &[ClaimedMessage::example(serde_json::Value::Null)],
            asked,
            Duration::from_secs(10),
        );
        let end = window.end();
        let held = HashSet::from([book.lock()[&id].leases[0].0]);
        book.extended(
            id,
            &held,
            asked + Duration::from_secs(5),
            Duration::from_secs(10),
        );
        assert_eq!(window.end(), end + Duration::from_secs(5));
    }

    /// Messages whose outcomes were recorded ahead of their batch leave it: they are not
    /// extended again, and an extension that no longer holds them (they were completed
    /// meanwhile) is no loss; a lease the batch still books that was not held closes its
    /// window.
    #[test]
    fn settled_messages_leave_their_batch_and_are_no_lost_lease() {
        let book = LeaseBook::default();
        let asked = Instant::now();
        let batch: Vec<ClaimedMessage> = (0..3)
            .map(|_| ClaimedMessage::example(serde_json::Value::Null))
            .collect();
        let (id, window) = book.insert(&batch, asked, Duration::from_secs(10));
        let before = book.due(Duration::ZERO);
        assert_eq!(before[0].1.len(), 3);

        book.settled(id, &batch[..2]);
        assert_eq!(book.messages(), 1);
        let due = book.due(Duration::ZERO);
        assert_eq!(due[0].1, vec![(batch[2].id, batch[2].lease_token)]);

        // The extension asked with all three holds only the one left.
        let end = window.end();
        book.extended(
            id,
            &HashSet::from([batch[2].id]),
            asked + Duration::from_secs(5),
            Duration::from_secs(10),
        );
        assert!(window.is_open());
        assert_eq!(window.end(), end + Duration::from_secs(5));

        book.extended(id, &HashSet::new(), asked, Duration::from_secs(10));
        assert!(
            !window.is_open(),
            "a booked lease that was not held is lost"
        );
    }
}

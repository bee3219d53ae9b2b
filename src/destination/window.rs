//! The publish window a part travels with: until when, by this process's monotonic clock,
//! the relayer may still send its messages under the leases it holds (the lease minus a
//! fifth; see `Relay::publish_window`). It exists so that the stale-publish guard holds per
//! call to a destination, not per batch: a relayer frozen part-way through a batch (a
//! stopped process, a throttled container) and woken after its leases were taken over must not
//! start a call for the rest of that batch, which another relayer is delivering by then
//! (docs/guarantees.md says what a check before the call cannot cover).
//!
//! Checking it is one clock read and one atomic load. The lease keeper moves its end when it
//! extends the leases, so a part that is still being published keeps the window its leases
//! have; every clone shares that end.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::message::Outcome;

/// Until when a part may be published; cheap to clone (the clones share the end).
///
/// The window a destination is given for one call also carries that call's dispatch
/// deadline ([`Window::within`]): nothing is started after it, and a destination bounds the
/// requests it has in flight by [`Window::remaining`], so that it answers by the deadline
/// with one outcome per message (delivered, unanswered, not sent) instead of being cut off
/// with none.
#[derive(Clone, Debug)]
pub struct Window {
    fence: Arc<Fence>,
    /// The dispatch deadline of the call this window was given to; `None` outside a call.
    deadline: Option<Instant>,
}

#[derive(Debug)]
struct Fence {
    /// The clock's origin for `end`.
    origin: Instant,
    /// Nanoseconds after `origin` at which the window closes; 0 once closed for good.
    end: AtomicU64,
}

/// The reason of a message given back because the window closed before it was sent.
pub const WINDOW_CLOSED: &str = "the publish window of its lease closed before it was sent (the lease may be another relayer's by now)";

/// The reason of a message given back because its call's dispatch deadline passed before it
/// was sent.
pub const DEADLINE_PASSED: &str =
    "not sent: the batch's dispatch deadline (timeout_ms) passed before its turn";

impl Window {
    /// A window open until `end` (by [`Instant`], the monotonic clock).
    pub fn until(end: Instant) -> Self {
        let origin = Instant::now();
        Window {
            fence: Arc::new(Fence {
                origin,
                end: AtomicU64::new(nanos(end.saturating_duration_since(origin))),
            }),
            deadline: None,
        }
    }

    /// A window that never closes by itself, for tools that hold no lease (a destination
    /// called outside a relayer); [`Window::close`] still closes it.
    pub fn unbounded() -> Self {
        Window {
            fence: Arc::new(Fence {
                origin: Instant::now(),
                end: AtomicU64::new(u64::MAX),
            }),
            deadline: None,
        }
    }

    /// This window for one call whose dispatch deadline is `deadline` (the earlier one, if
    /// it already has one): it shares the lease's end, and closes for new sends at the
    /// deadline as well.
    pub fn within(&self, deadline: Instant) -> Window {
        Window {
            fence: self.fence.clone(),
            deadline: Some(self.deadline.map_or(deadline, |d| d.min(deadline))),
        }
    }

    /// How long a request started now may wait for its answer: the time left before the
    /// call's dispatch deadline; `None` outside a call (no deadline to keep).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Whether a message may be sent now: the lease's window is open and the call's
    /// deadline, if any, has not passed.
    #[inline]
    pub fn is_open(&self) -> bool {
        self.lease_open() && self.deadline.is_none_or(|d| Instant::now() < d)
    }

    #[inline]
    fn lease_open(&self) -> bool {
        nanos(self.fence.origin.elapsed()) < self.fence.end.load(Ordering::Acquire)
    }

    /// `Ok` while the window is open; else the outcome of a message that may no longer be
    /// sent ([`Outcome::NotAttempted`], saying whether the lease's window closed or the
    /// call's deadline passed). A destination calls this before each request, pipeline
    /// flush or produce call, and answers a message it refuses with the outcome.
    #[inline]
    pub fn check(&self) -> Result<(), Outcome> {
        if !self.lease_open() {
            Err(Self::closed())
        } else if self.deadline.is_some_and(|d| Instant::now() >= d) {
            Err(Outcome::NotAttempted {
                reason: DEADLINE_PASSED.to_owned(),
            })
        } else {
            Ok(())
        }
    }

    /// The outcome of a message not sent because the window closed.
    pub fn closed() -> Outcome {
        Outcome::NotAttempted {
            reason: WINDOW_CLOSED.to_owned(),
        }
    }

    /// When the window closes (now, if it is closed).
    pub fn end(&self) -> Instant {
        let end = self.fence.end.load(Ordering::Acquire);
        self.fence
            .origin
            .checked_add(Duration::from_nanos(end))
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365))
    }

    /// Moves the end to `end` if that is later (the leases were extended). A closed window
    /// stays closed.
    pub fn extend_to(&self, end: Instant) {
        let to = nanos(end.saturating_duration_since(self.fence.origin));
        let _ = self
            .fence
            .end
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                (now != 0 && to > now).then_some(to)
            });
    }

    /// Closes the window for good: nothing more of the part is sent.
    pub fn close(&self) {
        self.fence.end.store(0, Ordering::Release);
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_is_open_until_its_end_and_extending_it_moves_the_end_forward_only() {
        let w = Window::until(Instant::now() + Duration::from_secs(60));
        assert!(w.is_open());
        assert!(w.check().is_ok());
        let end = w.end();
        w.extend_to(Instant::now() + Duration::from_secs(1));
        assert_eq!(w.end(), end, "an earlier end does not shorten the window");
        w.extend_to(end + Duration::from_secs(5));
        assert!(w.end() > end);

        let clone = w.clone();
        clone.close();
        assert!(!w.is_open(), "clones share the end");
        assert_eq!(w.check(), Err(Window::closed()));
        w.extend_to(Instant::now() + Duration::from_secs(60));
        assert!(!w.is_open(), "a closed window stays closed");
    }

    #[test]
    fn a_window_whose_end_has_passed_is_closed() {
        assert!(!Window::until(Instant::now()).is_open());
        let w = Window::until(Instant::now() + Duration::from_millis(1));
        let deadline = Instant::now() + Duration::from_secs(5);
        while w.is_open() {
            assert!(Instant::now() < deadline, "the window never closed");
            std::hint::spin_loop();
        }
        assert!(Window::unbounded().is_open());
    }

    #[test]
    fn a_call_window_closes_at_its_deadline_and_with_the_lease() {
        let lease = Window::until(Instant::now() + Duration::from_secs(60));
        assert_eq!(lease.remaining(), None, "no deadline outside a call");
        let call = lease.within(Instant::now() + Duration::from_millis(30));
        assert!(call.is_open());
        assert!(call.remaining().unwrap() <= Duration::from_millis(30));
        let limit = Instant::now() + Duration::from_secs(5);
        while call.is_open() {
            assert!(Instant::now() < limit, "the call's window never closed");
            std::hint::spin_loop();
        }
        assert_eq!(
            call.check(),
            Err(Outcome::NotAttempted {
                reason: DEADLINE_PASSED.to_owned()
            })
        );
        assert_eq!(call.remaining(), Some(Duration::ZERO));
        assert!(lease.is_open(), "the lease's window is not the call's");

        let call = lease.within(Instant::now() + Duration::from_secs(60));
        lease.close();
        assert_eq!(
            call.check(),
            Err(Window::closed()),
            "it shares the lease's end"
        );
    }
}

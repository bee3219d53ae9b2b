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
#[derive(Clone, Debug)]
pub struct Window(Arc<Fence>);

#[derive(Debug)]
struct Fence {
    /// The clock's origin for `end`.
    origin: Instant,
    /// Nanoseconds after `origin` at which the window closes; 0 once closed for good.
    end: AtomicU64,
}

/// The reason of a message given back because the window closed before it was sent.
pub const WINDOW_CLOSED: &str = "the publish window of its lease closed before it was sent (the lease may be another relayer's by now)";

impl Window {
    /// A window open until `end` (by [`Instant`], the monotonic clock).
    pub fn until(end: Instant) -> Self {
        let origin = Instant::now();
        Window(Arc::new(Fence {
            origin,
            end: AtomicU64::new(nanos(end.saturating_duration_since(origin))),
        }))
    }

    /// A window that never closes by itself, for tools that hold no lease (a destination
    /// called outside a relayer); [`Window::close`] still closes it.
    pub fn unbounded() -> Self {
        Window(Arc::new(Fence {
            origin: Instant::now(),
            end: AtomicU64::new(u64::MAX),
        }))
    }

    /// Whether a message may be sent now.
    #[inline]
    pub fn is_open(&self) -> bool {
        nanos(self.0.origin.elapsed()) < self.0.end.load(Ordering::Acquire)
    }

    /// `Ok` while the window is open; else the outcome of a message that may no longer be
    /// sent ([`Outcome::NotAttempted`]). A destination calls this before each request,
    /// pipeline flush or produce call, and answers a message it refuses with the outcome.
    #[inline]
    pub fn check(&self) -> Result<(), Outcome> {
        if self.is_open() {
            Ok(())
        } else {
            Err(Self::closed())
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
        let end = self.0.end.load(Ordering::Acquire);
        self.0
            .origin
            .checked_add(Duration::from_nanos(end))
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365))
    }

    /// Moves the end to `end` if that is later (the leases were extended). A closed window
    /// stays closed.
    pub fn extend_to(&self, end: Instant) {
        let to = nanos(end.saturating_duration_since(self.0.origin));
        let _ = self
            .0
            .end
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                (now != 0 && to > now).then_some(to)
            });
    }

    /// Closes the window for good: nothing more of the part is sent.
    pub fn close(&self) {
        self.0.end.store(0, Ordering::Release);
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
}

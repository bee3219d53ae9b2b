//! The claim gate of a relay serving one source of a many-source fleet: the relay claims
//! only while the process's slot lease on that source holds, by the process's monotonic
//! clock. A process that was frozen past its slot lease does not claim when it wakes: the
//! source may be someone else's by then.

use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Until when the relay may claim; cheap to clone (shared).
#[derive(Clone, Debug)]
pub struct Gate(Arc<Mutex<Instant>>);

impl Gate {
    /// Open until `until`.
    pub fn until(until: Instant) -> Self {
        Self(Arc::new(Mutex::new(until)))
    }

    /// Moves the end to `until` (a renewal, which sets the lease anew from the time it was
    /// asked: the end may move earlier).
    pub fn set(&self, until: Instant) {
        *self.0.lock().expect("gate lock") = until;
    }

    /// Whether a claim may be made now.
    pub fn is_open(&self) -> bool {
        Instant::now() < *self.0.lock().expect("gate lock")
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn closes_at_its_end_and_follows_each_renewal() {
        let gate = Gate::until(Instant::now() - Duration::from_millis(1));
        assert!(!gate.is_open());
        gate.set(Instant::now() + Duration::from_secs(60));
        assert!(gate.is_open());
        gate.set(Instant::now() - Duration::from_millis(1));
        assert!(!gate.is_open(), "a renewal may move the end earlier");
    }
}

//! A circuit breaker per destination. After `failures` consecutive retryable outcomes the
//! circuit opens: the relayer stops claiming the topics routed there, so attempts are not
//! burnt while the destination is down. After `cooldown` one batch goes through as a probe
//! (half-open); a delivery closes the circuit, a failure opens it again.

use std::sync::Mutex;
use std::time::Instant;

use crate::config::CircuitSettings;
use crate::message::Outcome;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Closed,
    Open,
    HalfOpen,
}

impl State {
    /// The value of the `outbox_destination_circuit_state` gauge.
    pub fn as_gauge(self) -> f64 {
        match self {
            State::Closed => 0.0,
            State::Open => 1.0,
            State::HalfOpen => 2.0,
        }
    }
}

#[derive(Debug)]
enum Inner {
    Closed {
        failures: u32,
    },
    Open {
        since: Instant,
    },
    /// The cool-down has passed; the next batch is the probe.
    Probing {
        in_flight: bool,
    },
}

#[derive(Debug)]
pub struct Breaker {
    settings: CircuitSettings,
    inner: Mutex<Inner>,
}

impl Breaker {
    pub fn new(settings: CircuitSettings) -> Self {
        Self {
            settings,
            inner: Mutex::new(Inner::Closed { failures: 0 }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn state(&self) -> State {
        match *self.lock() {
            Inner::Closed { .. } => State::Closed,
            Inner::Open { .. } => State::Open,
            Inner::Probing { .. } => State::HalfOpen,
        }
    }

    /// Whether the claimer may take messages for this destination now. Passing the
    /// cool-down moves an open circuit to half-open; a half-open one admits one probe.
    pub fn admits(&self) -> bool {
        let mut inner = self.lock();
        match *inner {
            Inner::Closed { .. } => true,
            Inner::Open { since } if since.elapsed() >= self.settings.cooldown => {
                *inner = Inner::Probing { in_flight: false };
                true
            }
            Inner::Open { .. } => false,
            Inner::Probing { in_flight } => !in_flight,
        }
    }

    /// Called before publishing a batch: a half-open circuit marks its probe in flight.
    pub fn start(&self) {
        if let Inner::Probing { in_flight } = &mut *self.lock() {
            *in_flight = true;
        }
    }

    /// Records a batch's outcomes (in order); returns the new state when it changed.
    pub fn record(&self, outcomes: &[Outcome]) -> Option<State> {
        let before = self.state();
        let mut inner = self.lock();
        for outcome in outcomes {
            match outcome {
                Outcome::Delivered | Outcome::Permanent { .. } => {
                    *inner = Inner::Closed { failures: 0 }
                }
                Outcome::Retryable { .. } => {
                    *inner = match *inner {
                        Inner::Closed { failures } if failures + 1 < self.settings.failures => {
                            Inner::Closed {
                                failures: failures + 1,
                            }
                        }
                        _ => Inner::Open {
                            since: Instant::now(),
                        },
                    }
                }
            }
        }
        drop(inner);
        let after = self.state();
        (after != before).then_some(after)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn retry() -> Outcome {
        Outcome::Retryable {
            reason: "down".into(),
            retry_after: None,
        }
    }

    #[test]
    fn opens_after_consecutive_failures_probes_after_cooldown_and_closes_on_success() {
        let b = Breaker::new(CircuitSettings {
            failures: 3,
            cooldown: Duration::from_millis(50),
        });
        assert_eq!(b.record(&[retry(), retry()]), None);
        assert_eq!(
            b.record(&[Outcome::Delivered]),
            None,
            "a delivery resets the count"
        );
        assert_eq!(b.record(&[retry(), retry(), retry()]), Some(State::Open));
        assert!(!b.admits());
        std::thread::sleep(Duration::from_millis(60));
        assert!(b.admits(), "cool-down over: one probe");
        b.start();
        assert!(!b.admits(), "only one probe at a time");
        assert_eq!(
            b.record(&[retry()]),
            Some(State::Open),
            "failed probe reopens"
        );
        std::thread::sleep(Duration::from_millis(60));
        assert!(b.admits());
        b.start();
        assert_eq!(b.record(&[Outcome::Delivered]), Some(State::Closed));
        assert!(b.admits());
    }
}

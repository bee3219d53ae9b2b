//! A circuit breaker per destination, so that an outage costs a handful of attempts instead
//! of the retry budget of everything waiting.
//!
//! A batch whose every message failed retryably is one failure of the destination: only
//! one message's attempt counts, the least tried (the others were not deliverable, so they
//! are given back without an attempt), except the messages that were sent and got no
//! answer, which are attempts each. After `failures` such batches in a row the circuit opens: the
//! relayer stops claiming the topics routed there, and batches that were already on their
//! way when it opened are given back without an attempt too. After `cooldown` the circuit
//! is half-open and one message goes through as the probe (one not tried before, when the
//! batch has one: an outage charges no message twice); a delivery closes the circuit,
//! a failure opens it again. A failed batch with a call that was sent and got no answer (a
//! timeout) moves a closed circuit straight to half-open: the destination may be stalled,
//! and one message probes it before more calls are piled on it. Every change of state is logged and signalled to the one
//! waiter of the `changed` notification, which reports it to the database; the report says
//! since when (wall clock) the circuit is closed, or is not (a probe that fails does not
//! restart an outage's time).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::Notify;

// tokio's clock, not the wall clock: the same as `std::time::Instant` in the relayer, and
// paused and advanced by the tests (`start_paused`, `tokio::time::advance`).
use tokio::time::Instant;

use crate::message::Outcome;
use crate::telemetry;

/// Circuit breaker thresholds, the same for every destination.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CircuitSettings {
    /// Consecutive failed batches that open the circuit.
    pub failures: u32,
    /// How long an open circuit waits before a probe.
    pub cooldown: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Closed,
    Open,
    HalfOpen,
}

impl State {
    /// The name `outbox.report_circuits` and `status` use.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half-open",
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
    /// The cool-down has passed; the next message is the probe.
    Probing {
        in_flight: bool,
    },
}

/// Permission to publish, from [`Breaker::start`].
#[derive(Clone, Copy, Debug)]
pub struct Ticket {
    /// Publish only one message: it is the half-open probe (see `Dispatcher::publish`).
    pub probe: bool,
    /// How many times the circuit had opened when the ticket was issued.
    opened: u64,
}

/// The state, how many times the circuit opened, and since when it is closed or not.
type Book = (Inner, u64, DateTime<Utc>);

#[derive(Debug)]
pub struct Breaker {
    destination: String,
    /// The source whose messages this circuit guards (its metrics' `source` label).
    source: telemetry::Source,
    settings: CircuitSettings,
    inner: Mutex<Book>,
    changed: Arc<Notify>,
}

impl Breaker {
    /// A closed circuit; `changed` is notified at each change of state.
    pub fn new(
        destination: &str,
        source: telemetry::Source,
        settings: CircuitSettings,
        changed: Arc<Notify>,
    ) -> Self {
        telemetry::circuit_started(destination, &source);
        Self {
            destination: destination.to_owned(),
            source,
            settings,
            inner: Mutex::new((Inner::Closed { failures: 0 }, 0, Utc::now())),
            changed,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn state_of(inner: &Inner) -> State {
        match inner {
            Inner::Closed { .. } => State::Closed,
            Inner::Open { .. } => State::Open,
            Inner::Probing { .. } => State::HalfOpen,
        }
    }

    pub fn state(&self) -> State {
        Self::state_of(&self.lock().0)
    }

    /// The state, and since when (wall clock) the circuit is closed, or open and half-open
    /// in turns: an outage's time runs from its first opening, through the probes. An
    /// open circuit whose cool-down has passed is half-open from now.
    pub fn state_since(&self) -> (State, DateTime<Utc>) {
        let mut guard = self.lock();
        self.cool(&mut guard);
        (Self::state_of(&guard.0), guard.2)
    }

    /// Moves to `next`, counting openings; a change of state is logged and signalled, and
    /// one into or out of closed restarts the time.
    fn enter(&self, guard: &mut Book, next: Inner) {
        let before = Self::state_of(&guard.0);
        let after = Self::state_of(&next);
        if after == State::Open && before != State::Open {
            guard.1 += 1;
        }
        guard.0 = next;
        if after != before {
            if before == State::Closed || after == State::Closed {
                guard.2 = Utc::now();
            }
            self.changed.notify_one();
            match after {
                State::Open => telemetry::circuit_opened(&self.destination, &self.source),
                State::HalfOpen => telemetry::circuit_half_open(&self.destination, &self.source),
                State::Closed => telemetry::circuit_closed(&self.destination, &self.source),
            }
        }
    }

    /// Passing the cool-down moves an open circuit to half-open.
    fn cool(&self, guard: &mut Book) {
        if let Inner::Open { since } = guard.0
            && since.elapsed() >= self.settings.cooldown
        {
            self.enter(guard, Inner::Probing { in_flight: false });
        }
    }

    /// Whether the claimer may take messages for this destination now: closed, or
    /// half-open with no probe out yet.
    pub fn admits(&self) -> bool {
        let mut guard = self.lock();
        self.cool(&mut guard);
        match guard.0 {
            Inner::Closed { .. } => true,
            Inner::Open { .. } => false,
            Inner::Probing { in_flight } => !in_flight,
        }
    }

    /// Called before publishing: `None` when nothing may be published now (the circuit is
    /// open, or another probe is out), so the batch is given back without an attempt.
    pub fn start(&self) -> Option<Ticket> {
        let mut guard = self.lock();
        self.cool(&mut guard);
        let opened = guard.1;
        match &mut guard.0 {
            Inner::Closed { .. } => Some(Ticket {
                probe: false,
                opened,
            }),
            Inner::Open { .. } | Inner::Probing { in_flight: true } => None,
            Inner::Probing { in_flight } => {
                *in_flight = true;
                Some(Ticket {
                    probe: true,
                    opened,
                })
            }
        }
    }

    /// Records what the destination did with the messages published under `ticket` and
    /// rewrites the outcomes that must not count as attempts to [`Outcome::NotAttempted`]:
    /// when every message failed retryably, all but one (and all of them when the circuit
    /// opened while they were out). An [`Outcome::Unanswered`] is never rewritten: it was
    /// sent, so it is an attempt whatever the rest of the batch did, and a batch holding one
    /// charges no other message. The one charged is the least tried by its number
    /// (`attempt_nos`, per outcome; the first among equals), so that an outage charges a
    /// message that already failed again only when the batch holds no fresher one.
    pub fn record(&self, ticket: Ticket, outcomes: &mut [Outcome], attempt_nos: &[i32]) {
        let mut guard = self.lock();
        if outcomes
            .iter()
            .all(|o| matches!(o, Outcome::NotAttempted { .. }))
        {
            // Nothing was learnt about the destination (its publish panicked): a probe that
            // told nothing is owed again.
            if ticket.probe && matches!(guard.0, Inner::Probing { .. }) {
                guard.0 = Inner::Probing { in_flight: false };
            }
            return;
        }
        // Messages of a run after an undelivered one were not attempted: they say nothing.
        let all_failed = outcomes.iter().all(|o| {
            matches!(
                o,
                Outcome::Retryable { .. }
                    | Outcome::Unanswered { .. }
                    | Outcome::NotAttempted { .. }
            )
        });
        if !all_failed {
            if outcomes
                .iter()
                .any(|o| matches!(o, Outcome::Delivered | Outcome::Permanent { .. }))
            {
                self.enter(&mut guard, Inner::Closed { failures: 0 });
            }
            return;
        }
        let opened_since = guard.1 != ticket.opened;
        let counted = !opened_since || ticket.probe;
        // Messages sent without an answer are the batch's attempts already; else the least
        // tried failed one is charged.
        let sent = outcomes
            .iter()
            .any(|o| matches!(o, Outcome::Unanswered { .. }));
        let charged = outcomes
            .iter()
            .enumerate()
            .filter(|(_, o)| counted && !sent && matches!(o, Outcome::Retryable { .. }))
            .min_by_key(|(i, _)| (attempt_nos.get(*i).copied().unwrap_or(i32::MAX), *i))
            .map(|(i, _)| i);
        for (_, outcome) in outcomes
            .iter_mut()
            .enumerate()
            .filter(|(i, o)| matches!(o, Outcome::Retryable { .. }) && Some(*i) != charged)
        {
            let reason = match outcome {
                Outcome::Retryable { reason, .. } => std::mem::take(reason),
                _ => unreachable!("only retryable outcomes are rewritten"),
            };
            *outcome = Outcome::NotAttempted {
                reason: format!("destination {} is failing: {reason}", self.destination),
            };
        }
        if !counted {
            return;
        }
        let next = match guard.0 {
            // A call went out and got no answer: the destination may be stalled, so one
            // message probes it before more calls are piled on it (each would be sent again
            // after the stall: duplicates growing with the batches in flight).
            Inner::Closed { .. } if sent => Inner::Probing { in_flight: false },
            Inner::Closed { failures } if failures + 1 < self.settings.failures => Inner::Closed {
                failures: failures + 1,
            },
            _ => Inner::Open {
                since: Instant::now(),
            },
        };
        self.enter(&mut guard, next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn retry() -> Outcome {
        Outcome::Retryable {
            reason: "down".into(),
            retry_after: None,
        }
    }

    fn attempted(outcomes: &[Outcome]) -> usize {
        outcomes
            .iter()
            .filter(|o| !matches!(o, Outcome::NotAttempted { .. }))
            .count()
    }

    /// Long enough that a test which forgot to pause time would notice.
    const COOLDOWN: Duration = Duration::from_secs(5);

    fn breaker(failures: u32) -> Breaker {
        Breaker::new(
            "test",
            telemetry::Source::default(),
            CircuitSettings {
                failures,
                cooldown: COOLDOWN,
            },
            Arc::default(),
        )
    }

    #[test]
    fn a_failed_batch_counts_once_and_only_one_message_is_attempted() {
        let b = breaker(3);
        let t = b.start().unwrap();
        let mut outcomes = vec![retry(), retry(), retry()];
        b.record(t, &mut outcomes, &[]);
        assert_eq!(attempted(&outcomes), 1);
        assert_eq!(outcomes[0], retry());
        assert_eq!(b.state(), State::Closed, "one failed batch is one failure");

        let t = b.start().unwrap();
        let mut mixed = vec![retry(), Outcome::Delivered];
        b.record(t, &mut mixed, &[]);
        assert_eq!(
            attempted(&mixed),
            2,
            "a destination that delivers is not down"
        );
    }

    #[test]
    fn messages_sent_without_an_answer_are_attempts_each_and_still_a_failure() {
        let unanswered = || Outcome::Unanswered {
            reason: "timed out".into(),
        };
        let b = breaker(2);
        let t = b.start().unwrap();
        let mut outcomes = vec![unanswered(), unanswered(), retry()];
        b.record(t, &mut outcomes, &[]);
        assert_eq!(outcomes[..2], [unanswered(), unanswered()], "not rewritten");
        assert_eq!(attempted(&outcomes), 2, "the unsent one is given back");
        assert_eq!(
            b.state(),
            State::HalfOpen,
            "a call without an answer has the destination probed before more are sent"
        );
        let probe = b.start().unwrap();
        assert!(probe.probe);
        assert!(
            b.start().is_none(),
            "nothing else goes out beside the probe"
        );
        let mut outcomes = vec![unanswered()];
        b.record(probe, &mut outcomes, &[]);
        assert_eq!(attempted(&outcomes), 1);
        assert_eq!(b.state(), State::Open, "a probe without an answer opens it");
    }

    #[test]
    fn a_probe_delivered_after_a_call_without_an_answer_closes_the_circuit() {
        let b = breaker(5);
        let t = b.start().unwrap();
        b.record(
            t,
            &mut [Outcome::Unanswered {
                reason: "timed out".into(),
            }],
            &[],
        );
        let probe = b.start().unwrap();
        b.record(probe, &mut [Outcome::Delivered], &[]);
        assert_eq!(b.state(), State::Closed);
        assert!(!b.start().unwrap().probe);
    }

    #[test]
    fn a_failed_batch_charges_its_least_tried_message() {
        let b = breaker(3);
        let t = b.start().unwrap();
        let mut outcomes = vec![retry(), retry(), retry()];
        b.record(t, &mut outcomes, &[2, 1, 1]);
        assert_eq!(attempted(&outcomes), 1);
        assert_eq!(outcomes[1], retry(), "the first of the fresh messages");
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_consecutive_failures_probes_one_message_and_closes_on_success() {
        let b = breaker(2);
        for _ in 0..2 {
            let t = b.start().unwrap();
            b.record(t, &mut [retry(), retry()], &[]);
        }
        assert_eq!(b.state(), State::Open);
        assert!(!b.admits());
        assert!(b.start().is_none(), "nothing is published while open");

        tokio::time::advance(COOLDOWN - Duration::from_millis(1)).await;
        assert!(!b.admits(), "still cooling down");
        assert_eq!(b.state(), State::Open);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(b.admits(), "cool-down over: a probe");
        let probe = b.start().unwrap();
        assert!(probe.probe);
        assert!(!b.admits() && b.start().is_none(), "one probe at a time");
        b.record(probe, &mut [retry()], &[]);
        assert_eq!(b.state(), State::Open, "a failed probe reopens");
        tokio::time::advance(COOLDOWN / 2).await;
        assert!(
            b.start().is_none(),
            "the cool-down starts again from the failed probe"
        );

        tokio::time::advance(COOLDOWN / 2).await;
        let probe = b.start().unwrap();
        b.record(probe, &mut [Outcome::Delivered], &[]);
        assert_eq!(b.state(), State::Closed);
        assert!(b.admits());
    }

    #[tokio::test(start_paused = true)]
    async fn each_change_of_state_is_signalled_and_timed() {
        let changed = Arc::new(Notify::new());
        let b = Breaker::new(
            "test",
            telemetry::Source::default(),
            CircuitSettings {
                failures: 2,
                cooldown: COOLDOWN,
            },
            changed.clone(),
        );
        let (state, created) = b.state_since();
        assert_eq!(state, State::Closed);
        let signalled = async || {
            tokio::time::timeout(Duration::from_millis(1), changed.notified())
                .await
                .is_ok()
        };
        let t = b.start().unwrap();
        b.record(t, &mut [retry()], &[]);
        assert!(!signalled().await, "a first failure changes no state");
        let t = b.start().unwrap();
        b.record(t, &mut [retry()], &[]);
        assert!(signalled().await, "opening is signalled");
        let (state, opened) = b.state_since();
        assert_eq!(state, State::Open);
        assert!(opened >= created);
        tokio::time::advance(COOLDOWN).await;
        assert_eq!(
            b.state_since(),
            (State::HalfOpen, opened),
            "half-open once the cool-down has passed, without a claim asking; the outage's \
             time runs on"
        );
        assert!(signalled().await, "half-open is signalled");
        let probe = b.start().unwrap();
        b.record(probe, &mut [retry()], &[]);
        assert!(signalled().await, "a failed probe is signalled");
        assert_eq!(b.state_since(), (State::Open, opened));
        tokio::time::advance(COOLDOWN).await;
        let probe = b.start().unwrap();
        assert!(signalled().await);
        b.record(probe, &mut [Outcome::Delivered], &[]);
        assert!(signalled().await, "closing is signalled");
        let (state, closed) = b.state_since();
        assert_eq!(state, State::Closed);
        assert!(closed >= opened);
    }

    #[test]
    fn batches_out_when_the_circuit_opens_are_given_back_without_an_attempt() {
        let b = breaker(1);
        let first = b.start().unwrap();
        let second = b.start().unwrap();
        b.record(first, &mut [retry(), retry()], &[]);
        assert_eq!(b.state(), State::Open);
        let mut late = vec![retry(), retry(), retry()];
        b.record(second, &mut late, &[]);
        assert_eq!(attempted(&late), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_learnt_nothing_is_owed_again() {
        let b = breaker(1);
        let t = b.start().unwrap();
        b.record(t, &mut [retry()], &[]);
        tokio::time::advance(COOLDOWN).await;
        let probe = b.start().unwrap();
        assert!(probe.probe && !b.admits());
        b.record(
            probe,
            &mut [Outcome::NotAttempted {
                reason: "panicked".into(),
            }],
            &[],
        );
        assert!(b.admits(), "another probe may go");
    }
}

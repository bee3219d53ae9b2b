//! The dispatch layer between the relay and the destinations. The relay hands it claimed
//! messages; it splits them by route into one [`Part`] per destination and delivers each part
//! under that destination's own rules, so that one destination never holds up another:
//!
//! - **routes** ([`routes`]): the first route whose pattern matches the topic wins; a message
//!   no route takes is refused for good with a reason saying so (never retried forever,
//!   never dropped);
//! - **budget**: at most `max_in_flight` parts of a destination are out at once (published
//!   and not yet completed); a part waits for room, and while a destination has none its
//!   topics are left unclaimed. A part whose first wave was recorded early and whose runs'
//!   later waves go on (one call at a time) moves, once it has room there, to a second
//!   allowance of the same size ([`Dispatcher::admit_runs`]), so that a long run does not
//!   keep the next part waiting: a destination may so have up to twice `max_in_flight`
//!   parts out, at most `max_in_flight` of them sending more than their runs' waves;
//! - **circuit** ([`circuit`]): repeated failures open the destination's circuit; its topics
//!   are left unclaimed and what was already claimed is given back without an attempt;
//! - **deadline**: a part not answered within `timeout_ms` is unanswered ("did not
//!   answer"): an attempt for each of its messages (what was sent may have arrived), and
//!   a failure towards the circuit like any other;
//! - **runs**: a part may hold several messages of one key, in enqueue order (the claim's
//!   runs). A destination that keeps a key's order within a call
//!   ([`Destination::keeps_key_order`]: Pub/Sub; Kinesis, SQS FIFO and Kafka with
//!   `runs_in_one_call`) is given the whole part
//!   in one call and sends each run in order; in its answer, a message of a key after one
//!   that was not delivered is not counted delivered even if the service took it (it is an
//!   attempt, sent again after its predecessor), so the outbox never records a key out of
//!   order. To any other destination runs are delivered in waves, one call after the other:
//!   the first holds every unkeyed message and each key's first, the next each key's next
//!   message whose predecessor was delivered, and so on; what follows an undelivered message
//!   is given back unattempted, so a key is never delivered out of order. The first wave's
//!   outcomes of the unkeyed messages and of each key's last message in the part are final
//!   once it answered: they are handed over then ([`Dispatcher::publish_settling`]), to be
//!   recorded while the later waves go on, so a long run does not hold them up;
//! - **publish window** ([`Window`]): a part travels with the window of the leases it is
//!   published under; it is checked before each call of the destination (each wave of
//!   runs, the probe), and the destination checks it before each call to its server. What
//!   was not sent when the window closed is given back unattempted, and a run stops at the
//!   first message it may no longer publish;
//! - **panics**: a destination that panics is logged with the outbox ids and counted, and
//!   its part is given back at once;
//! - **spans** ([`Spans`], with export on): each call of a destination is a delivery
//!   attempt of each of its messages, with a `send` span per message ended with its
//!   outcome; the destination is handed copies whose `traceparent` is the span's (the
//!   current hop), the creation context kept beside it.
//!
//! Why one file of about 1,100 lines: some 740 are code and docs, the rest its tests. The
//! rules above act together on one part (its budget, circuit ticket, deadline and runs are
//! applied in one call to `publish`), so they are kept and tested side by side;
//! the circuit, the routes and the settings, which stand alone, have files of their own.

mod circuit;
mod routes;
mod settings;

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::FutureExt;
use futures_util::future::join_all;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, oneshot};

pub use circuit::{CircuitSettings, State};
pub use routes::{ClaimFilter, RouteConfig, Routes, TopicPattern};
pub use settings::{
    DEFAULT_MAX_IN_FLIGHT, DEFAULT_TIMEOUT_MS, DestinationSettings, DestinationTable,
    DispatchSettings,
};

use crate::destination::{Destination, DestinationConfig, Window};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};
use crate::telemetry;
use crate::traces::Spans;

struct Lane {
    name: String,
    /// The destination's `type` (its spans' `messaging.system`).
    kind: &'static str,
    destination: Arc<dyn Destination>,
    breaker: circuit::Breaker,
    budget: Arc<Semaphore>,
    /// The places of the parts that only have runs' waves left ([`Dispatcher::admit_runs`]).
    runs_budget: Arc<Semaphore>,
    deadline: Duration,
    /// What the breaker and the budget were built from, for [`Dispatcher::for_source`].
    circuit: CircuitSettings,
    max_in_flight: usize,
    /// The source whose messages this lane carries (its metrics' `source` label).
    source: telemetry::Source,
    /// With export on, the maker of the `send` spans.
    spans: Option<Spans>,
}

/// The messages of a claim that go to one destination.
pub struct Part {
    lane: usize,
    pub messages: Vec<ClaimedMessage>,
}

pub struct Dispatcher {
    lanes: Vec<Lane>,
    /// With export on, the span maker (of the lanes' `send` spans, and the relay's
    /// leasing calls).
    spans: Option<Spans>,
    routes: Routes,
    /// The topics the routes cover, as the claim's `LIKE` patterns (`None`: every topic).
    covered: Option<Vec<String>>,
    /// Notified when any destination's circuit changes state.
    circuit_changed: Arc<Notify>,
}

impl Dispatcher {
    /// Builds every destination; an invalid setting is named.
    pub fn new(settings: &DispatchSettings) -> Result<Self, ConfigError> {
        let circuit_changed = Arc::new(Notify::new());
        let lanes = settings
            .destinations
            .iter()
            .map(|d| {
                let destination = d.destination.build(&d.name, d.deadline)?;
                Ok(Lane::new(
                    &d.name,
                    d.destination.kind(),
                    destination,
                    settings.circuit,
                    d.deadline,
                    d.max_in_flight,
                    circuit_changed.clone(),
                    telemetry::Source::default(),
                ))
            })
            .collect::<Result<Vec<_>, ConfigError>>()?;
        Ok(Self {
            lanes,
            spans: None,
            routes: settings.routes.clone(),
            covered: settings.routes.covered(),
            circuit_changed,
        })
    }

    /// One destination taking every topic (for tools, benchmarks and tests).
    pub fn single(
        name: &str,
        destination: Arc<dyn Destination>,
        circuit: CircuitSettings,
        deadline: Duration,
        max_in_flight: usize,
    ) -> Self {
        let circuit_changed = Arc::new(Notify::new());
        Self {
            lanes: vec![Lane::new(
                name,
                name,
                destination,
                circuit,
                deadline,
                max_in_flight,
                circuit_changed.clone(),
                telemetry::Source::default(),
            )],
            spans: None,
            routes: Routes(vec![(TopicPattern::Any, 0)]),
            covered: None,
            circuit_changed,
        }
    }

    /// A dispatcher for one more source of a many-source fleet: the same destinations (their
    /// connections are shared) and routes, with circuits and budgets of its own, so that a
    /// source whose messages a destination refuses, or whose batches fill its budget, does
    /// not hold back the others.
    pub fn for_source(&self, source: &telemetry::Source) -> Self {
        let circuit_changed = Arc::new(Notify::new());
        Self {
            lanes: self
                .lanes
                .iter()
                .map(|l| {
                    Lane::new(
                        &l.name,
                        l.kind,
                        l.destination.clone(),
                        l.circuit,
                        l.deadline,
                        l.max_in_flight,
                        circuit_changed.clone(),
                        source.clone(),
                    )
                    .traced(l.spans.clone())
                })
                .collect(),
            spans: self.spans.clone(),
            routes: self.routes.clone(),
            covered: self.covered.clone(),
            circuit_changed,
        }
    }

    /// The same dispatcher, making a `send` span per delivery attempt with `spans` (export
    /// on) or none (`None`, the default).
    pub fn traced(mut self, spans: Option<Spans>) -> Self {
        self.lanes = self
            .lanes
            .into_iter()
            .map(|l| l.traced(spans.clone()))
            .collect();
        self.spans = spans;
        self
    }

    /// The span maker, with export on.
    pub fn spans(&self) -> Option<&Spans> {
        self.spans.as_ref()
    }

    /// Sets the circuit gauges of this dispatcher's destinations back to closed, once
    /// nothing delivers through it any more (a source that left this process): the
    /// process that serves the source next reports its circuits.
    pub fn circuits_gone(&self) {
        for lane in &self.lanes {
            telemetry::circuit_started(&lane.name, &lane.source);
        }
    }

    /// Each destination's name, circuit state and since when (wall clock), in the order of
    /// the configuration.
    pub fn circuits(&self) -> Vec<(String, State, DateTime<Utc>)> {
        self.lanes
            .iter()
            .map(|lane| {
                let (state, since) = lane.breaker.state_since();
                (lane.name.clone(), state, since)
            })
            .collect()
    }

    /// The topics this process may claim at all: those its routes cover, as `LIKE`
    /// patterns (`None`: a `*` route covers every topic). Messages of other topics are left
    /// to the relayers that cover them.
    pub fn covered_topics(&self) -> Option<&[String]> {
        self.covered.as_deref()
    }

    /// The routes as the coverage report gives them to the database: each route's topic
    /// as a `LIKE` pattern and the name of its destination (the name its circuit is
    /// reported under), in the configuration's order.
    pub fn route_report(&self) -> (Vec<String>, Vec<String>) {
        self.routes
            .like_patterns()
            .into_iter()
            .map(|(pattern, lane)| (pattern, self.lanes[lane].name.clone()))
            .unzip()
    }

    /// The routes' topic patterns as configured (`orders.*`), for the start-up line.
    pub fn route_topics(&self) -> Vec<String> {
        self.routes.described()
    }

    /// Notified (one stored wake-up for one waiter) when any destination's circuit
    /// changes state.
    pub fn circuit_changed(&self) -> Arc<Notify> {
        self.circuit_changed.clone()
    }

    /// The claim filter: the topics to leave unclaimed now, because their destination's
    /// circuit is open or it has no room for another batch.
    pub fn claim_filter(&self) -> ClaimFilter {
        self.routes.claim_filter(|d| {
            let lane = &self.lanes[d];
            lane.budget.available_permits() > 0 && lane.breaker.admits()
        })
    }

    /// Splits claimed messages into one part per destination; messages no route takes come
    /// back with their (permanent) outcome.
    pub fn split(
        &self,
        messages: Vec<ClaimedMessage>,
    ) -> (Vec<Part>, Vec<(ClaimedMessage, Outcome)>) {
        let mut parts: Vec<Part> = Vec::new();
        let mut unrouted = Vec::new();
        for m in messages {
            match self.routes.route(&m.topic) {
                Some(lane) => match parts.iter_mut().find(|p| p.lane == lane) {
                    Some(part) => part.messages.push(m),
                    None => parts.push(Part {
                        lane,
                        messages: vec![m],
                    }),
                },
                None => {
                    let reason = format!(
                        "no route for topic {:?}: add a [[routes]] entry (or a \"*\" default route)",
                        m.topic
                    );
                    unrouted.push((m, Outcome::Permanent { reason }));
                }
            }
        }
        (parts, unrouted)
    }

    /// The dispatch deadline of `part`'s destination.
    pub fn deadline(&self, part: &Part) -> Duration {
        self.lanes[part.lane].deadline
    }

    /// Waits until `part`'s destination has room for it; the permit is its place in the
    /// destination's budget until it is dropped (after the part is completed).
    pub async fn admit(&self, part: &Part) -> OwnedSemaphorePermit {
        place(&self.lanes[part.lane].budget).await
    }

    /// Waits until `part`'s destination has room for one more part whose first wave was
    /// answered and recorded and whose runs' later waves go on (at most `max_in_flight` of
    /// them, beside the budget of [`Dispatcher::admit`]); the permit is its place there, for
    /// which the part gives back its place in the budget, so that a long run, which sends
    /// one call at a time, does not keep the destination's next part waiting.
    pub async fn admit_runs(&self, part: &Part) -> OwnedSemaphorePermit {
        place(&self.lanes[part.lane].runs_budget).await
    }

    /// Publishes `part` through its destination's circuit and deadline, within `window`;
    /// one outcome per message, in order. Nothing is published while the circuit is open,
    /// one message when it probes, nothing once the window has closed; what is not
    /// published is [`Outcome::NotAttempted`].
    pub async fn publish(&self, part: &Part, window: &Window) -> Vec<Outcome> {
        self.publish_settling(part, window, None).await
    }

    /// [`Dispatcher::publish`], handing `settled` the outcomes that are final before the
    /// part is done, so that they can be recorded while the rest is still being delivered:
    /// when a part's runs go in waves, after the first wave, its outcomes of every unkeyed
    /// message and every key's last message in the part, once a later wave is to follow and
    /// the wave delivered or refused something (so that the circuit, which sees the whole
    /// part, rewrites none of them). The part's answer still holds every outcome, these
    /// included; `settled` is dropped unused when nothing settles early.
    pub async fn publish_settling(
        &self,
        part: &Part,
        window: &Window,
        settled: Option<oneshot::Sender<Settled>>,
    ) -> Vec<Outcome> {
        let lane = &self.lanes[part.lane];
        let messages = &part.messages[..];
        let held_back = |n: usize| {
            vec![
                Outcome::NotAttempted {
                    reason: format!("the circuit of destination {} is open", lane.name),
                };
                n
            ]
        };
        let Some(ticket) = lane.breaker.start() else {
            return held_back(messages.len());
        };
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + lane.deadline;
        let outcomes = if ticket.probe {
            let mut outcomes = held_back(messages.len());
            let i = probe(messages);
            let mut tried = match i {
                Some(i) => lane.attempt(&messages[i..=i], deadline, window).await,
                None => Vec::new(),
            };
            let tried_nos: Vec<i32> = i.map(|i| messages[i].attempt_no).into_iter().collect();
            lane.breaker.record(ticket, &mut tried, &tried_nos);
            if let (Some(i), Some(outcome)) = (i, tried.pop()) {
                outcomes[i] = outcome;
            }
            outcomes
        } else {
            let mut outcomes = match runs(messages) {
                None => lane.attempt(messages, deadline, window).await,
                Some(_) if lane.destination.keeps_key_order() => {
                    let mut outcomes = lane.attempt(messages, deadline, window).await;
                    hold_key_order(messages, &mut outcomes);
                    outcomes
                }
                Some(previous) => {
                    lane.attempt_in_runs(messages, &previous, deadline, window, settled)
                        .await
                }
            };
            let attempt_nos: Vec<i32> = messages.iter().map(|m| m.attempt_no).collect();
            lane.breaker.record(ticket, &mut outcomes, &attempt_nos);
            outcomes
        };
        telemetry::batch_dispatched(&lane.name, &lane.source, started.elapsed());
        outcomes
    }

    /// Each destination's name, circuit state and readiness (for /readyz), each asked at
    /// once and answered within its deadline or `within`, whichever is shorter (a probe has
    /// a timeout of its own). A destination whose circuit is not closed is not ready,
    /// whatever its connection says.
    pub async fn readiness(&self, within: Duration) -> Vec<(String, State, Result<(), String>)> {
        join_all(self.lanes.iter().map(|lane| async move {
            let state = lane.breaker.state();
            let limit = lane.deadline.min(within);
            let answer = tokio::time::timeout(limit, lane.destination.ready())
                .await
                .unwrap_or_else(|_| Err(format!("no answer within {} ms", limit.as_millis())));
            let ready = match (state, answer) {
                (_, Err(e)) => Err(e),
                (State::Closed, Ok(())) => Ok(()),
                (_, Ok(())) => Err(
                    "down: its circuit opened after repeated failures; a probe is sent after each cool-down"
                        .to_owned(),
                ),
            };
            (lane.name.clone(), state, ready)
        }))
        .await
    }
}

/// A place in one of a destination's allowances, waited for.
async fn place(allowance: &Arc<Semaphore>) -> OwnedSemaphorePermit {
    allowance
        .clone()
        .acquire_owned()
        .await
        .expect("a destination's budget is never closed")
}

/// How long after a call's dispatch deadline the destination may take to hand back its
/// outcomes (its calls cut off at the deadline included): a tenth of the deadline, from 20 ms
/// to 1 s.
fn answer_grace(deadline: Duration) -> Duration {
    (deadline / 10).clamp(Duration::from_millis(20), Duration::from_secs(1))
}

/// The half-open probe of `messages`: the first of the fewest-tried messages among those
/// no earlier message of the part holds back (unkeyed, or the first of their key). A
/// message that already failed is probed only when nothing fresher is there, so an outage
/// does not charge one message once per probe while others wait untried.
fn probe(messages: &[ClaimedMessage]) -> Option<usize> {
    let mut seen = HashSet::new();
    messages
        .iter()
        .enumerate()
        .filter(|(_, m)| m.order_key().is_none_or(|k| seen.insert(k)))
        .min_by_key(|(i, m)| (m.attempt_no, *i))
        .map(|(i, _)| i)
}

/// For each message of `messages`, the index of the message before it in its key on its
/// topic, if the part holds one (a run, see `claim_outbox_batch_seq`); `None` when no key
/// appears twice on one topic.
fn runs(messages: &[ClaimedMessage]) -> Option<Vec<Option<usize>>> {
    let mut last: HashMap<(&str, &str), usize> = HashMap::new();
    let mut previous = Vec::with_capacity(messages.len());
    let mut any = false;
    for (i, m) in messages.iter().enumerate() {
        let before = m.order_key().and_then(|k| last.insert(k, i));
        any |= before.is_some();
        previous.push(before);
    }
    any.then_some(previous)
}

/// The outcomes of a part known before it is done ([`Dispatcher::publish_settling`]): the
/// messages' indices in the part, and their outcomes, in the same order.
#[derive(Debug)]
pub struct Settled {
    pub indices: Vec<usize>,
    pub outcomes: Vec<Outcome>,
}

/// Hands `settled` the outcomes of the first `wave` of a part's runs that are final: of the
/// messages no later message of their key in the part follows (`followed`), once a later
/// wave is to come (a message's predecessor in `previous` was delivered). Only when the
/// wave delivered or refused a message: the circuit then rewrites none of the part's
/// outcomes; a wave that only failed has no later wave anyway.
fn settle_first_wave(
    wave: &[usize],
    followed: &[bool],
    previous: &[Option<usize>],
    outcomes: &[Option<Outcome>],
    settled: oneshot::Sender<Settled>,
) {
    let decisive = wave.iter().any(|&i| {
        matches!(
            outcomes[i],
            Some(Outcome::Delivered | Outcome::Permanent { .. })
        )
    });
    let more = previous.iter().enumerate().any(|(i, before)| {
        outcomes[i].is_none() && before.is_some_and(|b| outcomes[b] == Some(Outcome::Delivered))
    });
    if !decisive || !more {
        return;
    }
    let (indices, answered): (Vec<usize>, Vec<Outcome>) = wave
        .iter()
        .filter(|&&i| !followed[i])
        .filter_map(|&i| Some((i, outcomes[i].clone()?)))
        .unzip();
    if indices.is_empty() {
        return;
    }
    // The receiver is gone only when the part's delivery was given up.
    let _ = settled.send(Settled {
        indices,
        outcomes: answered,
    });
}

/// After a message of a key that was not delivered, a later message of the key that the
/// destination answered delivered (a service that takes a request's entries one by one
/// took it) is counted retryable: it was sent, so it is an attempt, and it is sent again
/// after its predecessor. Other outcomes stand.
fn hold_key_order(messages: &[ClaimedMessage], outcomes: &mut [Outcome]) {
    let mut failed: HashSet<(&str, &str)> = HashSet::new();
    for (m, outcome) in messages.iter().zip(outcomes.iter_mut()) {
        let Some(order) = m.order_key() else {
            continue;
        };
        let key = order.0;
        if *outcome != Outcome::Delivered {
            failed.insert(order);
        } else if failed.contains(&order) {
            *outcome = Outcome::Retryable {
                reason: format!(
                    "sent after an earlier message of key {key:?} that was not delivered: \
                     sent again after it"
                ),
                retry_after: None,
            };
        }
    }
}

impl Lane {
    /// One call of the destination with `messages`, answered by `deadline`; one outcome per
    /// message. Not made once `window` has closed or the deadline has passed: every message
    /// is given back.
    ///
    /// The destination gets the window of this call ([`Window::within`] the deadline): it
    /// starts nothing after the deadline (those messages are given back without an
    /// attempt) and bounds what it has in flight by it, so that it answers with one outcome
    /// per message: a message delivered before the deadline stays delivered, one sent and
    /// not answered is unanswered. A destination that has not answered a short grace after
    /// the deadline is cut off, and every message of the call is then unanswered.
    async fn attempt(
        &self,
        messages: &[ClaimedMessage],
        deadline: tokio::time::Instant,
        window: &Window,
    ) -> Vec<Outcome> {
        if !window.is_open() {
            return vec![Window::closed(); messages.len()];
        }
        let call = window.within(deadline.into_std());
        if let Err(not_sent) = call.check() {
            return vec![not_sent; messages.len()];
        }
        match &self.spans {
            None => self.call(messages, deadline, &call).await,
            Some(spans) => {
                let send = spans.start(&self.name, self.kind, messages);
                let outcomes = self.call(&send.messages, deadline, &call).await;
                send.end(&outcomes);
                outcomes
            }
        }
    }

    /// The call of [`Lane::attempt`] with the window of this call, its deadline (and grace),
    /// its panics and its count of outcomes.
    async fn call(
        &self,
        messages: &[ClaimedMessage],
        deadline: tokio::time::Instant,
        window: &Window,
    ) -> Vec<Outcome> {
        let answer = AssertUnwindSafe(tokio::time::timeout_at(
            deadline + answer_grace(self.deadline),
            self.destination.publish(messages, window),
        ))
        .catch_unwind()
        .await;
        let retryable = |reason: String| {
            vec![
                Outcome::Retryable {
                    reason,
                    retry_after: None
                };
                messages.len()
            ]
        };
        match answer {
            Ok(Ok(outcomes)) if outcomes.len() == messages.len() => outcomes,
            Ok(Ok(outcomes)) => retryable(format!(
                "destination {} returned {} outcomes for {} messages",
                self.name,
                outcomes.len(),
                messages.len()
            )),
            Ok(Err(_)) => {
                telemetry::dispatch_deadline(
                    &self.name,
                    &self.source,
                    self.deadline,
                    messages.len(),
                );
                // The destination was called: what it sent may have arrived.
                vec![
                    Outcome::Unanswered {
                        reason: format!(
                            "destination {} did not answer within {} ms",
                            self.name,
                            self.deadline.as_millis()
                        ),
                    };
                    messages.len()
                ]
            }
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                telemetry::dispatch_panicked(&self.name, &self.source, messages, &what);
                vec![
                    Outcome::NotAttempted {
                        reason: format!("destination {} panicked: {what}", self.name),
                    };
                    messages.len()
                ]
            }
        }
    }

    /// Delivers a part that holds runs, key order first: the destination is called with the
    /// first message of every key (and every unkeyed one), then with each key's next message
    /// whose predecessor was delivered, and so on, all by `deadline` and within `window`. A
    /// message whose predecessor was not delivered is not attempted: it is given back and
    /// waits for it. After the first wave, `settled` gets what of it is final (see
    /// [`Dispatcher::publish_settling`]).
    async fn attempt_in_runs(
        &self,
        messages: &[ClaimedMessage],
        previous: &[Option<usize>],
        deadline: tokio::time::Instant,
        window: &Window,
        mut settled: Option<oneshot::Sender<Settled>>,
    ) -> Vec<Outcome> {
        let mut followed = vec![false; messages.len()];
        for b in previous.iter().flatten() {
            followed[*b] = true;
        }
        let mut outcomes: Vec<Option<Outcome>> = vec![None; messages.len()];
        while outcomes.iter().any(Option::is_none) {
            let mut wave = Vec::new();
            for (i, before) in previous.iter().enumerate() {
                if outcomes[i].is_some() {
                    continue;
                }
                match before.map(|b| &outcomes[b]) {
                    None | Some(Some(Outcome::Delivered)) => wave.push(i),
                    Some(None) => {}
                    Some(Some(_)) => outcomes[i] = Some(messages[i].behind_undelivered()),
                }
            }
            if wave.is_empty() {
                continue;
            }
            let batch: Vec<ClaimedMessage> = wave.iter().map(|&i| messages[i].clone()).collect();
            let answered = self.attempt(&batch, deadline, window).await;
            for (&i, outcome) in wave.iter().zip(answered) {
                outcomes[i] = Some(outcome);
            }
            if let Some(settled) = settled.take() {
                settle_first_wave(&wave, &followed, previous, &outcomes, settled);
            }
        }
        outcomes.into_iter().flatten().collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        name: &str,
        kind: &str,
        destination: Arc<dyn Destination>,
        circuit: CircuitSettings,
        deadline: Duration,
        max_in_flight: usize,
        circuit_changed: Arc<Notify>,
        source: telemetry::Source,
    ) -> Self {
        Self {
            name: name.to_owned(),
            kind: DestinationConfig::KINDS
                .iter()
                .find(|k| **k == kind)
                .copied()
                .unwrap_or_default(),
            destination,
            breaker: circuit::Breaker::new(name, source.clone(), circuit, circuit_changed),
            budget: Arc::new(Semaphore::new(max_in_flight)),
            runs_budget: Arc::new(Semaphore::new(max_in_flight)),
            deadline,
            circuit,
            max_in_flight,
            source,
            spans: None,
        }
    }

    fn traced(mut self, spans: Option<Spans>) -> Self {
        self.spans = spans;
        self
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use futures_util::future::BoxFuture;

    use super::*;

    /// Delivers everything except payloads `fail`, which it finds retryable; remembers the
    /// payloads of every call. With `answers_late`, it answers its first call after the
    /// window of that call closed (the window is closed as it answers).
    #[derive(Default)]
    struct Scripted {
        calls: Mutex<Vec<Vec<String>>>,
        answers_late: bool,
        /// Declares that it keeps a key's order within a call.
        ordered: bool,
    }

    impl Destination for Scripted {
        fn publish<'a>(
            &'a self,
            batch: &'a [ClaimedMessage],
            window: &'a Window,
        ) -> BoxFuture<'a, Vec<Outcome>> {
            if self.answers_late {
                window.close();
            }
            let payloads: Vec<String> = batch
                .iter()
                .map(|m| String::from_utf8(m.payload.clone()).unwrap())
                .collect();
            let outcomes = payloads
                .iter()
                .map(|p| match p.as_str() {
                    "fail" => Outcome::Retryable {
                        reason: "refused for now".into(),
                        retry_after: None,
                    },
                    _ => Outcome::Delivered,
                })
                .collect();
            self.calls.lock().unwrap().push(payloads);
            Box::pin(async move { outcomes })
        }

        fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
            Box::pin(async { Ok(()) })
        }

        fn keeps_key_order(&self) -> bool {
            self.ordered
        }
    }

    fn message(key: Option<&str>, payload: &str) -> ClaimedMessage {
        let mut m = ClaimedMessage::example(serde_json::json!({}));
        m.key = key.map(str::to_owned);
        m.payload = payload.as_bytes().to_vec();
        m
    }

    #[tokio::test]
    async fn a_run_is_delivered_one_message_of_a_key_per_call_and_stops_at_a_failure() {
        let scripted = Arc::new(Scripted::default());
        let dispatcher = Dispatcher::single(
            "d",
            scripted.clone(),
            CircuitSettings {
                failures: 5,
                cooldown: Duration::from_secs(1),
            },
            Duration::from_secs(5),
            1,
        );
        let (mut parts, unrouted) = dispatcher.split(vec![
            message(Some("a"), "a1"),
            message(Some("a"), "fail"),
            message(Some("a"), "a3"),
            message(Some("b"), "b1"),
            message(None, "u"),
            message(Some("b"), "b2"),
            message(Some("b"), "b3"),
        ]);
        assert!(unrouted.is_empty());
        let outcomes = dispatcher
            .publish(&parts.remove(0), &Window::unbounded())
            .await;

        assert_eq!(
            *scripted.calls.lock().unwrap(),
            [vec!["a1", "b1", "u"], vec!["fail", "b2"], vec!["b3"]],
            "each key's next message only after its predecessor was delivered"
        );
        let kinds: Vec<&str> = outcomes
            .iter()
            .map(|o| match o {
                Outcome::Delivered => "delivered",
                Outcome::Retryable { .. } => "retryable",
                Outcome::Unanswered { .. } => "unanswered",
                Outcome::Permanent { .. } => "permanent",
                Outcome::NotAttempted { .. } => "not attempted",
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "delivered",
                "retryable",
                "not attempted",
                "delivered",
                "delivered",
                "delivered",
                "delivered"
            ]
        );
        assert!(
            matches!(&outcomes[2], Outcome::NotAttempted { reason } if reason.contains("key \"a\"")),
            "{:?}",
            outcomes[2]
        );
    }

    /// A key's messages on two topics in one part are two heads, not a run: they go in the
    /// same call, and the one on the second topic is delivered though the first failed.
    #[tokio::test]
    async fn a_keys_messages_on_two_topics_are_two_heads() {
        let scripted = Arc::new(Scripted::default());
        let dispatcher = Dispatcher::single(
            "d",
            scripted.clone(),
            CircuitSettings {
                failures: 5,
                cooldown: Duration::from_secs(1),
            },
            Duration::from_secs(5),
            1,
        );
        let mut on_b = message(Some("a"), "b1");
        on_b.topic = "b".into();
        let (mut parts, _) = dispatcher.split(vec![message(Some("a"), "fail"), on_b]);
        let outcomes = dispatcher
            .publish(&parts.remove(0), &Window::unbounded())
            .await;
        assert!(matches!(outcomes[0], Outcome::Retryable { .. }));
        assert_eq!(outcomes[1], Outcome::Delivered);
        assert_eq!(*scripted.calls.lock().unwrap(), [vec!["fail", "b1"]]);
    }

    /// After the first wave of a part's runs, what of it is final is handed over before the
    /// later waves: the unkeyed message and the key whose only message it was, not the
    /// heads of runs; the part's answer still holds every outcome.
    #[tokio::test]
    async fn the_first_wave_settles_what_no_later_message_of_its_key_follows() {
        let scripted = Arc::new(Scripted::default());
        let dispatcher = Dispatcher::single(
            "d",
            scripted.clone(),
            CircuitSettings {
                failures: 5,
                cooldown: Duration::from_secs(1),
            },
            Duration::from_secs(5),
            1,
        );
        let (mut parts, _) = dispatcher.split(vec![
            message(Some("a"), "a1"),
            message(Some("a"), "a2"),
            message(None, "u"),
            message(Some("c"), "fail"),
            message(Some("b"), "b1"),
        ]);
        let (settle, settled) = oneshot::channel();
        let outcomes = dispatcher
            .publish_settling(&parts.remove(0), &Window::unbounded(), Some(settle))
            .await;
        let settled = settled.await.expect("the first wave settles early");
        assert_eq!(settled.indices, [2, 3, 4]);
        assert_eq!(settled.outcomes[0], Outcome::Delivered);
        assert!(matches!(settled.outcomes[1], Outcome::Retryable { .. }));
        assert_eq!(settled.outcomes[2], Outcome::Delivered);
        assert_eq!(outcomes[0], Outcome::Delivered);
        assert_eq!(outcomes[1], Outcome::Delivered);
        assert_eq!(
            *scripted.calls.lock().unwrap(),
            [vec!["a1", "u", "fail", "b1"], vec!["a2"]]
        );

        // Nothing is settled early when no later wave follows (the run's head failed).
        let (mut parts, _) = dispatcher.split(vec![
            message(Some("a"), "fail"),
            message(Some("a"), "a2"),
            message(None, "u"),
        ]);
        let (settle, settled) = oneshot::channel();
        dispatcher
            .publish_settling(&parts.remove(0), &Window::unbounded(), Some(settle))
            .await;
        assert!(settled.await.is_err());
    }

    /// A destination that keeps a key's order within a call gets the whole part, runs
    /// included, in one call; a message of a key it answered delivered after one of the key
    /// that failed is counted retryable (it was sent, and is sent again after it), and
    /// unkeyed messages and other keys stand.
    #[tokio::test]
    async fn a_destination_keeping_key_order_gets_runs_in_one_call() {
        let scripted = Arc::new(Scripted {
            ordered: true,
            ..Scripted::default()
        });
        let dispatcher = Dispatcher::single(
            "d",
            scripted.clone(),
            CircuitSettings {
                failures: 5,
                cooldown: Duration::from_secs(1),
            },
            Duration::from_secs(5),
            1,
        );
        let (mut parts, _) = dispatcher.split(vec![
            message(Some("a"), "a1"),
            message(Some("a"), "fail"),
            message(Some("a"), "a3"),
            message(Some("b"), "b1"),
            message(None, "u"),
            message(Some("b"), "b2"),
        ]);
        let outcomes = dispatcher
            .publish(&parts.remove(0), &Window::unbounded())
            .await;
        assert_eq!(
            *scripted.calls.lock().unwrap(),
            [vec!["a1", "fail", "a3", "b1", "u", "b2"]],
            "one call with every run"
        );
        assert_eq!(outcomes[0], Outcome::Delivered);
        assert!(matches!(outcomes[1], Outcome::Retryable { .. }));
        assert!(
            matches!(&outcomes[2], Outcome::Retryable { reason, .. } if reason.contains("key \"a\"")),
            "{:?}",
            outcomes[2]
        );
        assert_eq!(
            outcomes[3..],
            [Outcome::Delivered, Outcome::Delivered, Outcome::Delivered]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_half_open_probe_is_a_fresh_head_and_the_rest_is_not_attempted() {
        let scripted = Arc::new(Scripted::default());
        let dispatcher = Dispatcher::single(
            "d",
            scripted.clone(),
            CircuitSettings {
                failures: 1,
                cooldown: Duration::from_millis(1),
            },
            Duration::from_secs(5),
            1,
        );
        let (mut parts, _) = dispatcher.split(vec![message(None, "fail")]);
        dispatcher
            .publish(&parts.remove(0), &Window::unbounded())
            .await;
        tokio::time::advance(Duration::from_millis(5)).await;

        let tried = |key: Option<&str>, payload: &str| {
            let mut m = message(key, payload);
            m.attempt_no = 2;
            m
        };
        // Enqueue order: a message that failed before, a run whose second message is
        // untried but held back by its tried head, then an untried head.
        let (mut parts, _) = dispatcher.split(vec![
            tried(None, "retried"),
            tried(Some("k"), "k1"),
            message(Some("k"), "k2"),
            message(Some("j"), "j1"),
        ]);
        let outcomes = dispatcher
            .publish(&parts.remove(0), &Window::unbounded())
            .await;
        assert_eq!(scripted.calls.lock().unwrap()[1], ["j1"]);
        assert_eq!(outcomes[3], Outcome::Delivered);
        assert!(
            outcomes[..3]
                .iter()
                .all(|o| matches!(o, Outcome::NotAttempted { .. })),
            "{outcomes:?}"
        );
    }

    #[tokio::test]
    async fn a_run_stops_at_the_first_message_sent_after_the_window_closed() {
        let scripted = Arc::new(Scripted {
            answers_late: true,
            ..Scripted::default()
        });
        let dispatcher = Dispatcher::single(
            "d",
            scripted.clone(),
            CircuitSettings {
                failures: 1,
                cooldown: Duration::from_secs(60),
            },
            Duration::from_secs(5),
            1,
        );
        let (mut parts, _) = dispatcher.split(vec![
            message(Some("a"), "a1"),
            message(Some("a"), "a2"),
            message(None, "u"),
            message(Some("a"), "a3"),
        ]);
        let window = Window::until(Instant::now() + Duration::from_secs(60));
        let outcomes = dispatcher.publish(&parts.remove(0), &window).await;

        assert_eq!(
            *scripted.calls.lock().unwrap(),
            [vec!["a1", "u"]],
            "nothing is sent after the window closed"
        );
        assert_eq!(outcomes[0], Outcome::Delivered);
        assert_eq!(outcomes[2], Outcome::Delivered);
        assert_eq!(outcomes[1], Window::closed());
        assert!(
            matches!(&outcomes[3], Outcome::NotAttempted { .. }),
            "{:?}",
            outcomes[3]
        );
        assert!(
            dispatcher.lanes[0].breaker.admits(),
            "messages given back unsent do not count against the circuit"
        );

        let (mut parts, _) = dispatcher.split(vec![message(None, "late")]);
        let outcomes = dispatcher.publish(&parts.remove(0), &window).await;
        assert_eq!(outcomes, [Window::closed()]);
        assert_eq!(scripted.calls.lock().unwrap().len(), 1, "no call at all");
    }
}

//! The worker pool of one process. It is thin on purpose: the claimer leases batches with
//! `claim_outbox_batch_seq`, the [`Dispatcher`] splits each batch into one part per destination,
//! and each part's outcomes go back in one `complete_outbox_batch` call as soon as its own
//! destination answered, where the database checks the leases. A part whose runs go in waves
//! may have two: what its first wave settled (the unkeyed messages, each key's last message of
//! the part) is recorded at once, while the later waves go on (the part then gives its place
//! in the destination's budget for one among the parts with only runs left), and the rest when
//! they end. Up to
//! `max_batches_in_flight` claimed batches wait to be taken by their destinations; each
//! destination then has its own budget, so the next batch is claimed while the current ones
//! are delivered, and a slow destination holds up only its own messages.
//!
//! Around that loop: the notification listener wakes the claimer when messages arrive
//! (polling is the fallback), the lease keeper extends batches still in flight at a third
//! of the lease, the janitor repairs expired leases, the circuits' states are reported to
//! the database as they change, and shutdown stops claiming, lets in-flight deliveries
//! finish until the deadline and releases what has no outcome.
//!
//! `leases.rs` keeps the book of leases in flight and the lease keeper; `complete.rs` is
//! the completer; `settings.rs` holds [`RelaySettings`], all the relay reads of the
//! process's configuration; `gate.rs` is the [`Gate`] that stops the claims of a relay
//! whose source's slot lease may have lapsed (many sources). Two helpers run beside the
//! loop for as long as it runs: `janitor.rs` (lease repair and the rotation of the
//! message slots), `circuit_reports.rs` (each destination's circuit state, reported to
//! the database for `status`) and `coverage_reports.rs` (the topics this relayer claims,
//! reported so that a topic none claims is named).

mod circuit_reports;
mod complete;
mod coverage_reports;
mod gate;
mod janitor;
mod leases;
mod settings;

pub use gate::Gate;
use leases::LeaseBook;
pub use settings::RelaySettings;

use std::collections::HashSet;
use std::ops::AddAssign;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::dispatch::{ClaimFilter, Dispatcher, Part, Settled};
use crate::message::{ClaimedMessage, Outcome, WorkerId};
use crate::store::{ClaimSizes, Store, StoreError, TopicFilter};
use crate::telemetry;

/// The SQL API function of a claim (the name of its span).
const CLAIM: &str = "claim_outbox_batch_seq";

/// What the relay did with the messages it claimed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub claimed: u64,
    pub delivered: u64,
    pub retried: u64,
    /// Dead-lettered: refused for good, or out of attempts.
    pub rejected: u64,
    /// Outcomes the database refused because the lease was no longer ours.
    pub lease_lost: u64,
    /// Given back at shutdown without an attempt.
    pub released: u64,
}

impl AddAssign for Summary {
    fn add_assign(&mut self, o: Summary) {
        self.claimed += o.claimed;
        self.delivered += o.delivered;
        self.retried += o.retried;
        self.rejected += o.rejected;
        self.lease_lost += o.lease_lost;
        self.released += o.released;
    }
}

/// After a wake-up, when an empty outbox is looked at again: each wait follows the previous
/// look. Producers of the same instant share one notification (the wake-up window in
/// `outbox.enqueue`), and one of them may commit just after the relayer looked: these find
/// its message without waiting for the poll, also when a busy machine delays that commit
/// by more than the first wait.
const RECHECKS_AFTER_WAKE: [Duration; 3] = [
    Duration::from_millis(25),
    Duration::from_millis(100),
    Duration::from_millis(400),
];

/// One process's relay; cheap to clone (shared state is behind `Arc`s).
#[derive(Clone)]
pub struct Relay {
    settings: Arc<RelaySettings>,
    store: Store,
    dispatcher: Arc<Dispatcher>,
    leases: Arc<LeaseBook>,
    wake: Arc<Notify>,
    /// Claims only while it is open (a source of a many-source fleet); None: always.
    gate: Option<Gate>,
    /// The source its metrics and logs name (none with one database).
    source: telemetry::Source,
}

impl Relay {
    pub fn new(settings: RelaySettings, store: Store, dispatcher: Arc<Dispatcher>) -> Self {
        Self {
            settings: Arc::new(settings),
            store,
            dispatcher,
            leases: Arc::default(),
            wake: Arc::new(Notify::new()),
            gate: None,
            source: telemetry::Source::default(),
        }
    }

    /// The same relay, claiming only while `gate` is open.
    pub fn with_gate(mut self, gate: Gate) -> Self {
        self.gate = Some(gate);
        self
    }

    /// The same relay, its metrics labelled and its logs marked with `source`.
    pub fn with_source(mut self, source: telemetry::Source) -> Self {
        self.source = source;
        self
    }

    fn worker(&self) -> &WorkerId {
        &self.settings.worker_id
    }

    /// How long after asking for a lease (a claim or an extension) this process still
    /// publishes under it: the lease minus a fifth as a safety margin. The database starts
    /// the lease when it runs the call, after it was sent, so by this process's monotonic
    /// clock the lease ends no sooner than the window does; the margin covers the time a
    /// publish takes once started. A process that was frozen or starved past the window
    /// does not publish (the lease may be someone else's by now): it gives the batch back.
    fn publish_window(&self) -> Duration {
        self.settings.lease() * 4 / 5
    }

    /// One step, for tests and tools: claim one batch, deliver it, complete it.
    pub async fn tick(&self) -> Result<Summary, StoreError> {
        let (asked, batch) = self.claim().await?;
        if batch.is_empty() {
            return Ok(Summary::default());
        }
        Ok(self
            .process(asked, batch, CancellationToken::new(), None)
            .await)
    }

    /// Claims a batch of what the destinations can take now; nothing, without asking the
    /// database, when none can.
    async fn claim(&self) -> Result<(Instant, Vec<ClaimedMessage>), StoreError> {
        let started = Instant::now();
        if self.gate.as_ref().is_some_and(|g| !g.is_open()) {
            return Ok((started, Vec::new()));
        }
        let held_back = match self.dispatcher.claim_filter() {
            ClaimFilter::Nothing => return Ok((started, Vec::new())),
            ClaimFilter::Everything => None,
            ClaimFilter::Except(patterns) => Some(patterns),
        };
        let asked_at = std::time::SystemTime::now();
        let claimed = self
            .store
            .claim(
                self.settings.batch_size,
                self.worker(),
                self.settings.lease_secs,
                self.settings.topics.as_deref(),
                TopicFilter {
                    include: self.dispatcher.covered_topics(),
                    exclude: held_back.as_deref(),
                },
                ClaimSizes {
                    max_batch_bytes: Some(self.settings.max_batch_bytes),
                    max_message_bytes: Some(self.settings.max_message_bytes),
                },
            )
            .await;
        if let Some(spans) = self.dispatcher.spans() {
            let worker = self.worker().as_str();
            match &claimed {
                Ok(batch) if batch.is_empty() => {}
                Ok(batch) => spans.leasing_call(CLAIM, worker, asked_at, batch.len(), None),
                Err(e) => spans.leasing_call(CLAIM, worker, asked_at, 0, Some(&e.to_string())),
            }
        }
        let batch = claimed?;
        if !batch.is_empty() {
            telemetry::batch_claimed(self.worker(), &self.source, &batch, started.elapsed());
        }
        Ok((started, batch))
    }

    /// Runs until `shutdown` is cancelled, then drains: in-flight batches get until
    /// `shutdown_timeout` to finish, after which their undelivered messages are released.
    pub async fn run(self, shutdown: CancellationToken) -> Summary {
        let abandon = CancellationToken::new();
        let background = CancellationToken::new();
        let mut helpers = JoinSet::new();
        {
            let (store, wake, stop) = (self.store.clone(), self.wake.clone(), background.clone());
            helpers.spawn(async move { store.listen(wake, stop).await });
        }
        helpers.spawn(self.clone().keep_leases(background.clone()));
        helpers.spawn(janitor::run(
            self.store.clone(),
            self.worker().clone(),
            self.source.clone(),
            self.settings.repair_interval,
            self.settings.repair_limit,
            shutdown.clone(),
        ));
        helpers.spawn(circuit_reports::run(
            self.store.clone(),
            self.worker().clone(),
            self.source.clone(),
            self.dispatcher.clone(),
            background.clone(),
        ));
        helpers.spawn(coverage_reports::run(
            self.store.clone(),
            self.worker().clone(),
            self.source.clone(),
            self.dispatcher.clone(),
            self.settings.topics.clone(),
            background.clone(),
        ));

        let permits = Arc::new(Semaphore::new(self.settings.max_batches_in_flight));
        let mut batches: JoinSet<Summary> = JoinSet::new();
        let mut total = Summary::default();
        let mut backoff = Duration::from_millis(100);
        // Set by a wake-up: the rechecks left (`RECHECKS_AFTER_WAKE`) while the outbox looks
        // empty.
        let mut rechecks = 0;
        loop {
            let permit = tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                permit = permits.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
            };
            while let Some(done) = batches.try_join_next() {
                total += self.joined(done);
            }
            match self.claim().await {
                Ok((_, batch)) if batch.is_empty() => {
                    drop(permit);
                    let wait = if rechecks > 0 {
                        rechecks -= 1;
                        RECHECKS_AFTER_WAKE[RECHECKS_AFTER_WAKE.len() - 1 - rechecks]
                    } else {
                        self.store.idle_wait(self.settings.poll_interval)
                    };
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = self.wake.notified() => rechecks = RECHECKS_AFTER_WAKE.len(),
                        () = tokio::time::sleep(wait) => {}
                    }
                }
                Ok((asked, batch)) => {
                    backoff = Duration::from_millis(100);
                    let relay = self.clone();
                    let abandon = abandon.clone();
                    batches.spawn(async move {
                        relay.process(asked, batch, abandon, Some(permit)).await
                    });
                }
                Err(e) => {
                    drop(permit);
                    telemetry::database_error(self.worker(), &self.source, "claim", &e);
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }

        tracing::info!(worker_id = %self.worker(), batches = batches.len(),
            deadline_ms = telemetry::millis(self.settings.shutdown_timeout),
            "stopped claiming; finishing in-flight deliveries");
        let deadline = tokio::time::sleep(self.settings.shutdown_timeout);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                done = batches.join_next() => match done {
                    Some(done) => total += self.joined(done),
                    None => break,
                },
                () = &mut deadline, if !abandon.is_cancelled() => {
                    tracing::warn!(worker_id = %self.worker(), batches = batches.len(),
                        "shutdown deadline reached; releasing undelivered messages");
                    abandon.cancel();
                }
            }
        }
        background.cancel();
        while helpers.join_next().await.is_some() {}
        tracing::info!(worker_id = %self.worker(), claimed = total.claimed, delivered = total.delivered,
            retried = total.retried, rejected = total.rejected, lease_lost = total.lease_lost,
            released = total.released, "relay stopped");
        total
    }

    /// The summary of a finished batch task; a task that panicked is logged and counted.
    fn joined(&self, done: Result<Summary, tokio::task::JoinError>) -> Summary {
        match done {
            Ok(summary) => summary,
            Err(e) => {
                if e.is_panic() {
                    telemetry::batch_task_panicked(self.worker(), &e.to_string());
                }
                Summary::default()
            }
        }
    }

    /// Delivers one claimed batch (claimed by a call sent at `asked`): refuses what cannot be
    /// published (a payload over `max_message_bytes`, a topic no route takes), and hands
    /// each destination its part. `handoff` is the batch's place among the claimed batches
    /// waiting for their destinations; it is given up once every part was taken.
    async fn process(
        &self,
        asked: Instant,
        batch: Vec<ClaimedMessage>,
        abandon: CancellationToken,
        handoff: Option<OwnedSemaphorePermit>,
    ) -> Summary {
        let claimed = batch.len() as u64;
        let (withheld, loaded): (Vec<_>, Vec<_>) =
            batch.into_iter().partition(|m| m.payload_withheld);
        let (parts, mut refused) = self.dispatcher.split(loaded);
        refused.extend(withheld.into_iter().map(|m| {
            let reason = format!(
                "payload is {} bytes, more than max_message_bytes ({}); not relayed",
                m.payload_bytes, self.settings.max_message_bytes
            );
            (m, Outcome::Permanent { reason })
        }));
        let handoff = handoff.map(Arc::new);
        let refused = async {
            if refused.is_empty() {
                return Summary::default();
            }
            let (messages, outcomes): (Vec<_>, Vec<_>) = refused.into_iter().unzip();
            self.report(&messages, outcomes).await
        };
        let parts = join_all(
            parts
                .into_iter()
                .map(|part| self.deliver(asked, part, abandon.clone(), handoff.clone())),
        );
        drop(handoff);
        let (mut summary, parts) = tokio::join!(refused, parts);
        for s in parts {
            summary += s;
        }
        summary.claimed = claimed;
        summary
    }

    /// Delivers one destination's part of a batch and reports its outcomes; releases it
    /// instead if `abandon` fires before the destination answers, or if its leases may have
    /// run out before it could be published.
    async fn deliver(
        &self,
        asked: Instant,
        part: Part,
        abandon: CancellationToken,
        handoff: Option<Arc<OwnedSemaphorePermit>>,
    ) -> Summary {
        let batch = &part.messages;
        let (book_id, window) = self.leases.insert(batch, asked, self.publish_window());
        telemetry::in_flight(&self.source, self.leases.messages());
        let admitted = tokio::select! {
            permit = self.dispatcher.admit(&part) => Some(permit),
            () = abandon.cancelled() => None,
        };
        drop(handoff);
        let summary = match admitted {
            None => {
                self.release(batch, "shutting down: its deliveries had not started")
                    .await
            }
            Some(_room) if !window.is_open() => {
                telemetry::stale_batch(self.worker(), batch, asked.elapsed());
                self.release(batch, "its publish window closed before dispatch")
                    .await
            }
            Some(mut room) => {
                self.leases
                    .dispatching(book_id, Instant::now() + self.dispatcher.deadline(&part));
                let (settle, settled) = oneshot::channel();
                let published = CancellationToken::new();
                let publishing = async {
                    let outcomes = tokio::select! {
                        outcomes = self.dispatcher.publish_settling(&part, &window, Some(settle)) => Some(outcomes),
                        () = abandon.cancelled() => None,
                    };
                    published.cancel();
                    outcomes
                };
                // The part's place at its destination: once its first wave is recorded and
                // only its runs' later waves go on, a place among the parts that only have
                // runs left, for which it gives back its place in the budget.
                let early = async {
                    let early = self.complete_early(book_id, batch, settled).await;
                    if early.is_some() {
                        tokio::select! {
                            biased;
                            () = published.cancelled() => {}
                            runs = self.dispatcher.admit_runs(&part) => {
                                drop(std::mem::replace(&mut room, runs));
                                // Room at the destination.
                                self.wake.notify_one();
                            }
                        }
                    }
                    early
                };
                let (outcomes, early) = tokio::join!(publishing, early);
                let (mut summary, done) = early.unwrap_or_default();
                // What was recorded early is never completed or released again.
                let rest = |i: &usize| !done.contains(i);
                summary += match outcomes {
                    Some(outcomes) => {
                        let margin = self.settings.lease() - self.publish_window();
                        telemetry::lease_left(self.leases.lease_left(book_id, margin));
                        if done.is_empty() {
                            self.complete(batch, outcomes).await
                        } else {
                            let (messages, outcomes): (Vec<_>, Vec<_>) = batch
                                .iter()
                                .cloned()
                                .zip(outcomes)
                                .enumerate()
                                .filter(|(i, _)| rest(i))
                                .map(|(_, pair)| pair)
                                .unzip();
                            self.complete(&messages, outcomes).await
                        }
                    }
                    None => {
                        let messages: Vec<ClaimedMessage> = batch
                            .iter()
                            .enumerate()
                            .filter(|(i, _)| rest(i))
                            .map(|(_, m)| m.clone())
                            .collect();
                        self.release(&messages, "the shutdown deadline passed before delivery")
                            .await
                    }
                };
                // The part's place is given back once every outcome is recorded.
                drop(room);
                summary
            }
        };
        self.leases.remove(book_id);
        telemetry::in_flight(&self.source, self.leases.messages());
        // Room at the destination, and completing a keyed message makes the next one of
        // its key claimable.
        self.wake.notify_one();
        summary
    }

    /// Records the outcomes of batch `book_id` (booked as `batch`) that its dispatch hands
    /// `settled` before the part is done (the first wave of its runs), while the later waves
    /// go on; their leases leave the book first, so the lease keeper no longer extends them.
    /// The summary and the indices in `batch` of what was recorded (never to be completed
    /// again); `None` when nothing settled early.
    async fn complete_early(
        &self,
        book_id: u64,
        batch: &[ClaimedMessage],
        settled: oneshot::Receiver<Settled>,
    ) -> Option<(Summary, HashSet<usize>)> {
        let Settled { indices, outcomes } = settled.await.ok()?;
        let messages: Vec<ClaimedMessage> = indices.iter().map(|&i| batch[i].clone()).collect();
        self.leases.settled(book_id, &messages);
        telemetry::in_flight(&self.source, self.leases.messages());
        let summary = self.complete(&messages, outcomes).await;
        // Completing a key's last message of the batch makes its next one claimable.
        self.wake.notify_one();
        Some((summary, indices.into_iter().collect()))
    }
}

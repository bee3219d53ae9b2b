//! The completer: a batch's outcomes go back to the database in one
//! `complete_outbox_batch` call, with the retry time of each retryable one (backoff with
//! full jitter); what was not attempted is released without an attempt. Each outcome is
//! counted and logged as it is recorded.

use std::time::{Duration, Instant};

use super::{Relay, Summary};
use crate::message::{AttemptState, ClaimedMessage, Completion, LeaseToken, OutboxId, Outcome};
use crate::store::StoreError;
use crate::{retry, telemetry};

/// The SQL API function of a completion (the name of its span).
const COMPLETE: &str = "complete_outbox_batch";

impl Relay {
    /// Reports a batch's outcomes; gives back without an attempt what was not attempted.
    pub(super) async fn complete(
        &self,
        batch: &[ClaimedMessage],
        outcomes: Vec<Outcome>,
    ) -> Summary {
        if !outcomes
            .iter()
            .any(|o| matches!(o, Outcome::NotAttempted { .. }))
        {
            return self.report(batch, outcomes).await;
        }
        let mut given_back = Vec::new();
        let mut reason = String::new();
        let mut attempted = (Vec::new(), Vec::new());
        for (m, outcome) in batch.iter().zip(outcomes) {
            match outcome {
                Outcome::NotAttempted { reason: why } => {
                    if reason.is_empty() {
                        reason = why;
                    }
                    given_back.push(m.clone());
                }
                outcome => {
                    attempted.0.push(m.clone());
                    attempted.1.push(outcome);
                }
            }
        }
        let mut summary = self.release(&given_back, &reason).await;
        if !attempted.0.is_empty() {
            summary += self.report(&attempted.0, attempted.1).await;
        }
        summary
    }

    /// Records attempts for every outcome of a batch in one call. A failed call is retried
    /// until the leases would have expired anyway (after that the janitor requeues them:
    /// at-least-once).
    pub(super) async fn report(&self, batch: &[ClaimedMessage], outcomes: Vec<Outcome>) -> Summary {
        debug_assert_eq!(
            batch.len(),
            outcomes.len(),
            "dispatch answers one outcome per message"
        );
        let now = chrono::Utc::now();
        let mut delays = vec![Duration::ZERO; batch.len()];
        let completions: Vec<Completion> = batch
            .iter()
            .zip(&outcomes)
            .zip(delays.iter_mut())
            .map(|((m, outcome), delay)| {
                let mut retrying = |reason: &String, hint: Option<Duration>| {
                    *delay = retry::delay(&self.settings.retry, m.attempt_no, hint);
                    let at = now + chrono::Duration::from_std(*delay).unwrap_or_default();
                    (AttemptState::Retryable, Some(reason.clone()), Some(at))
                };
                let (state, error, retry_at) = match outcome {
                    Outcome::Delivered => (AttemptState::Dispatched, None, None),
                    Outcome::Retryable {
                        reason,
                        retry_after,
                    } => retrying(reason, *retry_after),
                    Outcome::Unanswered { reason } => retrying(reason, None),
                    Outcome::Permanent { reason } => {
                        (AttemptState::Failed, Some(reason.clone()), None)
                    }
                    Outcome::NotAttempted { .. } => {
                        unreachable!("complete() gives these back before reporting")
                    }
                };
                Completion {
                    id: m.id,
                    lease_token: m.lease_token,
                    state,
                    error,
                    retry_at,
                }
            })
            .collect();

        let expires = batch
            .iter()
            .map(|m| m.lease_expires_at)
            .min()
            .unwrap_or(now);
        let mut backoff = Duration::from_millis(50);
        let results = loop {
            let started = Instant::now();
            let asked_at = std::time::SystemTime::now();
            let answer = self.store.complete(self.worker(), &completions).await;
            if let Some(spans) = self.dispatcher.spans() {
                let error = answer.as_ref().err().map(ToString::to_string);
                let worker = self.worker().as_str();
                spans.leasing_call(COMPLETE, worker, asked_at, batch.len(), error.as_deref());
            }
            match answer {
                Ok(results) => {
                    telemetry::batch_completed(started.elapsed());
                    break results;
                }
                Err(e) => {
                    telemetry::database_error(self.worker(), &self.source, "complete", &e);
                    let retryable = !matches!(e, StoreError::InvalidArgument(_));
                    if !retryable
                        || chrono::Utc::now()
                            + chrono::Duration::from_std(backoff).unwrap_or_default()
                            >= expires
                    {
                        tracing::error!(worker_id = %self.worker(), messages = batch.len(), error = %e,
                            "could not report outcomes before the leases expire; repair will requeue them");
                        return Summary::default();
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        };

        let mut summary = Summary::default();
        let mut delivered = Vec::with_capacity(batch.len());
        for (((m, outcome), result), delay) in
            batch.iter().zip(&outcomes).zip(&results).zip(&delays)
        {
            if result.lease_lost {
                summary.lease_lost += 1;
                telemetry::lease_lost(self.worker(), &self.source, m);
                continue;
            }
            match outcome {
                Outcome::Delivered => {
                    summary.delivered += 1;
                    delivered.push(m);
                }
                Outcome::Retryable { reason, .. } | Outcome::Unanswered { reason }
                    if result.dead_lettered =>
                {
                    summary.rejected += 1;
                    telemetry::retries_exhausted(self.worker(), &self.source, m, reason);
                }
                Outcome::Retryable { reason, .. } | Outcome::Unanswered { reason } => {
                    summary.retried += 1;
                    telemetry::retry_scheduled(self.worker(), &self.source, m, reason, *delay);
                }
                Outcome::Permanent { reason } => {
                    summary.rejected += 1;
                    telemetry::rejected(self.worker(), &self.source, m, reason);
                }
                Outcome::NotAttempted { .. } => {}
            }
        }
        telemetry::delivered(self.worker(), &self.source, delivered.into_iter());
        summary
    }

    /// Gives a batch back without an attempt, for `reason` (a shutdown deadline, a closed
    /// publish window, an open circuit, a run stopped by its predecessor's failure).
    pub(super) async fn release(&self, batch: &[ClaimedMessage], reason: &str) -> Summary {
        if batch.is_empty() {
            return Summary::default();
        }
        let leases: Vec<(OutboxId, LeaseToken)> =
            batch.iter().map(|m| (m.id, m.lease_token)).collect();
        match self.store.release(self.worker(), &leases).await {
            Ok(n) => {
                telemetry::released(self.worker(), &self.source, batch, n, reason);
                Summary {
                    released: u64::from(n.unsigned_abs()),
                    ..Summary::default()
                }
            }
            Err(e) => {
                telemetry::database_error(self.worker(), &self.source, "release", &e);
                Summary::default()
            }
        }
    }
}

//! Reports each destination's circuit state to the database (`outbox.report_circuits`), so
//! that `outbox-relay status` shows the fleet's circuits: a circuit lives in the memory of
//! each relayer, and an operator asks the database.
//!
//! A report is written when a circuit changes state and renewed a third of the way to its
//! expiry ([`TTL`]), never per claim or batch, so its writes follow the destinations'
//! health, not the traffic. A relayer that stops renewing (killed, frozen, cut off from the
//! database) leaves reports that turn stale when they expire; one that stops cleanly
//! deletes its own.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::dispatch::Dispatcher;
use crate::message::WorkerId;
use crate::store::{CircuitReport, Store};
use crate::telemetry;

/// How long a report holds without being renewed.
pub const TTL: Duration = Duration::from_secs(90);

/// How often unchanged reports are renewed: three renewals may fail before they expire.
const RENEW: Duration = Duration::from_secs(30);

/// After a failed report, the next try.
const RETRY: Duration = Duration::from_secs(5);

/// Reports `dispatcher`'s circuits as `worker` until `shutdown`, then deletes its reports.
pub async fn run(
    store: Store,
    worker: WorkerId,
    source: telemetry::Source,
    dispatcher: Arc<Dispatcher>,
    shutdown: CancellationToken,
) {
    let changed = dispatcher.circuit_changed();
    // What the database holds and when it was written; `None` until the first report.
    let mut reported: Option<(Vec<CircuitReport>, Instant)> = None;
    loop {
        let circuits: Vec<CircuitReport> = dispatcher
            .circuits()
            .into_iter()
            .map(|(destination, state, since)| CircuitReport {
                destination,
                state: state.as_str().to_owned(),
                since,
            })
            .collect();
        let due = reported
            .as_ref()
            .is_none_or(|(held, at)| *held != circuits || at.elapsed() >= RENEW);
        let wait = if due {
            match store.report_circuits(&worker, &circuits, TTL).await {
                Ok(()) => {
                    reported = Some((circuits, Instant::now()));
                    RENEW
                }
                Err(e) => {
                    telemetry::database_error(&worker, &source, "report_circuits", &e);
                    RETRY
                }
            }
        } else {
            reported
                .as_ref()
                .map_or(RETRY, |(_, at)| RENEW.saturating_sub(at.elapsed()))
        };
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = changed.notified() => {}
            () = tokio::time::sleep(wait) => {}
        }
    }
    // Stopping: this process's circuits hold nothing back any more.
    if let Err(e) = store.report_circuits(&worker, &[], TTL).await {
        telemetry::database_error(&worker, &source, "report_circuits", &e);
    }
}

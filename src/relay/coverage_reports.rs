//! Reports the topics this relayer claims, and the destination of each of its routes, to
//! the database (`outbox.report_coverage`), so that a topic no running relayer claims, or
//! one every relayer claiming it leaves out while its destination's circuit is open, can be
//! named (`outbox.stalled_topics`, read by the observer and `outbox-relay status`): which
//! topics a relayer claims lives in its configuration, and an operator asks the database.
//!
//! The report is written at start and renewed a third of the way to its expiry
//! ([`TTL`](super::circuit_reports::TTL), as the circuits' reports), never per claim or
//! batch. A relayer that stops renewing (killed, frozen, cut off from the database) leaves
//! a report that expires; one that stops cleanly withdraws it.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::circuit_reports::TTL;
use crate::dispatch::Dispatcher;
use crate::message::WorkerId;
use crate::store::Store;
use crate::telemetry;

/// How often the report is renewed: three renewals may fail before it expires.
const RENEW: Duration = Duration::from_secs(30);

/// After a failed report, the next try.
const RETRY: Duration = Duration::from_secs(5);

/// Reports what `worker` claims (the topics `dispatcher`'s routes cover, within `topics`)
/// until `shutdown`, then withdraws the report.
pub async fn run(
    store: Store,
    worker: WorkerId,
    source: telemetry::Source,
    dispatcher: Arc<Dispatcher>,
    topics: Option<Vec<String>>,
    shutdown: CancellationToken,
) {
    let include = dispatcher.covered_topics();
    let (patterns, destinations) = dispatcher.route_report();
    let routes = (patterns.as_slice(), destinations.as_slice());
    loop {
        let wait = match store
            .report_coverage(&worker, include, topics.as_deref(), routes, TTL)
            .await
        {
            Ok(()) => RENEW,
            Err(e) => {
                telemetry::database_error(&worker, &source, "report_coverage", &e);
                RETRY
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(wait) => {}
        }
    }
    // Stopping: this process claims nothing any more.
    if let Err(e) = store
        .report_coverage(&worker, include, topics.as_deref(), routes, Duration::ZERO)
        .await
    {
        telemetry::database_error(&worker, &source, "report_coverage", &e);
    }
}

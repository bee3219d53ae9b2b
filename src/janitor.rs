//! Periodic lease repair, so that messages whose worker died (or froze past its lease) are
//! requeued, or dead-lettered when that was their last attempt. Every process runs it;
//! `repair_expired_leases` takes its turn by locking the `repair` row of `outbox.turns`
//! (`FOR UPDATE SKIP LOCKED`), so one pass runs at a time across the fleet and the others
//! return at once with nothing done. The interval is jittered so that a fleet started
//! together does not repair in lockstep.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::message::WorkerId;
use crate::store::Store;
use crate::telemetry;

/// Repairs every `interval` (±20%) until `shutdown`; a pass that hit `limit` is followed
/// by another at once.
pub async fn run(
    store: Store,
    worker: WorkerId,
    source: telemetry::Source,
    interval: Duration,
    limit: i32,
    shutdown: CancellationToken,
) {
    loop {
        let jittered = interval.mul_f64(rand::random_range(0.8..=1.2));
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(jittered) => {}
        }
        loop {
            match store.repair(limit).await {
                Ok(repair) => {
                    telemetry::repaired(&worker, repair.requeued, repair.dead_lettered);
                    if repair.requeued + repair.dead_lettered < limit {
                        break;
                    }
                }
                Err(e) => {
                    telemetry::database_error(&worker, &source, "repair", &e);
                    break;
                }
            }
        }
    }
}

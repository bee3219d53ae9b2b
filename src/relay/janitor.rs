//! The fleet's periodic maintenance, run by every process:
//! - lease repair, so that messages whose worker died (or froze past its lease) are
//!   requeued, or dead-lettered when that was their last attempt;
//! - the rotation of `outbox.messages`' slots, so that a slot in which nothing is pending
//!   is truncated and producers move on to an empty one (`rotate_messages`).
//!
//! Each takes its turn in the database by locking a row of `outbox.turns` (`FOR UPDATE
//! SKIP LOCKED`), so one pass of each runs at a time across the fleet and the others
//! return at once with nothing done. The intervals are jittered so that a fleet started
//! together does not run them in lockstep.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::message::WorkerId;
use crate::store::Store;
use crate::telemetry;

/// How often each process asks for a rotation (±20%). A slot stays current for the
/// database's period (30 s); asking more often keeps a slot's truncation close to the
/// moment its last message is done.
pub const ROTATE_INTERVAL: Duration = Duration::from_secs(5);

/// Repairs every `interval` (±20%) and rotates every [`ROTATE_INTERVAL`] until
/// `shutdown`; a repair pass that hit `limit` is followed by another at once.
pub async fn run(
    store: Store,
    worker: WorkerId,
    source: telemetry::Source,
    interval: Duration,
    limit: i32,
    shutdown: CancellationToken,
) {
    tokio::join!(
        repair(&store, &worker, &source, interval, limit, &shutdown),
        rotate(&store, &worker, &source, &shutdown),
    );
}

async fn repair(
    store: &Store,
    worker: &WorkerId,
    source: &telemetry::Source,
    interval: Duration,
    limit: i32,
    shutdown: &CancellationToken,
) {
    while pause(interval, shutdown).await {
        loop {
            match store.repair(limit).await {
                Ok(repair) => {
                    telemetry::repaired(worker, repair.requeued, repair.dead_lettered);
                    if repair.requeued + repair.dead_lettered < limit {
                        break;
                    }
                }
                Err(e) => {
                    telemetry::database_error(worker, source, "repair", &e);
                    break;
                }
            }
        }
    }
}

async fn rotate(
    store: &Store,
    worker: &WorkerId,
    source: &telemetry::Source,
    shutdown: &CancellationToken,
) {
    while pause(ROTATE_INTERVAL, shutdown).await {
        match store.rotate().await {
            Ok(r) => telemetry::rotated(
                worker,
                source,
                r.current_slot,
                r.truncated_slot,
                r.busy_slot,
                r.pinned_slots,
            ),
            Err(e) => telemetry::database_error(worker, source, "rotate", &e),
        }
    }
}

/// Sleeps `interval` ±20%; false once `shutdown` is cancelled.
async fn pause(interval: Duration, shutdown: &CancellationToken) -> bool {
    let jittered = interval.mul_f64(rand::random_range(0.8..=1.2));
    tokio::select! {
        () = shutdown.cancelled() => false,
        () = tokio::time::sleep(jittered) => true,
    }
}

//! The measuring destination every shape drains into: it counts deliveries (wrapping a
//! real destination, or acknowledging at once), waits for a target with progress on a
//! terminal and a stall limit, and notes when each message was acknowledged for latency.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use futures_util::future::BoxFuture;
use tokio::sync::Notify;
use uuid::Uuid;

use outbox_relay::destination::{Destination, Window};
use outbox_relay::message::{ClaimedMessage, Outcome};

use super::lock;

/// A null destination that counts deliveries and, while recording, notes when each
/// message was acknowledged.
pub(super) struct Recorder {
    /// The destination measured; `None` acknowledges everything at once.
    pub(super) inner: Option<Arc<dyn Destination>>,
    pub(super) delivered: AtomicU64,
    /// The delivered count when the current target was set (for progress).
    pub(super) from: AtomicU64,
    pub(super) target: AtomicU64,
    pub(super) done: Notify,
    pub(super) acks: Mutex<Vec<(Uuid, Instant)>>,
    pub(super) recording: std::sync::atomic::AtomicBool,
    /// When the last delivery of an unkeyed message was acknowledged (how long a drain's
    /// keyed runs outlast its unkeyed messages).
    pub(super) last_unkeyed: Mutex<Option<Instant>>,
}

impl Recorder {
    pub(super) fn new(inner: Option<Arc<dyn Destination>>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            delivered: AtomicU64::new(0),
            from: AtomicU64::new(0),
            target: AtomicU64::new(u64::MAX),
            done: Notify::new(),
            acks: Mutex::new(Vec::new()),
            recording: std::sync::atomic::AtomicBool::new(false),
            last_unkeyed: Mutex::new(None),
        })
    }

    /// The delivered count `n` more deliveries from now; pass it to [`Recorder::reached`].
    pub(super) fn target(&self, n: u64) -> u64 {
        let from = self.delivered.load(Ordering::SeqCst);
        let target = from + n;
        self.from.store(from, Ordering::SeqCst);
        self.target.store(target, Ordering::SeqCst);
        target
    }

    /// Resolves once `target` messages have been delivered in all, showing how far `what`
    /// has got on a terminal; fails when no message has been delivered for `STALL_LIMIT`
    /// (the relays' log says why), so that a stuck run ends instead of waiting forever.
    pub(super) async fn reached(&self, target: u64, what: &str) -> Result<()> {
        let from = self.from.load(Ordering::SeqCst);
        let mut shown = Instant::now();
        let (mut last, mut moved) = (self.delivered.load(Ordering::SeqCst), Instant::now());
        loop {
            let now = self.delivered.load(Ordering::SeqCst);
            if now >= target {
                break;
            }
            if now != last {
                (last, moved) = (now, Instant::now());
            } else if moved.elapsed() >= STALL_LIMIT {
                progress("");
                bail!(
                    "{what}: no message delivered for {} s, {} of {} still undelivered",
                    STALL_LIMIT.as_secs(),
                    target - now,
                    target - from
                );
            }
            if shown.elapsed() >= PROGRESS_EVERY {
                progress(&format!(
                    "{what}: {} of {}",
                    now.saturating_sub(from),
                    target - from
                ));
                shown = Instant::now();
            }
            let notified = self.done.notified();
            if self.delivered.load(Ordering::SeqCst) >= target {
                break;
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
        }
        progress("");
        Ok(())
    }
}

/// How long [`Recorder::reached`] waits without a delivery before it gives up.
const STALL_LIMIT: Duration = Duration::from_secs(120);

const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// Shows `line` in place of the previous one on stderr when it is a terminal (the figures
/// go to stdout, terminal or not); an empty line clears it.
pub(super) fn progress(line: &str) {
    use std::io::{IsTerminal, Write};
    let mut err = std::io::stderr();
    if err.is_terminal() {
        let _ = write!(err, "\r\x1b[2K{line}");
        let _ = err.flush();
    }
}

impl Destination for Recorder {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let outcomes = match &self.inner {
                Some(destination) => destination.publish(batch, window).await,
                None => vec![Outcome::Delivered; batch.len()],
            };
            let now = Instant::now();
            let delivered: Vec<Uuid> = batch
                .iter()
                .zip(&outcomes)
                .filter(|(_, o)| **o == Outcome::Delivered)
                .map(|(m, _)| m.id.0)
                .collect();
            if batch
                .iter()
                .zip(&outcomes)
                .any(|(m, o)| m.key.is_none() && *o == Outcome::Delivered)
            {
                *lock(&self.last_unkeyed) = Some(now);
            }
            if self.recording.load(Ordering::Relaxed) {
                lock(&self.acks).extend(delivered.iter().map(|id| (*id, now)));
            }
            let n = delivered.len() as u64;
            let total = self.delivered.fetch_add(n, Ordering::SeqCst) + n;
            if total >= self.target.load(Ordering::SeqCst) {
                self.done.notify_waiters();
            }
            outcomes
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }

    /// The measured destination's: the dispatch layer gives it a key's run in one call
    /// only when it keeps the order.
    fn keeps_key_order(&self) -> bool {
        self.inner.as_ref().is_some_and(|d| d.keeps_key_order())
    }
}

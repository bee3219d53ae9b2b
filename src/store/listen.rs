//! The notification listener: one dedicated connection (outside the pool) that `LISTEN`s
//! for `outbox.enqueue`'s notifications and wakes the claimer, so that a message is claimed
//! when it arrives rather than at the next poll.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

use super::{Result, Store, StoreError};

/// Channel that `outbox.enqueue` notifies when a message is ready.
pub const NOTIFY_CHANNEL: &str = "outbox_new";

impl Store {
    /// Keeps a dedicated connection listening on [`NOTIFY_CHANNEL`] and calls
    /// `wake.notify_one()` for every notification, reconnecting (with backoff) when the
    /// connection drops, until `shutdown` is cancelled. After every (re)connect it wakes once,
    /// since notifications sent while disconnected are lost.
    pub async fn listen(&self, wake: Arc<Notify>, shutdown: CancellationToken) {
        let mut backoff = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            let ended = tokio::select! {
                ended = self.listen_once(&wake) => ended,
                () = shutdown.cancelled() => return,
            };
            if let Err(e) = ended {
                tracing::warn!(error = %e, retry_in_ms = crate::telemetry::millis(backoff),
                    "notification listener lost its connection; polling until it is back");
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = shutdown.cancelled() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(10));
        }
    }

    async fn listen_once(&self, wake: &Arc<Notify>) -> Result<()> {
        let (client, mut connection) = self
            .target
            .config
            .connect(self.target.tls.clone())
            .await
            .map_err(|e| StoreError::connect_failed(&self.target, e))?;
        let forward = wake.clone();
        let mut driver = tokio::spawn(async move {
            let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                if let AsyncMessage::Notification(_) = message? {
                    forward.notify_one();
                }
            }
            Ok::<(), tokio_postgres::Error>(())
        });
        client
            .batch_execute(&format!("LISTEN {NOTIFY_CHANNEL}"))
            .await?;
        wake.notify_one();
        let ended = (&mut driver).await;
        drop(client);
        match ended {
            Ok(result) => Ok(result?),
            Err(e) => Err(StoreError::Unavailable {
                target: self.target.describe(),
                reason: "the notification listener's task ended".to_owned(),
                source: Box::new(e),
            }),
        }
    }
}

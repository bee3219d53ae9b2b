//! The notification listener: one dedicated connection (outside the pool, to `listen_url`
//! when one is given) that `LISTEN`s for `outbox.enqueue`'s notifications and wakes the
//! claimer, so that a message is claimed when it arrives rather than at the next poll.
//!
//! A `LISTEN` can succeed and hear nothing: through a transaction pooler the session that
//! listened is handed to other clients between transactions, and notifications go to
//! whoever holds it. So the listener tests itself, at start and every
//! [`CHECK_INTERVAL`]: it sends a notification on a channel of its own through the pool and
//! waits [`CHECK_TIMEOUT`] for its connection to hear it. The outcome is
//! [`ListenerHealth`]: the `outbox_listener_healthy` gauge, `/readyz`'s body, and the
//! claimer's poll interval (at most [`DEAF_POLL_INTERVAL`] while wake-ups are not heard).

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio_postgres::AsyncMessage;
use tokio_postgres::types::Type;
use tokio_util::sync::CancellationToken;

use super::{Result, Store, StoreError};

/// Channel that `outbox.enqueue` notifies when a message is ready (in schema `outbox`; the
/// outbox in schema NAME notifies `NAME_new`).
pub const NOTIFY_CHANNEL: &str = "outbox_new";
/// How often the listener checks that it hears its own notification.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(30);
/// How long a check waits for its notification before calling the listener deaf.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// The claimer's longest wait for work while wake-ups are not heard (the poll interval
/// when it is shorter).
pub const DEAF_POLL_INTERVAL: Duration = Duration::from_millis(200);

/// Whether wake-ups reach this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListenerHealth {
    /// Not checked yet (or not listening: verbs other than `run`).
    Unknown,
    /// The last check heard its own notification.
    Hears,
    /// The listening connection is up but did not hear the last check: a transaction
    /// pooler between it and Postgres.
    Deaf,
    /// The listening connection is down; it reconnects with backoff.
    Down,
}

impl ListenerHealth {
    /// One line for `/readyz` and logs: what is wrong and what to do.
    pub fn describe(self) -> &'static str {
        match self {
            ListenerHealth::Unknown => "not checked yet",
            ListenerHealth::Hears => "ok (the listener hears its own test notification)",
            ListenerHealth::Deaf => {
                "deaf: the LISTEN connection did not hear its own test notification (a \
                 transaction pooler?); polling at most every 200 ms; set listen_url \
                 (OUTBOX_LISTEN_URL) to a direct connection"
            }
            ListenerHealth::Down => "down: the LISTEN connection is lost; reconnecting, polling",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => ListenerHealth::Hears,
            2 => ListenerHealth::Deaf,
            3 => ListenerHealth::Down,
            _ => ListenerHealth::Unknown,
        }
    }
}

/// The listener's state, shared by the clones of a store.
#[derive(Default)]
pub(super) struct State {
    health: AtomicU8,
    /// Sequence number of the last test notification sent, and of the last one heard.
    sent: AtomicU64,
    heard: AtomicU64,
    heard_signal: Notify,
}

impl Store {
    /// Whether wake-ups reach this process (see [`ListenerHealth`]).
    pub fn listener_health(&self) -> ListenerHealth {
        ListenerHealth::from_u8(self.listener.health.load(Ordering::Relaxed))
    }

    /// The claimer's wait for work when the outbox looks empty: `poll_interval`, or at
    /// most [`DEAF_POLL_INTERVAL`] while wake-ups are not known to be heard.
    pub fn idle_wait(&self, poll_interval: Duration) -> Duration {
        match self.listener_health() {
            ListenerHealth::Hears | ListenerHealth::Unknown => poll_interval,
            ListenerHealth::Deaf | ListenerHealth::Down => poll_interval.min(DEAF_POLL_INTERVAL),
        }
    }

    fn set_listener_health(&self, health: ListenerHealth) -> ListenerHealth {
        let before = self.listener.health.swap(health as u8, Ordering::Relaxed);
        crate::telemetry::listener_healthy(health == ListenerHealth::Hears);
        ListenerHealth::from_u8(before)
    }

    /// Keeps a dedicated connection listening on [`NOTIFY_CHANNEL`] and calls
    /// `wake.notify_one()` for every notification, reconnecting (with backoff) when the
    /// connection drops, until `shutdown` is cancelled. After every (re)connect it wakes once,
    /// since notifications sent while disconnected are lost. Tests itself as the module
    /// says, and says once when wake-ups stop or start being heard.
    pub async fn listen(&self, wake: Arc<Notify>, shutdown: CancellationToken) {
        let mut backoff = Duration::from_millis(100);
        let channel = format!("outbox_probe_{}", uuid::Uuid::new_v4().simple());
        while !shutdown.is_cancelled() {
            let connected = tokio::time::Instant::now();
            let ended = tokio::select! {
                ended = self.listen_once(&wake, &channel) => ended,
                () = shutdown.cancelled() => return,
            };
            self.set_listener_health(ListenerHealth::Down);
            // A connection that lasted starts the backoff over.
            if connected.elapsed() >= Duration::from_secs(60) {
                backoff = Duration::from_millis(100);
            }
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

    async fn listen_once(&self, wake: &Arc<Notify>, channel: &str) -> Result<()> {
        let target = &self.listen_target;
        let (client, mut connection) = super::session(target).await?;
        let (forward, state, own) = (wake.clone(), self.listener.clone(), channel.to_owned());
        let mut driver = tokio::spawn(async move {
            let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                if let AsyncMessage::Notification(n) = message? {
                    if n.channel() == own {
                        let seq = n.payload().parse().unwrap_or(0);
                        state.heard.fetch_max(seq, Ordering::Relaxed);
                        state.heard_signal.notify_waiters();
                    } else {
                        forward.notify_one();
                    }
                }
            }
            Ok::<(), tokio_postgres::Error>(())
        });
        // The wake-up channel last, so that pg_stat_activity shows `LISTEN outbox_new` (or its
        // schema's channel) for
        // the listening session.
        client.batch_execute(&format!("LISTEN {channel}")).await?;
        let wake_channel = super::naming::notify_channel(self.schema());
        client
            .batch_execute(&format!("LISTEN {wake_channel}"))
            .await?;
        wake.notify_one();
        tracing::debug!(target = %target.describe(), channel, "listening");
        let ended = tokio::select! {
            ended = &mut driver => ended,
            () = self.keep_checking(channel) => unreachable!("the checks never end"),
        };
        drop(client);
        match ended {
            Ok(result) => Ok(result?),
            Err(e) => Err(StoreError::Unavailable {
                target: target.describe(),
                reason: "the notification listener's task ended".to_owned(),
                source: Box::new(e),
            }),
        }
    }

    /// Checks at once and then every [`CHECK_INTERVAL`] that the listener hears a
    /// notification on `channel` sent through the pool; never returns.
    async fn keep_checking(&self, channel: &str) {
        loop {
            let checked = self.check_listener(channel).await;
            tracing::debug!(?checked, "listener check");
            match checked {
                Ok(true) => {
                    if self.set_listener_health(ListenerHealth::Hears) == ListenerHealth::Deaf {
                        tracing::info!("notification listener hears wake-ups again");
                    }
                }
                Ok(false) => {
                    if self.set_listener_health(ListenerHealth::Deaf) != ListenerHealth::Deaf {
                        tracing::warn!(
                            listen_target = %self.listen_target.describe(),
                            check_timeout_ms = crate::telemetry::millis(CHECK_TIMEOUT),
                            "notification listener is deaf: LISTEN succeeded but did not hear \
                             this process's own test notification, which happens through a \
                             transaction pooler; messages are picked up by polling every \
                             {} ms instead of at once. Set listen_url (OUTBOX_LISTEN_URL, \
                             --listen-url) to a direct connection to Postgres for wake-ups \
                             (see docs/poolers.md)",
                            DEAF_POLL_INTERVAL.as_millis()
                        );
                    }
                }
                // The pool cannot send the test now: the claimer's own errors say why.
                Err(e) => tracing::debug!(error = %e, "listener check could not send its test"),
            }
            tokio::time::sleep(CHECK_INTERVAL).await;
        }
    }

    /// Sends one test notification on `channel` through the pool and waits up to
    /// [`CHECK_TIMEOUT`] for the listener to hear it.
    async fn check_listener(&self, channel: &str) -> Result<bool> {
        let seq = self.listener.sent.fetch_add(1, Ordering::Relaxed) + 1;
        let heard = self.listener.heard_signal.notified();
        tokio::pin!(heard);
        heard.as_mut().enable();
        self.client()
            .await?
            .query_typed(
                "SELECT pg_notify($1, $2)",
                &[(&channel, Type::TEXT), (&seq.to_string(), Type::TEXT)],
            )
            .await?;
        let deadline = tokio::time::Instant::now() + CHECK_TIMEOUT;
        while self.listener.heard.load(Ordering::Relaxed) < seq {
            if tokio::time::timeout_at(deadline, heard.as_mut())
                .await
                .is_err()
            {
                return Ok(false);
            }
            heard.set(self.listener.heard_signal.notified());
            heard.as_mut().enable();
        }
        Ok(true)
    }

    /// One test as the listener makes it, for a process that does not listen (`status`):
    /// a connection of its own to the listen URL `LISTEN`s on a fresh channel, a
    /// notification is sent through the pool, and the answer is whether it was heard
    /// within `timeout`.
    pub async fn wake_ups_heard(&self, timeout: Duration) -> Result<bool> {
        let (client, mut connection) = super::session(&self.listen_target).await?;
        let channel = format!("outbox_probe_{}", uuid::Uuid::new_v4().simple());
        let (heard_tx, heard_rx) = tokio::sync::oneshot::channel();
        let own = channel.clone();
        let driver = tokio::spawn(async move {
            let mut heard_tx = Some(heard_tx);
            let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(Ok(message)) = messages.next().await {
                if let AsyncMessage::Notification(n) = message
                    && n.channel() == own
                    && let Some(tx) = heard_tx.take()
                {
                    let _ = tx.send(());
                }
            }
        });
        client.batch_execute(&format!("LISTEN {channel}")).await?;
        self.client()
            .await?
            .query_typed("SELECT pg_notify($1, '')", &[(&channel, Type::TEXT)])
            .await?;
        let heard = tokio::time::timeout(timeout, heard_rx)
            .await
            .is_ok_and(|r| r.is_ok());
        drop(client);
        driver.abort();
        Ok(heard)
    }
}

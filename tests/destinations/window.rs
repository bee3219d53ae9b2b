//! The publish window in the conformance suite: the real destination, built in the test's
//! process from its harness's settings, behind a dispatcher whose window closes while the
//! destination is answering (as when the relayer was frozen and woke after its leases were
//! taken over). What the destination published is read back with the harness's independent
//! client.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use outbox_relay::destination::{Destination, Window};
use outbox_relay::dispatch::{CircuitSettings, DestinationTable, Dispatcher};
use outbox_relay::message::{ClaimedMessage, LeaseToken, OutboxId, Outcome};
use uuid::Uuid;

use crate::Harness;

/// The destination of a harness's `[destinations.d]` table, built as a relayer builds it.
pub fn build<H: Harness>(h: &H, deadline: Duration) -> Arc<dyn Destination> {
    #[derive(serde::Deserialize)]
    struct Tables {
        destinations: std::collections::HashMap<String, DestinationTable>,
    }
    let tables: Tables = toml::from_str(&format!("[destinations.d]\n{}", h.table()))
        .unwrap_or_else(|e| panic!("the harness's table: {e}"));
    match tables.destinations["d"].destination.build("d", deadline) {
        Ok(d) => d,
        Err(e) => panic!("the harness's destination: {e}"),
    }
}

/// Answers after the window of its call closed: it publishes through the real destination,
/// then closes the window before it answers, as the clock of a relayer frozen until its
/// leases ran out would.
pub struct AnswersAfterTheWindow(pub Arc<dyn Destination>);

impl Destination for AnswersAfterTheWindow {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let outcomes = self.0.publish(batch, window).await;
            window.close();
            outcomes
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        self.0.ready()
    }
}

/// A message on topic `orders` as a claim returns it.
pub fn message(key: Option<&str>, n: usize) -> ClaimedMessage {
    let payload = format!("{{\"n\": {n}}}").into_bytes();
    ClaimedMessage {
        id: OutboxId(Uuid::now_v7()),
        lease_token: LeaseToken(Uuid::new_v4()),
        topic: "orders".into(),
        key: key.map(str::to_owned),
        seq: i64::try_from(n).unwrap() + 1,
        payload_bytes: i64::try_from(payload.len()).unwrap(),
        payload,
        content_type: "application/json".into(),
        headers: serde_json::json!({}),
        attempt_no: 1,
        created_at: chrono::Utc::now(),
        lease_expires_at: chrono::Utc::now() + chrono::Duration::minutes(1),
        payload_withheld: false,
        origin: None,
    }
}

/// A dispatcher of one destination `d` with a closed circuit.
pub fn dispatcher(destination: Arc<dyn Destination>, deadline: Duration) -> Dispatcher {
    Dispatcher::single(
        "d",
        destination,
        CircuitSettings {
            failures: 5,
            cooldown: Duration::from_secs(60),
        },
        deadline,
        1,
    )
}

/// A window open for a minute.
pub fn open_window() -> Window {
    Window::until(Instant::now() + crate::MINUTE)
}

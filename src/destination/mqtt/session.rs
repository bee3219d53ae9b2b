//! One connection to the broker and what waits on it. The client (`rumqttc`) numbers the
//! packets; the number of each publish is learnt from the event the client emits as it
//! takes the request, in the order the requests were queued ([`Waiting`]), and its PUBACK
//! settles its message ([`Ack`]). A lost connection answers everything still waiting.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rumqttc::{Outgoing, QoS};
use tokio::sync::oneshot;

use super::{INFLIGHT, MQTT_STRING, Protocol, QUEUE, Settings};

/// What the broker answered to one publish.
pub(super) enum Ack {
    Delivered,
    Refused { permanent: bool, reason: String },
    Lost(String),
}

/// The publishes of one connection waiting for their PUBACK.
#[derive(Default)]
struct Waiting {
    /// Queued in the client, not yet given a packet id, oldest first.
    queued: VecDeque<oneshot::Sender<Ack>>,
    by_pkid: HashMap<u16, oneshot::Sender<Ack>>,
    /// A publish whose packet id was still in use: sent once that one is acknowledged.
    deferred: Option<(u16, oneshot::Sender<Ack>)>,
    /// Why the connection ended, once it has.
    closed: Option<String>,
}

/// What the event loop reports, the same for both protocol versions.
enum Event {
    /// The client took the next queued publish and gave it this packet id.
    Numbered(u16),
    /// The client took the next queued publish, but its packet id is still in use.
    Deferred(u16),
    /// The broker answered the publish with this packet id.
    Acked(u16, Ack),
    Other,
}

impl Waiting {
    fn handle(&mut self, event: Event) {
        match event {
            Event::Numbered(pkid) => {
                let waiter = match self.deferred.take() {
                    Some((deferred, waiter)) if deferred == pkid => Some(waiter),
                    other => {
                        self.deferred = other;
                        self.queued.pop_front()
                    }
                };
                if let Some(waiter) = waiter {
                    self.by_pkid.insert(pkid, waiter);
                }
            }
            Event::Deferred(pkid) => {
                if let Some(waiter) = self.queued.pop_front() {
                    self.deferred = Some((pkid, waiter));
                }
            }
            Event::Acked(pkid, ack) => {
                if let Some(waiter) = self.by_pkid.remove(&pkid) {
                    let _ = waiter.send(ack);
                }
            }
            Event::Other => {}
        }
    }

    /// The connection is gone: every waiting publish is answered with `reason`.
    fn close(&mut self, reason: String) {
        let waiters = self
            .queued
            .drain(..)
            .chain(self.by_pkid.drain().map(|(_, w)| w))
            .chain(self.deferred.take().map(|(_, w)| w));
        for waiter in waiters {
            let _ = waiter.send(Ack::Lost(reason.clone()));
        }
        self.closed = Some(reason);
    }
}

enum Client {
    V311(rumqttc::AsyncClient),
    V5(rumqttc::v5::AsyncClient),
}

/// One connection: its client, its event loop's task and what waits on it.
pub(super) struct Session {
    client: Client,
    waiting: Arc<Mutex<Waiting>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.task.abort();
        lock(&self.waiting).close("the MQTT connection was dropped".into());
    }
}

fn lock(waiting: &Mutex<Waiting>) -> std::sync::MutexGuard<'_, Waiting> {
    waiting
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A publish ready to queue: its topic, payload and (MQTT 5) properties.
pub(super) struct Packet {
    pub(super) topic: String,
    pub(super) payload: Vec<u8>,
    pub(super) properties: Option<rumqttc::v5::mqttbytes::v5::PublishProperties>,
}

impl Session {
    /// Connects and waits for the broker's CONNACK, at most `timeout`.
    pub(super) async fn connect(
        s: &Settings,
        url: &str,
        timeout: Duration,
    ) -> Result<Session, String> {
        let waiting = Arc::new(Mutex::new(Waiting::default()));
        let connecting = async {
            match s.protocol {
                Protocol::V311 => connect_v311(s, waiting.clone()).await,
                Protocol::V5 => connect_v5(s, waiting.clone()).await,
            }
        };
        match tokio::time::timeout(timeout, connecting).await {
            Err(_) => Err(format!("mqtt connect {url}: no CONNACK within {timeout:?}")),
            Ok(Err(e)) => Err(format!("mqtt connect {url}: {e}")),
            Ok(Ok((client, task))) => Ok(Session {
                client,
                waiting,
                task,
            }),
        }
    }

    /// Queues `packet` in the client; the receiver gets the broker's answer.
    pub(super) fn send(&self, packet: Packet) -> Result<oneshot::Receiver<Ack>, String> {
        let (tx, rx) = oneshot::channel();
        // Queued under the lock, so that the order of `queued` is the order the client
        // takes the requests in.
        let mut waiting = lock(&self.waiting);
        if let Some(reason) = &waiting.closed {
            return Err(reason.clone());
        }
        waiting.queued.push_back(tx);
        let queued = match (&self.client, packet.properties) {
            (Client::V311(c), _) => c
                .try_publish(packet.topic, QoS::AtLeastOnce, false, packet.payload)
                .map_err(|e| e.to_string()),
            (Client::V5(c), properties) => c
                .try_publish_with_properties(
                    packet.topic,
                    rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
                    false,
                    packet.payload,
                    properties.unwrap_or_default(),
                )
                .map_err(|e| e.to_string()),
        };
        if let Err(e) = queued {
            waiting.queued.pop_back();
            return Err(format!("the MQTT client did not take the publish: {e}"));
        }
        Ok(rx)
    }

    pub(super) fn is_open(&self) -> bool {
        lock(&self.waiting).closed.is_none() && !self.task.is_finished()
    }
}

/// An MQTT 3.1.1 client, once the broker accepted it, and its event loop's task.
async fn connect_v311(
    s: &Settings,
    waiting: Arc<Mutex<Waiting>>,
) -> Result<(Client, tokio::task::JoinHandle<()>), String> {
    let mut options = rumqttc::MqttOptions::new(&s.client_id, s.host.clone(), s.port);
    options
        .set_clean_session(true)
        .set_keep_alive(s.keep_alive)
        .set_inflight(INFLIGHT)
        .set_max_packet_size(64 * 1024, s.max_packet + MQTT_STRING + 16);
    if let Some((user, password)) = &s.credentials {
        options.set_credentials(user, password);
    }
    if let Some(t) = &s.transport {
        options.set_transport(t.clone());
    }
    let (client, mut events) = rumqttc::AsyncClient::new(options, QUEUE);
    loop {
        match events.poll().await {
            Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(ack))) => {
                if ack.code != rumqttc::ConnectReturnCode::Success {
                    return Err(format!("the broker refused: {:?}", ack.code));
                }
                break;
            }
            Ok(_) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    let w = waiting;
    let task = tokio::spawn(async move {
        loop {
            match events.poll().await {
                Ok(event) => lock(&w).handle(event_v311(event)),
                Err(e) => {
                    let mut w = lock(&w);
                    // What the client read before the connection ended (a
                    // broker may answer a publish and then hang up).
                    for event in events.state.events.drain(..) {
                        w.handle(event_v311(event));
                    }
                    w.close(format!("MQTT connection lost: {e}"));
                    return;
                }
            }
        }
    });
    Ok((Client::V311(client), task))
}

/// An MQTT 5 client, once the broker accepted it, and its event loop's task.
async fn connect_v5(
    s: &Settings,
    waiting: Arc<Mutex<Waiting>>,
) -> Result<(Client, tokio::task::JoinHandle<()>), String> {
    use rumqttc::v5::mqttbytes::v5::{ConnectReturnCode, Packet as P};
    let mut options = rumqttc::v5::MqttOptions::new(&s.client_id, s.host.clone(), s.port);
    options
        .set_clean_start(true)
        .set_keep_alive(s.keep_alive)
        .set_outgoing_inflight_upper_limit(INFLIGHT)
        .set_max_packet_size(Some(64 * 1024));
    if let Some((user, password)) = &s.credentials {
        options.set_credentials(user, password);
    }
    if let Some(t) = &s.transport {
        options.set_transport(t.clone());
    }
    let (client, mut events) = rumqttc::v5::AsyncClient::new(options, QUEUE);
    loop {
        match events.poll().await {
            Ok(rumqttc::v5::Event::Incoming(P::ConnAck(ack))) => {
                if ack.code != ConnectReturnCode::Success {
                    return Err(format!("the broker refused: {:?}", ack.code));
                }
                break;
            }
            Ok(_) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    let w = waiting;
    let task = tokio::spawn(async move {
        loop {
            match events.poll().await {
                Ok(event) => lock(&w).handle(event_v5(event)),
                Err(e) => {
                    let mut w = lock(&w);
                    // What the client read before the connection ended (Mosquitto
                    // 2.0.11 answers a publish its ACL denies, then hangs up).
                    for event in events.state.events.drain(..) {
                        w.handle(event_v5(event));
                    }
                    w.close(format!("MQTT connection lost: {e}"));
                    return;
                }
            }
        }
    });
    Ok((Client::V5(client), task))
}

fn event_v311(event: rumqttc::Event) -> Event {
    match event {
        rumqttc::Event::Outgoing(Outgoing::Publish(p)) => Event::Numbered(p),
        rumqttc::Event::Outgoing(Outgoing::AwaitAck(p)) => Event::Deferred(p),
        rumqttc::Event::Incoming(rumqttc::Packet::PubAck(a)) => {
            Event::Acked(a.pkid, Ack::Delivered)
        }
        _ => Event::Other,
    }
}

fn event_v5(event: rumqttc::v5::Event) -> Event {
    use rumqttc::v5::mqttbytes::v5::Packet as P;
    match event {
        rumqttc::v5::Event::Outgoing(Outgoing::Publish(p)) => Event::Numbered(p),
        rumqttc::v5::Event::Outgoing(Outgoing::AwaitAck(p)) => Event::Deferred(p),
        rumqttc::v5::Event::Incoming(P::PubAck(a)) => Event::Acked(a.pkid, puback(&a.reason)),
        _ => Event::Other,
    }
}

/// The outcome an MQTT 5 PUBACK's reason code stands for.
fn puback(reason: &rumqttc::v5::mqttbytes::v5::PubAckReason) -> Ack {
    use rumqttc::v5::mqttbytes::v5::PubAckReason as R;
    let permanent = match reason {
        R::Success | R::NoMatchingSubscribers => return Ack::Delivered,
        R::NotAuthorized
        | R::TopicNameInvalid
        | R::PayloadFormatInvalid
        | R::ImplementationSpecificError => true,
        R::UnspecifiedError | R::PacketIdentifierInUse | R::QuotaExceeded => false,
    };
    Ack::Refused {
        permanent,
        reason: format!("the broker refused the publish: {reason:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiter() -> (oneshot::Sender<Ack>, oneshot::Receiver<Ack>) {
        oneshot::channel()
    }

    fn delivered(rx: &mut oneshot::Receiver<Ack>) -> bool {
        matches!(rx.try_recv(), Ok(Ack::Delivered))
    }

    #[test]
    fn each_puback_settles_the_publish_its_packet_id_was_given_to() {
        let mut w = Waiting::default();
        let (a, mut ra) = waiter();
        let (b, mut rb) = waiter();
        let (c, mut rc) = waiter();
        w.queued.extend([a, b, c]);
        w.handle(Event::Numbered(7));
        w.handle(Event::Numbered(8));
        // c's id (7 again) is still in use: it is sent once 7 is acknowledged.
        w.handle(Event::Deferred(7));
        w.handle(Event::Acked(8, Ack::Delivered));
        assert!(delivered(&mut rb));
        assert!(ra.try_recv().is_err() && rc.try_recv().is_err());
        w.handle(Event::Acked(7, Ack::Delivered));
        assert!(delivered(&mut ra));
        w.handle(Event::Numbered(7));
        w.handle(Event::Acked(7, Ack::Delivered));
        assert!(delivered(&mut rc));
    }

    #[test]
    fn a_lost_connection_answers_everything_waiting() {
        let mut w = Waiting::default();
        let (a, mut ra) = waiter();
        let (b, mut rb) = waiter();
        w.queued.extend([a, b]);
        w.handle(Event::Numbered(1));
        w.close("gone".into());
        assert!(matches!(ra.try_recv(), Ok(Ack::Lost(r)) if r == "gone"));
        assert!(matches!(rb.try_recv(), Ok(Ack::Lost(_))));
        assert_eq!(w.closed.as_deref(), Some("gone"));
    }

    #[test]
    fn a_refusal_is_permanent_only_when_the_broker_would_repeat_it() {
        use rumqttc::v5::mqttbytes::v5::PubAckReason as R;
        assert!(matches!(puback(&R::NoMatchingSubscribers), Ack::Delivered));
        assert!(matches!(
            puback(&R::NotAuthorized),
            Ack::Refused {
                permanent: true,
                ..
            }
        ));
        assert!(matches!(
            puback(&R::QuotaExceeded),
            Ack::Refused {
                permanent: false,
                ..
            }
        ));
    }
}

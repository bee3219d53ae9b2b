//! The `mqtt` destination: MQTT 5 (or 3.1.1) publish at QoS 1 to a topic template (`{topic}`
//! replaced), retained flag off, a message delivered when the broker's PUBACK for it arrives.
//! On MQTT 5 the message's own headers and the outbox metadata (`outbox-id`, the consumer's
//! dedupe id; `outbox-topic`, `outbox-key`, `outbox-attempt`) travel as user properties and
//! the content type as the Content Type property; a header MQTT cannot carry (a name or
//! value over 65,535 bytes) makes that message permanent. MQTT 3.1.1 has no headers: they
//! are not sent (the documented rule; the CloudEvents structured envelope carries the id in
//! the payload instead).
//!
//! One connection per destination, with a clean session and a client id unique to the
//! process (`client_id` + random suffix). The client (`rumqttc`) numbers the packets; the
//! number of each publish is learnt from the event the client emits as it takes the
//! request, in the order the requests were queued, and its PUBACK settles its message. A
//! PUBACK with a reason code of 0x80 or more (MQTT 5) is the broker's refusal: not
//! authorized, topic name invalid, payload format invalid and implementation-specific
//! errors are permanent, the rest retryable. A lost connection, or a batch not acknowledged
//! within the deadline, answers its waiting messages retryable and drops the connection;
//! the next batch connects again, so nothing the client would resend on its own is mixed
//! with new publishes.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use rumqttc::{Outgoing, QoS, TlsConfiguration, Transport};
use tokio::sync::oneshot;

use super::cloudevents::{self, Envelope, Mode, STRUCTURED_CONTENT_TYPE};
use super::{Destination, Setting, Window, install_tls_provider, metadata, user_headers};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};

/// Publishes queued in the client at once (its request channel); a batch beyond it is
/// answered retryable for the messages that did not fit.
const QUEUE: usize = 4096;
/// Publishes awaiting their PUBACK at once (the broker's Receive Maximum, when lower, wins).
const INFLIGHT: u16 = 100;
/// The longest string MQTT encodes (a two-byte length).
const MQTT_STRING: usize = 65_535;

/// `type = "mqtt"`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqttConfig {
    /// `mqtt://HOST[:PORT]` (1883) or `mqtts://HOST[:PORT]` (8883, TLS)
    /// [default: mqtt://127.0.0.1:1883].
    pub url: Option<String>,
    /// `"5"` or `"3.1.1"` [default: "5"].
    pub protocol: Option<String>,
    /// Topic template [default: `{topic}`].
    pub topic: Option<String>,
    /// Start of the client id; a random suffix makes it unique per process
    /// [default: outbox-relay].
    pub client_id: Option<String>,
    pub username: Option<String>,
    pub password: Option<String>,
    /// PEM file of the CA certificates to trust for `mqtts://` [default: the system's].
    pub ca_file: Option<std::path::PathBuf>,
    /// Keep-alive interval, 5..=3600 [default: 30].
    pub keep_alive_secs: Option<i64>,
    /// The largest publish packet sent; a larger message is permanent [default: 1048576].
    pub max_packet_bytes: Option<i64>,
    /// `"cloudevents"` to send each message as a CloudEvent [default: none].
    pub envelope: Option<String>,
    /// `"binary"` (MQTT 5 only) or `"structured"` [default: binary].
    pub cloudevents_mode: Option<String>,
    /// The CloudEvents `source` template [default: /outbox-relay].
    pub cloudevents_source: Option<String>,
    /// The CloudEvents `type` template [default: `{topic}`].
    pub cloudevents_type: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocol {
    V311,
    V5,
}

impl MqttConfig {
    pub(super) fn build(&self, at: Setting<'_>, deadline: Duration) -> Result<Mqtt, ConfigError> {
        let url = self.url.as_deref().unwrap_or("mqtt://127.0.0.1:1883");
        let (tls, rest) = if let Some(rest) = url.strip_prefix("mqtt://") {
            (false, rest)
        } else if let Some(rest) = url.strip_prefix("mqtts://") {
            (true, rest)
        } else {
            return Err(at.invalid(
                "url",
                format!("{url:?} must start with mqtt:// or mqtts://"),
            ));
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains('@') {
            return Err(at.invalid(
                "url",
                "credentials go in `username` and `password`, not in the URL",
            ));
        }
        if rest.contains('/') || rest.contains('?') {
            return Err(at.invalid(
                "url",
                format!("{url:?}: an MQTT address is HOST[:PORT], with no path or query"),
            ));
        }
        // HOST, HOST:PORT, [V6] or [V6]:PORT.
        let (host, port) = match rest.strip_prefix('[') {
            Some(v6) => match v6.split_once(']') {
                Some((host, "")) => (host, None),
                Some((host, port)) => (host, port.strip_prefix(':')),
                None => return Err(at.invalid("url", format!("{url:?}: no ] after [IPv6"))),
            },
            None => match rest.split_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (rest, None),
            },
        };
        let port = match port {
            None => {
                if tls {
                    8883
                } else {
                    1883
                }
            }
            Some(port) => port.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| {
                at.invalid(
                    "url",
                    format!("{url:?}: the port {port:?} is not 1..=65535"),
                )
            })?,
        };
        if host.is_empty() {
            return Err(at.invalid("url", format!("{url:?} has no host")));
        }
        let protocol = match self.protocol.as_deref().unwrap_or("5") {
            "5" => Protocol::V5,
            "3.1.1" => Protocol::V311,
            other => {
                return Err(at.invalid(
                    "protocol",
                    format!(
                        "{other:?} is not an MQTT version this relayer speaks: \"5\" or \"3.1.1\""
                    ),
                ));
            }
        };
        let topic = self.topic.as_deref().unwrap_or("{topic}");
        if topic.is_empty() {
            return Err(at.invalid("topic", "must not be empty"));
        }
        if let Err(problem) = topic_problem(&topic.replace("{topic}", "")) {
            return Err(at.invalid("topic", problem));
        }
        let prefix = self.client_id.as_deref().unwrap_or("outbox-relay");
        if prefix.is_empty() || prefix.len() > 200 {
            return Err(at.invalid("client_id", "must be 1 to 200 bytes"));
        }
        let client_id = format!(
            "{prefix}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..10]
        );
        if self.password.is_some() && self.username.is_none() {
            return Err(at.invalid("password", "is sent only with a `username`"));
        }
        let keep_alive = at.ranged("keep_alive_secs", self.keep_alive_secs, 30, 5, 3600)?;
        let max_packet = at.ranged(
            "max_packet_bytes",
            self.max_packet_bytes,
            1_048_576,
            1024,
            268_435_455,
        )?;
        let envelope = Envelope::from_settings(
            at,
            &cloudevents::Settings {
                envelope: self.envelope.as_deref(),
                mode: self.cloudevents_mode.as_deref(),
                source: self.cloudevents_source.as_deref(),
                kind: self.cloudevents_type.as_deref(),
            },
        )?;
        if protocol == Protocol::V311 && envelope.as_ref().is_some_and(|e| e.mode == Mode::Binary) {
            return Err(at.invalid(
                "cloudevents_mode",
                "MQTT 3.1.1 has no headers to carry binary mode's attributes: set \
                 cloudevents_mode = \"structured\" (or protocol = \"5\")",
            ));
        }
        let transport = if tls {
            install_tls_provider();
            let mut roots = rustls::RootCertStore::empty();
            match &self.ca_file {
                Some(path) => {
                    use rustls::pki_types::pem::PemObject;
                    let certs = rustls::pki_types::CertificateDer::pem_file_iter(path)
                        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                        .map_err(|e| at.invalid("ca_file", format!("{}: {e}", path.display())))?;
                    let (added, _) = roots.add_parsable_certificates(certs);
                    if added == 0 {
                        return Err(at.invalid(
                            "ca_file",
                            format!("{}: no PEM certificate in the file", path.display()),
                        ));
                    }
                }
                None => {
                    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
                }
            }
            let config = rustls::ClientConfig::builder()
                .with_root_certificates(roots)
                .with_no_client_auth();
            Some(Transport::tls_with_config(TlsConfiguration::Rustls(
                Arc::new(config),
            )))
        } else {
            if self.ca_file.is_some() {
                return Err(at.invalid("ca_file", "is for mqtts:// URLs only"));
            }
            None
        };
        Ok(Mqtt {
            settings: Settings {
                host: host.to_owned(),
                port,
                protocol,
                client_id,
                credentials: self
                    .username
                    .clone()
                    .map(|u| (u, self.password.clone().unwrap_or_default())),
                transport,
                keep_alive: Duration::from_secs(keep_alive.unsigned_abs()),
                max_packet: usize::try_from(max_packet).unwrap_or(1_048_576),
            },
            url: url.to_owned(),
            topic: topic.to_owned(),
            timeout: deadline,
            session: tokio::sync::Mutex::new(None),
            envelope,
        })
    }
}

/// Why `topic` cannot be an MQTT topic name, if it cannot.
fn topic_problem(topic: &str) -> Result<(), String> {
    if topic.contains(['+', '#']) {
        return Err(format!(
            "{topic:?} has a wildcard (+ or #), which a topic name to publish to cannot have"
        ));
    }
    if topic.contains('\0') {
        return Err(format!("{topic:?} has a NUL character"));
    }
    if topic.len() > MQTT_STRING {
        return Err(format!(
            "the topic is {} bytes, over MQTT's {MQTT_STRING}",
            topic.len()
        ));
    }
    Ok(())
}

#[derive(Clone)]
struct Settings {
    host: String,
    port: u16,
    protocol: Protocol,
    client_id: String,
    credentials: Option<(String, String)>,
    transport: Option<Transport>,
    keep_alive: Duration,
    max_packet: usize,
}

pub struct Mqtt {
    settings: Settings,
    url: String,
    topic: String,
    timeout: Duration,
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    envelope: Option<Envelope>,
}

/// What the broker answered to one publish.
enum Ack {
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
struct Session {
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
struct Packet {
    topic: String,
    payload: Vec<u8>,
    properties: Option<rumqttc::v5::mqttbytes::v5::PublishProperties>,
}

impl Session {
    /// Connects and waits for the broker's CONNACK, at most `timeout`.
    async fn connect(s: &Settings, url: &str, timeout: Duration) -> Result<Session, String> {
        let waiting = Arc::new(Mutex::new(Waiting::default()));
        let connecting = async {
            match s.protocol {
                Protocol::V311 => {
                    let mut options =
                        rumqttc::MqttOptions::new(&s.client_id, s.host.clone(), s.port);
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
                    let w = waiting.clone();
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
                Protocol::V5 => {
                    use rumqttc::v5::mqttbytes::v5::{ConnectReturnCode, Packet as P};
                    let mut options =
                        rumqttc::v5::MqttOptions::new(&s.client_id, s.host.clone(), s.port);
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
                    let w = waiting.clone();
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
    fn send(&self, packet: Packet) -> Result<oneshot::Receiver<Ack>, String> {
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

    fn is_open(&self) -> bool {
        lock(&self.waiting).closed.is_none() && !self.task.is_finished()
    }
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

impl Mqtt {
    async fn session(&self) -> Result<Arc<Session>, String> {
        let mut slot = self.session.lock().await;
        if let Some(s) = slot.as_ref().filter(|s| s.is_open()) {
            return Ok(s.clone());
        }
        *slot = None;
        let session = Arc::new(Session::connect(&self.settings, &self.url, self.timeout).await?);
        *slot = Some(session.clone());
        Ok(session)
    }

    /// Forgets `session` (a batch timed out on it), so that the next batch connects again.
    async fn drop_session(&self, session: &Arc<Session>) {
        let mut slot = self.session.lock().await;
        if slot.as_ref().is_some_and(|s| Arc::ptr_eq(s, session)) {
            *slot = None;
        }
    }

    /// The publish of `m`, or why it cannot be sent.
    fn packet(&self, m: &ClaimedMessage) -> Result<Packet, String> {
        let topic = self.topic.replace("{topic}", &m.topic);
        topic_problem(&topic)?;
        let (content_type, payload) = match &self.envelope {
            Some(e) if e.mode == Mode::Structured => (STRUCTURED_CONTENT_TYPE, e.structured(m)?),
            _ => (m.content_type.as_str(), m.payload.clone()),
        };
        let mut size = topic.len() + payload.len();
        let properties = match self.settings.protocol {
            Protocol::V311 => None,
            Protocol::V5 => {
                let mut props = Vec::new();
                let outbox = metadata(m);
                for (name, value) in user_headers(m)? {
                    if !outbox.iter().any(|(n, _)| *n == name) {
                        props.push((name.to_owned(), value));
                    }
                }
                // The MQTT binding: attributes as user properties under their own names,
                // `datacontenttype` as the Content Type property.
                if let Some(e) = self.envelope.as_ref().filter(|e| e.mode == Mode::Binary) {
                    props.extend(e.headers(m, "", false));
                }
                props.extend(outbox.into_iter().map(|(n, v)| (n.to_owned(), v)));
                for (name, value) in &props {
                    if name.len() > MQTT_STRING || value.len() > MQTT_STRING {
                        return Err(format!(
                            "header {:?}: MQTT carries names and values of at most {MQTT_STRING} bytes",
                            truncate(name)
                        ));
                    }
                    size += name.len() + value.len() + 5;
                }
                size += content_type.len();
                Some(rumqttc::v5::mqttbytes::v5::PublishProperties {
                    user_properties: props,
                    content_type: Some(content_type.to_owned()),
                    ..Default::default()
                })
            }
        };
        if size > self.settings.max_packet {
            return Err(format!(
                "the message is {size} bytes as an MQTT publish, over max_packet_bytes ({})",
                self.settings.max_packet
            ));
        }
        Ok(Packet {
            topic,
            payload,
            properties,
        })
    }
}

fn truncate(name: &str) -> &str {
    let mut end = name.len().min(40);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

impl Destination for Mqtt {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let retryable = |reason: String| Outcome::Retryable {
                reason,
                retry_after: None,
            };
            if let Err(not_sent) = window.check() {
                return vec![not_sent; batch.len()];
            }
            let session = match self.session().await {
                Ok(s) => s,
                Err(reason) => return vec![retryable(reason); batch.len()],
            };
            let deadline = tokio::time::Instant::now() + self.timeout;
            let mut pending = Vec::with_capacity(batch.len());
            for m in batch {
                // Each publish is a frame of its own.
                if let Err(not_sent) = window.check() {
                    pending.push(Err(not_sent));
                    continue;
                }
                pending.push(match self.packet(m) {
                    Err(reason) => Err(Outcome::Permanent { reason }),
                    Ok(packet) => session.send(packet).map_err(retryable),
                });
            }
            let mut timed_out = false;
            let mut outcomes = Vec::with_capacity(batch.len());
            for sent in pending {
                outcomes.push(match sent {
                    Err(outcome) => outcome,
                    Ok(ack) => match tokio::time::timeout_at(deadline, ack).await {
                        Err(_) => {
                            timed_out = true;
                            retryable(format!(
                                "publish to {}: timed out, no PUBACK within {:?}",
                                self.url, self.timeout
                            ))
                        }
                        Ok(Err(_)) => retryable("the MQTT connection was dropped".into()),
                        Ok(Ok(Ack::Delivered)) => Outcome::Delivered,
                        Ok(Ok(Ack::Refused {
                            permanent: true,
                            reason,
                        })) => Outcome::Permanent { reason },
                        Ok(Ok(Ack::Refused { reason, .. } | Ack::Lost(reason))) => {
                            retryable(reason)
                        }
                    },
                });
            }
            if timed_out {
                self.drop_session(&session).await;
            }
            outcomes
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { self.session().await.map(|_| ()) })
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

    #[test]
    fn a_topic_with_a_wildcard_is_refused() {
        assert!(topic_problem("a/+/b").is_err());
        assert!(topic_problem("a/#").is_err());
        assert!(topic_problem("a/b").is_ok());
    }
}

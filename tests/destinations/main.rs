//! The destination conformance suite: one set of scenarios every destination must pass,
//! run through the built binary against real servers (each destination's harness starts its
//! own server, or puts a proxy of its own in front of a shared one, so that it can break it
//! without disturbing other tests), and read back with an independent client, never with
//! the destination's own code.
//!
//! Scenarios: 5,000 messages arrive exactly once with the outbox_id in the destination's
//! native dedupe field; a redelivery is recognisable by that id; per-message headers arrive;
//! a permanent refusal dead-letters only that message. And where the destination has what
//! they break: a header the protocol cannot carry fails only its message; the connection
//! killed server-side is survived without a restart; the server down for a while opens the
//! circuit with no attempts while it is open and everything delivered after; a server that
//! stops answering hits the dispatch deadline; a publish window that closes while the
//! destination answers part of a batch publishes nothing more (the destination built in the
//! test's process, see `window.rs`).
//!
//! A harness declares those capabilities by implementing their traits ([`UnsendableHeader`],
//! [`KillConnections`], [`Outage`], [`Freeze`], [`InProcess`]); a scenario it cannot support is not
//! generated for it (its line in `conformance!` says `no`, and the compiler refuses a `no`
//! for a trait the harness implements), so no test passes without running. Why a harness
//! lacks one is written on its type. The matrix (`-`: not generated), checked against the
//! suite by `the_matrix_of_destinations_and_scenarios_is_the_documented_one`, which prints
//! it:
//!
//! | scenario                                                  | file | stdout | http | nats | amqp | redis | kafka | mqtt | pubsub | sqs | sns | kinesis | eventbridge |
//! |-----------------------------------------------------------|------|--------|------|------|------|-------|-------|------|--------|-----|-----|---------|-------------|
//! | five_thousand_arrive_exactly_once_with_the_outbox_id      | yes  |  yes   | yes  | yes  | yes  |  yes  |  yes  | yes  |  yes   | yes | yes |   yes   |     yes     |
//! | a_redelivery_is_recognisable_by_the_outbox_id             | yes  |  yes   | yes  | yes  | yes  |  yes  |  yes  | yes  |  yes   | yes | yes |   yes   |     yes     |
//! | message_headers_and_trace_context_arrive                  | yes  |  yes   | yes  | yes  | yes  |  yes  |  yes  | yes  |  yes   | yes | yes |   yes   |     yes     |
//! | a_permanent_refusal_dead_letters_only_that_message        | yes  |  yes   | yes  | yes  | yes  |  yes  |  yes  | yes  |  yes   | yes | yes |   yes   |     yes     |
//! | a_header_the_protocol_cannot_carry_fails_only_its_message |  -   |   -    | yes  | yes  | yes  |   -   |   -   | yes  |  yes   |  -  |  -  |    -    |      -      |
//! | the_connection_killed_server_side_is_survived             |  -   |   -    | yes  | yes  | yes  |  yes  |  yes  | yes  |  yes   | yes | yes |   yes   |     yes     |
//! | an_outage_opens_the_circuit_and_everything_arrives_after  |  -   |   -    | yes  | yes  | yes  |  yes  |  yes  | yes  |  yes   | yes | yes |   yes   |     yes     |
//! | a_server_that_stops_answering_hits_the_dispatch_deadline  |  -   |   -    | yes  | yes  | yes  |  yes  |  yes  | yes  |  yes   | yes | yes |   yes   |     yes     |
//! | nothing_is_published_after_the_window_closes_mid_part     | yes  |   -    | yes  | yes  | yes  |  yes  |  yes  | yes  |  yes   | yes | yes |   yes   |     yes     |
//!
//! Servers: Redis (`redis-server`), NATS (`nats-server`), a Kafka-protocol broker
//! (`tansu`, read back with `kcat`) and the Google Cloud Pub/Sub emulator (read back through
//! its REST API by `tests/support/pubsub-client.py`) started per test; Mosquitto
//! (`mosquitto`, read back with `mosquitto_sub`) started per test behind a proxy; a moto
//! server (`moto_server`, read back with boto3) per test for the AWS destinations; RabbitMQ
//! on 127.0.0.1:5672 (`rabbitmq-server -detached`). `make test` installs or starts what is
//! missing.

#[path = "../common/mod.rs"]
mod common;

mod amqp;
mod aws;
mod debezium;
mod dispatch;
mod eventbridge;
mod http;
mod jsonl;
mod kafka;
mod kinesis;
mod mixed;
mod mqtt;
mod nats;
mod proxy;
mod pubsub;
mod redis;
mod server;
mod sns;
mod sqs;
mod window;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use common::{Relayer, TestDb, eventually, pending};
use outbox_relay::destination::Window;
use outbox_relay::message::Outcome;
use tokio_postgres::Client;
use uuid::Uuid;

pub const MINUTE: Duration = Duration::from_secs(60);

/// The gauge of a destination's circuit on /metrics (part of what operators scrape), and its
/// values.
pub const CIRCUIT_STATE: &str = "outbox_destination_circuit_state";
pub const CLOSED: f64 = 0.0;
pub const OPEN: f64 = 1.0;

/// A message as the destination's server holds it.
#[derive(Debug)]
pub struct Arrived {
    /// Read from the destination's native dedupe field.
    pub id: Uuid,
    /// Headers (or the entry's header fields), with the outbox metadata under the names
    /// `outbox-id`, `outbox-topic`, `outbox-key`, `outbox-seq`, `outbox-attempt`.
    pub headers: BTreeMap<String, String>,
}

/// One destination's part of the suite: what every scenario needs. The optional
/// capabilities below are traits of their own; a harness declares one by implementing it, and
/// the scenarios that need it are generated only for harnesses that do (see [`conformance!`]).
trait Harness: Sized {
    /// Whether the destination itself drops a redelivery of an id it holds.
    const DEDUPES: bool;

    /// Starts what the destination needs for one test.
    async fn start(db: &TestDb) -> Self;

    /// The `[destinations.d]` table's settings (`type` and the rest, not `timeout_ms`).
    fn table(&self) -> String;

    /// Where the relayer's standard output goes (the `stdout` destination), if anywhere.
    fn stdout(&self) -> Option<std::path::PathBuf> {
        None
    }

    /// Everything that arrived on topic `orders`, read back with an independent client.
    async fn received(&self) -> Vec<Arrived>;

    /// Inserts one message the destination refuses for good; returns its id and a piece of
    /// the reason the refusal carries.
    async fn refused_message(&self, c: &Client) -> (Uuid, &'static str);

    /// Removes what the test left on a shared server.
    async fn clean_up(self) {}

    /// Headers (in [`Arrived::headers`]) in which the destination carries a message's
    /// traceparent besides `traceparent` itself.
    const TRACEPARENT_ALSO_IN: &'static [&'static str] = &[];
}

/// The destination's protocol cannot carry some header.
trait UnsendableHeader: Harness {
    /// A header (name, value) the destination's protocol cannot carry.
    fn unsendable_header(&self) -> (String, String);
}

/// The destination has a connection the server can close.
trait KillConnections: Harness {
    /// The server closes the relayer's connections.
    async fn kill_connections(&mut self);
}

/// The destination has a server that can go away and come back.
trait Outage: Harness {
    /// The server goes away ([`Outage::restart`] brings it back, with what it held).
    async fn stop(&mut self);
    async fn restart(&mut self);
}

/// The destination has a server that can stop answering.
trait Freeze: Harness {
    /// The server accepts connections and answers nothing ([`Freeze::thaw`] ends it).
    async fn freeze(&mut self);
    async fn thaw(&mut self);
}

/// The destination can be built in the test's process and what it sends read back (not the
/// `stdout` one: it writes to the test's own standard output).
trait InProcess: Harness {}

/// A relayer delivering everything to the harness's destination `d`, with a short retry
/// backoff and a circuit that opens after two failed batches; its metrics on a port of its
/// own ([`Relayer::metric`]).
fn start_relayer<H: Harness>(db: &TestDb, h: &H, worker: &str, timeout_ms: u64) -> Relayer {
    start_relayer_with(db, h, worker, timeout_ms, "")
}

/// [`start_relayer`] with `settings` (TOML lines) added to the destination's table.
fn start_relayer_with<H: Harness>(
    db: &TestDb,
    h: &H,
    worker: &str,
    timeout_ms: u64,
    settings: &str,
) -> Relayer {
    let config = format!(
        "[destinations.d]\n{}{settings}timeout_ms = {timeout_ms}\n\n[[routes]]\ntopic = \"*\"\ndestination = \"d\"\n",
        h.table()
    );
    let path = db.scratch_dir().join(format!("{worker}.toml"));
    std::fs::write(&path, config).unwrap();
    let path = path.display().to_string();
    let telemetry = format!("127.0.0.1:{}", common::free_port());
    let args = [
        "--config",
        &path,
        "--telemetry-addr",
        &telemetry,
        "--retry-base-ms",
        "50",
        "--retry-cap-ms",
        "200",
        "--circuit-failures",
        "2",
        "--circuit-cooldown-ms",
        "1500",
        "--poll-interval-ms",
        "100",
    ];
    let stdout = match h.stdout() {
        Some(path) => std::fs::File::create(path).unwrap().into(),
        None => std::process::Stdio::null(),
    };
    Relayer::spawn(db, &db.url, worker, &args, stdout)
}

async fn stop_relayer(mut w: Relayer) {
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());
}

async fn drained(c: &Client) {
    eventually(MINUTE, "the outbox to drain", || async {
        pending(c).await == 0
    })
    .await;
}

async fn fill(c: &Client, n: i64) -> HashSet<Uuid> {
    common::fill(c, "orders", n, None)
        .await
        .into_iter()
        .collect()
}

/// `outbox.enqueue` of a JSON payload on `topic` with `key` and `headers`.
pub async fn enqueue(
    c: &impl tokio_postgres::GenericClient,
    topic: &str,
    key: Option<&str>,
    headers: serde_json::Value,
) -> Uuid {
    c.query_one(
        "SELECT outbox.enqueue($1, '{\"hello\": \"world\"}'::jsonb, $2, $3::jsonb)",
        &[&topic, &key, &headers],
    )
    .await
    .unwrap()
    .get(0)
}

/// Each message's attempt history, e.g. `1:RETRYABLE 2:DISPATCHED`.
async fn histories(c: &Client) -> BTreeMap<Uuid, String> {
    c.query(
        "SELECT outbox_id, string_agg(attempt_no || ':' || state, ' ' ORDER BY attempt_no) \
         FROM outbox.attempts GROUP BY outbox_id",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// Waits for the relayer's circuit of `d` to be open (its gauge on /metrics).
pub async fn circuit_opens(w: &Relayer) {
    eventually(MINUTE, "the circuit to open", || async {
        w.metric(CIRCUIT_STATE).await == Some(OPEN)
    })
    .await;
}

/// Once the circuit is open and the batches claimed before it opened have settled, no
/// attempt is recorded for a second (the cool-down is longer than that).
pub async fn assert_no_attempts_while_open(c: &Client) {
    eventually(
        MINUTE,
        "batches claimed before the circuit opened to settle",
        || async {
            common::count(
                c,
                "SELECT count(*) FROM outbox.messages WHERE lease_token IS NOT NULL",
            )
            .await
                == 0
        },
    )
    .await;
    let attempts = || async { common::count(c, "SELECT count(*) FROM outbox.attempts").await };
    let at_open = attempts().await;
    // The sleep is the behaviour: nothing may happen during a second of open circuit (the
    // relayer's own processes and clock, so no paused time).
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        attempts().await,
        at_open,
        "no attempts while the circuit is open"
    );
}

async fn exactly_once<H: Harness>() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = H::start(&db).await;
    let ids = fill(&c, 5000).await;
    // A dispatch deadline of 20 s: the emulators (moto is one Python process) answer a
    // batch's calls in seconds when the machine is busy, and a call the deadline leaves no
    // time for is not sent but retried.
    let w = start_relayer(&db, &h, "once", 20_000);
    drained(&c).await;
    stop_relayer(w).await;
    let arrived = h.received().await;
    let got: HashSet<Uuid> = arrived.iter().map(|a| a.id).collect();
    assert_eq!(arrived.len(), 5000, "one arrival per message");
    assert_eq!(got, ids, "every outbox_id in the native dedupe field");
    // Each delivered by its first attempt, or by a later one after attempts numbered from 1
    // that were retryable (an emulator's error, a deadline). Where the destination keeps
    // duplicates, the count above shows that those delivered nothing; where it drops them
    // by the id, it cannot. A failed call retries every message in it (up to 500 for
    // Kinesis), so the bound is 1 % of the messages: one such call, not a habit.
    let histories = histories(&c).await;
    let retried: Vec<&String> = histories
        .values()
        .filter(|h| *h != "1:DISPATCHED")
        .collect();
    assert!(
        retried.iter().all(|h| {
            let attempts: Vec<&str> = h.split(' ').collect();
            let numbered = attempts
                .iter()
                .enumerate()
                .all(|(i, a)| a.split(':').next() == Some(&(i + 1).to_string()));
            let (last, before) = attempts.split_last().expect("an attempt");
            numbered
                && last.ends_with(":DISPATCHED")
                && before.iter().all(|a| a.ends_with(":RETRYABLE"))
        }),
        "{retried:?}"
    );
    assert!(retried.len() <= 50, "retried: {retried:?}");
    h.clean_up().await;
    db.finish().await;
}

/// A message delivered, then relayed again under the same id (as after a crash between
/// publish and completion): both deliveries carry the id, or the destination dropped the
/// second by it.
async fn redelivery<H: Harness>() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = H::start(&db).await;
    let id = *fill(&c, 1).await.iter().next().unwrap();
    let w = start_relayer(&db, &h, "redelivery", 10_000);
    drained(&c).await;
    c.execute(
        "INSERT INTO outbox.messages (outbox_id, topic, payload) VALUES ($1, 'orders', '{\"n\": 1}')",
        &[&id],
    )
    .await
    .unwrap();
    drained(&c).await;
    stop_relayer(w).await;
    assert_eq!(
        histories(&c).await[&id],
        "1:DISPATCHED 2:DISPATCHED",
        "relayed twice"
    );
    let copies = h.received().await.iter().filter(|a| a.id == id).count();
    assert_eq!(
        copies,
        if H::DEDUPES { 1 } else { 2 },
        "copies carrying the outbox_id"
    );
    h.clean_up().await;
    db.finish().await;
}

/// A message's own headers and its creation trace context (captured at enqueue from the
/// producer's `SET LOCAL outbox.traceparent`) arrive beside the outbox metadata, the
/// traceparent also where the destination carries it a second time; the messages
/// of a key carry their sequence (`outbox-seq`: `outbox.messages.seq`, read before the
/// relayer starts), increasing in the order they arrive; unkeyed messages carry none.
async fn headers<H: Harness>() {
    const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    const TRACESTATE: &str = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = H::start(&db).await;
    let others = fill(&c, 20).await;
    let first = enqueue(&c, "orders", Some("order-7"), serde_json::json!({})).await;
    // Captured at enqueue as a producer does it, by the transaction's settings.
    let traced = {
        let mut producer = db.client().await;
        let tx = producer.transaction().await.unwrap();
        tx.batch_execute(&format!(
            "SET LOCAL outbox.traceparent = '{TRACEPARENT}'; SET LOCAL outbox.tracestate = '{TRACESTATE}'"
        ))
        .await
        .unwrap();
        let id = enqueue(
            &tx,
            "orders",
            Some("order-7"),
            serde_json::json!({"x-tenant": "acme", "x-retries": 3}),
        )
        .await;
        tx.commit().await.unwrap();
        id
    };
    let last = enqueue(&c, "orders", Some("order-7"), serde_json::json!({})).await;
    let seq: BTreeMap<Uuid, i64> = c
        .query(
            "SELECT outbox_id, seq FROM outbox.messages WHERE message_key = 'order-7'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        seq[&first] < seq[&traced] && seq[&traced] < seq[&last],
        "enqueue numbers a key's messages in order: {seq:?}"
    );
    let w = start_relayer(&db, &h, "headers", 10_000);
    drained(&c).await;
    stop_relayer(w).await;
    let arrived = h.received().await;
    let message = arrived
        .iter()
        .find(|a| a.id == traced)
        .expect("the traced message arrived");
    let expected = [
        ("traceparent", TRACEPARENT.to_owned()),
        ("tracestate", TRACESTATE.to_owned()),
        ("x-tenant", "acme".to_owned()),
        ("x-retries", "3".to_owned()),
        ("outbox-id", traced.to_string()),
        ("outbox-topic", "orders".to_owned()),
        ("outbox-key", "order-7".to_owned()),
        ("outbox-seq", seq[&traced].to_string()),
        ("outbox-attempt", "1".to_owned()),
    ];
    let also = H::TRACEPARENT_ALSO_IN
        .iter()
        .map(|name| (*name, TRACEPARENT.to_owned()));
    for (name, value) in expected.into_iter().chain(also) {
        assert_eq!(
            message.headers.get(name),
            Some(&value),
            "{name} in {:?}",
            message.headers
        );
    }
    let key_order: Vec<(Uuid, Option<&String>)> = arrived
        .iter()
        .filter(|a| a.headers.get("outbox-key").map(String::as_str) == Some("order-7"))
        .map(|a| (a.id, a.headers.get("outbox-seq")))
        .collect();
    let expected_order: Vec<(Uuid, String)> = [first, traced, last]
        .iter()
        .map(|id| (*id, seq[id].to_string()))
        .collect();
    assert_eq!(
        key_order,
        expected_order
            .iter()
            .map(|(id, s)| (*id, Some(s)))
            .collect::<Vec<_>>(),
        "the key's messages arrive once each, in order, each with its own increasing sequence"
    );
    let delivered: HashSet<Uuid> = arrived.iter().map(|a| a.id).collect();
    assert!(others.is_subset(&delivered));
    let sequenced: Vec<&Arrived> = arrived
        .iter()
        .filter(|a| others.contains(&a.id) && a.headers.contains_key("outbox-seq"))
        .collect();
    assert!(
        sequenced.is_empty(),
        "an unkeyed message carries no sequence: {sequenced:?}"
    );
    h.clean_up().await;
    db.finish().await;
}

/// A message with a header the protocol cannot carry is dead-lettered, naming the header;
/// the others of its batch arrive.
async fn unsendable_header<H: UnsendableHeader>() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = H::start(&db).await;
    let others = fill(&c, 20).await;
    let (name, value) = h.unsendable_header();
    let id = enqueue(&c, "orders", None, serde_json::json!({ &name: value })).await;
    let w = start_relayer(&db, &h, "unsendable", 10_000);
    drained(&c).await;
    stop_relayer(w).await;
    let delivered: HashSet<Uuid> = h.received().await.iter().map(|a| a.id).collect();
    assert!(others.is_subset(&delivered));
    assert!(
        !delivered.contains(&id),
        "a header the protocol cannot carry is not sent"
    );
    let dead = common::dead_letters(&c).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, id);
    assert!(
        dead[0].1.contains(&name),
        "the reason names the header: {dead:?}"
    );
    h.clean_up().await;
    db.finish().await;
}

/// In the payload of every harness's refused message: the relayer's log must not show it.
pub const REFUSED_PAYLOAD_MARK: &str = "refused-payload-4f1c";

async fn refusal<H: Harness>() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = H::start(&db).await;
    let (refused, reason) = h.refused_message(&c).await;
    // Enqueued together so that they are claimed, and published, in one batch.
    let ids = fill(&c, 50).await;
    let w = start_relayer(&db, &h, "refusal", 10_000);
    drained(&c).await;
    let log = w.log.clone();
    stop_relayer(w).await;
    // Neither our events nor a destination library's warnings print the payload, as text
    // or as a Debug list of its bytes.
    let log = std::fs::read_to_string(log).unwrap();
    let as_bytes = REFUSED_PAYLOAD_MARK
        .bytes()
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    assert!(
        !log.contains(REFUSED_PAYLOAD_MARK) && !log.contains(&as_bytes),
        "the refused message's payload is in the relayer's log:\n{log}"
    );
    let dead = common::dead_letters(&c).await;
    assert_eq!(dead.len(), 1, "only the refused message: {dead:?}");
    assert_eq!(dead[0].0, refused);
    assert!(dead[0].1.contains(reason), "{dead:?}");
    let history = histories(&c).await;
    assert_eq!(history[&refused], "1:FAILED");
    assert!(
        ids.iter().all(|id| history[id] == "1:DISPATCHED"),
        "{history:?}"
    );
    let got: HashSet<Uuid> = h.received().await.iter().map(|a| a.id).collect();
    assert_eq!(got, ids);
    h.clean_up().await;
    db.finish().await;
}

async fn connection_killed<H: KillConnections>() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let mut h = H::start(&db).await;
    let w = start_relayer(&db, &h, "killed", 2_000);
    let mut ids = fill(&c, 100).await;
    drained(&c).await;
    h.kill_connections().await;
    ids.extend(fill(&c, 100).await);
    drained(&c).await;
    stop_relayer(w).await;
    let got: HashSet<Uuid> = h.received().await.iter().map(|a| a.id).collect();
    assert_eq!(
        got, ids,
        "everything arrived (at least once) over a new connection"
    );
    h.clean_up().await;
    db.finish().await;
}

async fn outage<H: Outage>() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let mut h = H::start(&db).await;
    let w = start_relayer(&db, &h, "outage", 2_000);
    let mut ids = fill(&c, 100).await;
    drained(&c).await;
    h.stop().await;
    ids.extend(fill(&c, 200).await);
    circuit_opens(&w).await;
    assert_no_attempts_while_open(&c).await;
    h.restart().await;
    drained(&c).await;
    assert_eq!(
        w.metric(CIRCUIT_STATE).await,
        Some(CLOSED),
        "the circuit closed once the server was back"
    );
    let most: i64 = common::count(
        &c,
        "SELECT coalesce(max(attempt_no), 0)::bigint FROM outbox.attempts",
    )
    .await;
    assert!(
        most <= 4,
        "an outage costs a message a few attempts, not its budget ({most})"
    );
    stop_relayer(w).await;
    let got: HashSet<Uuid> = h.received().await.iter().map(|a| a.id).collect();
    assert_eq!(got, ids, "everything delivered once it was back");
    h.clean_up().await;
    db.finish().await;
}

async fn deadline<H: Freeze>() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let mut h = H::start(&db).await;
    let w = start_relayer(&db, &h, "deadline", 1_000);
    let mut ids = fill(&c, 50).await;
    drained(&c).await;
    h.freeze().await;
    let frozen = std::time::Instant::now();
    ids.extend(fill(&c, 100).await);
    // The dispatch deadline's reason, or the client's own timeout where the destination
    // gives its client the same deadline and it fires first.
    let timed_out = || async {
        common::count(&c, "SELECT count(*) FROM outbox.attempts WHERE state = 'RETRYABLE' \
               AND (error = 'destination d did not answer within 1000 ms' OR error ILIKE '%time%out%')").await
    };
    eventually(MINUTE, "a retryable attempt at the deadline", || async {
        timed_out().await > 0
    })
    .await;
    assert!(
        frozen.elapsed() < Duration::from_secs(10),
        "the first batch was given up at its 1 s deadline, not later ({:?})",
        frozen.elapsed()
    );
    circuit_opens(&w).await;
    assert_no_attempts_while_open(&c).await;
    h.thaw().await;
    drained(&c).await;
    stop_relayer(w).await;
    let got: HashSet<Uuid> = h.received().await.iter().map(|a| a.id).collect();
    assert!(ids.is_subset(&got), "everything delivered after the stall");
    h.clean_up().await;
    db.finish().await;
}

/// A part whose first call is answered after its publish window closed: a run of key `k`
/// (its head goes in the first call with the unkeyed messages, the rest one call each) beside
/// unkeyed messages. The first call's messages arrive and are delivered; nothing after it is
/// sent, and the rest comes back not attempted, with the window's reason. Then the
/// destination itself, called with a closed window, sends nothing.
async fn window_closes_mid_part<H: InProcess>() {
    let db = TestDb::new().await;
    let h = H::start(&db).await;
    let deadline = Duration::from_secs(10);
    let real = window::build(&h, deadline);
    let dispatcher = window::dispatcher(
        std::sync::Arc::new(window::AnswersAfterTheWindow(real.clone())),
        deadline,
    );
    let keys = [
        Some("k"),
        None,
        None,
        Some("k"),
        None,
        None,
        None,
        Some("k"),
    ];
    let part: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(n, k)| window::message(*k, n))
        .collect();
    let first_call: HashSet<Uuid> = part
        .iter()
        .enumerate()
        .filter(|(n, m)| m.key.is_none() || *n == 0)
        .map(|(_, m)| m.id.0)
        .collect();
    let (mut parts, unrouted) = dispatcher.split(part.clone());
    assert!(unrouted.is_empty());
    let outcomes = dispatcher
        .publish(&parts.remove(0), &window::open_window())
        .await;
    for (m, outcome) in part.iter().zip(&outcomes) {
        if first_call.contains(&m.id.0) {
            assert_eq!(
                *outcome,
                Outcome::Delivered,
                "sent while the window was open"
            );
        } else {
            assert!(
                matches!(outcome, Outcome::NotAttempted { .. }),
                "the rest of the run is given back: {outcome:?}"
            );
        }
    }
    assert_eq!(
        outcomes[3],
        Window::closed(),
        "the run stops at k's second message"
    );

    let closed = window::open_window();
    closed.close();
    let late: Vec<_> = (0..5).map(|n| window::message(None, 100 + n)).collect();
    let outcomes = real.publish(&late, &closed).await;
    assert_eq!(
        outcomes,
        vec![Window::closed(); late.len()],
        "a destination called with a closed window sends nothing"
    );

    let arrived: HashSet<Uuid> = h.received().await.iter().map(|a| a.id).collect();
    assert_eq!(
        arrived, first_call,
        "exactly what was sent before the window closed arrived"
    );
    h.clean_up().await;
    db.finish().await;
}

/// The scenarios every harness runs, by test name.
const EVERY_HARNESS: [&str; 4] = [
    "five_thousand_arrive_exactly_once_with_the_outbox_id",
    "a_redelivery_is_recognisable_by_the_outbox_id",
    "message_headers_and_trace_context_arrive",
    "a_permanent_refusal_dead_letters_only_that_message",
];

/// The scenarios that need a capability, by test name, in the order of the `conformance!`
/// arguments.
const OPTIONAL: [&str; 5] = [
    "a_header_the_protocol_cannot_carry_fails_only_its_message",
    "the_connection_killed_server_side_is_survived",
    "an_outage_opens_the_circuit_and_everything_arrives_after",
    "a_server_that_stops_answering_hits_the_dispatch_deadline",
    "nothing_is_published_after_the_window_closes_mid_part",
];

/// One optional scenario: `yes` generates its test (which needs the harness to implement
/// `$capability`, or the suite does not compile); `no` generates none, and the suite does not
/// compile if the harness implements `$capability` after all (the ambiguity trick of
/// static_assertions' `assert_not_impl_any!`), so a declaration cannot hide a capability.
macro_rules! optional {
    (yes, $capability:path, $harness:ty, $test:ident, $scenario:ident) => {
        #[tokio::test(flavor = "multi_thread")]
        async fn $test() {
            $scenario::<$harness>().await
        }
    };
    (no, $capability:path, $harness:ty, $test:ident, $scenario:ident) => {
        const _: fn() = || {
            trait AmbiguousIfImplemented<A> {
                fn check() {}
            }
            impl<T: ?Sized> AmbiguousIfImplemented<()> for T {}
            struct Implemented;
            impl<T: ?Sized + $capability> AmbiguousIfImplemented<Implemented> for T {}
            let _ = <$harness as AmbiguousIfImplemented<_>>::check;
        };
    };
}

macro_rules! supported {
    (yes) => {
        true
    };
    (no) => {
        false
    };
}

/// The suites: for each destination, a module of tests (one per scenario it supports) and its
/// column of [`MATRIX`]. A harness's capabilities are the traits it implements; its line here
/// says yes or no to each, in the order of [`OPTIONAL`], and the compiler holds the two to
/// agree.
macro_rules! conformance {
    ($(
        $suite:ident: $harness:ty, $destination:literal,
        [$header:ident, $killed:ident, $outage:ident, $stall:ident, $window:ident];
    )*) => {
        $(
            mod $suite {
                use super::*;

                #[tokio::test(flavor = "multi_thread")]
                async fn five_thousand_arrive_exactly_once_with_the_outbox_id() {
                    exactly_once::<$harness>().await
                }

                #[tokio::test(flavor = "multi_thread")]
                async fn a_redelivery_is_recognisable_by_the_outbox_id() {
                    redelivery::<$harness>().await
                }

                #[tokio::test(flavor = "multi_thread")]
                async fn message_headers_and_trace_context_arrive() {
                    headers::<$harness>().await
                }

                #[tokio::test(flavor = "multi_thread")]
                async fn a_permanent_refusal_dead_letters_only_that_message() {
                    refusal::<$harness>().await
                }

                optional!($header, UnsendableHeader, $harness,
                    a_header_the_protocol_cannot_carry_fails_only_its_message, unsendable_header);
                optional!($killed, KillConnections, $harness,
                    the_connection_killed_server_side_is_survived, connection_killed);
                optional!($outage, Outage, $harness,
                    an_outage_opens_the_circuit_and_everything_arrives_after, outage);
                optional!($stall, Freeze, $harness,
                    a_server_that_stops_answering_hits_the_dispatch_deadline, deadline);
                optional!($window, InProcess, $harness,
                    nothing_is_published_after_the_window_closes_mid_part, window_closes_mid_part);
            }
        )*

        /// Each destination with the optional scenarios it runs, in the order of [`OPTIONAL`].
        const MATRIX: &[(&str, [bool; 5])] = &[$(
            ($destination, [supported!($header), supported!($killed), supported!($outage),
                supported!($stall), supported!($window)]),
        )*];
    };
}

conformance! {
    file_conformance: jsonl::File, "file", [no, no, no, no, yes];
    stdout_conformance: jsonl::Stdout, "stdout", [no, no, no, no, no];
    http_conformance: http::Hooks, "http", [yes, yes, yes, yes, yes];
    nats_conformance: nats::JetStream, "nats", [yes, yes, yes, yes, yes];
    amqp_conformance: amqp::Rabbit, "amqp", [yes, yes, yes, yes, yes];
    redis_conformance: redis::Streams, "redis", [no, yes, yes, yes, yes];
    kafka_conformance: kafka::Tansu, "kafka", [no, yes, yes, yes, yes];
    mqtt_conformance: mqtt::Broker, "mqtt", [yes, yes, yes, yes, yes];
    pubsub_conformance: pubsub::Emulator, "pubsub", [yes, yes, yes, yes, yes];
    sqs_conformance: sqs::Queue, "sqs", [no, yes, yes, yes, yes];
    sns_conformance: sns::Topic, "sns", [no, yes, yes, yes, yes];
    kinesis_conformance: kinesis::Stream, "kinesis", [no, yes, yes, yes, yes];
    eventbridge_conformance: eventbridge::Bus, "eventbridge", [no, yes, yes, yes, yes];
}

/// The matrix of destinations and scenarios as the module docs show it.
fn matrix() -> String {
    let width = OPTIONAL
        .iter()
        .chain(&EVERY_HARNESS)
        .map(|s| s.len())
        .max()
        .unwrap();
    let mut table = format!("| {:width$} |", "scenario");
    for (destination, _) in MATRIX {
        table.push_str(&format!(" {destination} |"));
    }
    table.push('\n');
    table.push_str(&format!("|{}|", "-".repeat(width + 2)));
    for (destination, _) in MATRIX {
        table.push_str(&format!("{}|", "-".repeat(destination.len() + 2)));
    }
    table.push('\n');
    let rows = EVERY_HARNESS
        .iter()
        .map(|s| (*s, None))
        .chain(OPTIONAL.iter().enumerate().map(|(i, s)| (*s, Some(i))));
    for (scenario, optional) in rows {
        table.push_str(&format!("| {scenario:width$} |"));
        for (destination, runs) in MATRIX {
            let mark = if optional.is_none_or(|i| runs[i]) {
                "yes"
            } else {
                "-"
            };
            table.push_str(&format!(" {mark:^w$} |", w = destination.len()));
        }
        table.push('\n');
    }
    table
}

/// Prints which scenarios run for which destination (`cargo test --test destinations matrix
/// -- --nocapture`), and holds the module docs to it.
#[test]
fn the_matrix_of_destinations_and_scenarios_is_the_documented_one() {
    let table = matrix();
    println!("{table}");
    let documented: String = include_str!("main.rs")
        .lines()
        .filter_map(|l| l.strip_prefix("//! "))
        .filter(|l| l.starts_with('|'))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(
        documented, table,
        "the matrix in the module docs of tests/destinations/main.rs is not the suite's; it is:\n{table}"
    );
}

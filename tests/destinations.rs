//! Destinations against the real servers on this machine (Redis 127.0.0.1:6379, NATS with
//! JetStream 127.0.0.1:4222, RabbitMQ 127.0.0.1:5672, and an HTTP server the test starts),
//! driven through the built binary with a TOML config of destinations and routes.

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Relayer, TestDb, eventually, pending};
use tokio_postgres::Client;
use uuid::Uuid;

const MINUTE: Duration = Duration::from_secs(60);

/// Fails (never skips) when a server the test needs does not answer.
async fn require(name: &str, addr: &str, how: &str) {
    if tokio::net::TcpStream::connect(addr).await.is_err() {
        panic!("{name} is not reachable on {addr}; start it with: {how} (.ci/run starts it)");
    }
}

async fn fill(c: &Client, topic: &str, n: i64) -> HashSet<Uuid> {
    common::fill(c, topic, n, None).await.into_iter().collect()
}

async fn histories(c: &Client) -> Vec<String> {
    c.query(
        "SELECT string_agg(attempt_no || ':' || state, ' ' ORDER BY attempt_no) \
         FROM outbox.attempts GROUP BY outbox_id ORDER BY 1",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Once the circuit is open and the batches claimed before it opened have settled, no
/// attempt is recorded for a second (the cool-down of the callers is longer than that).
async fn assert_no_attempts_while_open(c: &Client) {
    eventually(
        MINUTE,
        "batches claimed before the circuit opened to settle",
        || async {
            c.query_one(
                "SELECT count(*) FROM outbox.messages WHERE lease_token IS NOT NULL",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
                == 0
        },
    )
    .await;
    let attempts = || async {
        c.query_one("SELECT count(*) FROM outbox.attempts", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let at_open = attempts().await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        attempts().await,
        at_open,
        "no attempts while the circuit is open"
    );
}

/// Starts a relayer with `config` (TOML, written to the test's directory) and `extra` flags.
fn start_with_config(db: &TestDb, worker: &str, config: &str, extra: &[&str]) -> Relayer {
    let path = db.scratch_dir().join(format!("{worker}.toml"));
    std::fs::write(&path, config).unwrap();
    let path = path.display().to_string();
    let mut args = vec!["--config", &path, "--no-telemetry"];
    args.extend_from_slice(extra);
    Relayer::start(db, worker, &args)
}

/// Runs a relayer with `config` (TOML) until the outbox is empty, then stops it.
async fn relay_until_drained(db: &TestDb, c: &Client, config: &str, extra: &[&str]) -> Relayer {
    let mut args = vec!["--retry-base-ms", "50", "--retry-cap-ms", "200"];
    args.extend_from_slice(extra);
    let mut w = start_with_config(db, "dest", config, &args);
    eventually(2 * MINUTE, "the outbox to drain", || async {
        pending(c).await == 0
    })
    .await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());
    w
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_streams_receive_5000_messages_exactly_once() {
    require("Redis", "127.0.0.1:6379", "redis-server --daemonize yes").await;
    let db = TestDb::new().await;
    let c = db.client().await;
    let ids = fill(&c, "orders", 5000).await;
    let stream_prefix = format!("outbox-test:{}", db.name);
    let config = format!(
        "[destinations.streams]\ntype = \"redis\"\nstream = \"{stream_prefix}:{{topic}}\"\n\n\
         [[routes]]\ntopic = \"*\"\ndestination = \"streams\"\n"
    );
    relay_until_drained(&db, &c, &config, &[]).await;

    let client = redis::Client::open("redis://127.0.0.1:6379").unwrap();
    let mut r = client.get_multiplexed_async_connection().await.unwrap();
    let stream = format!("{stream_prefix}:orders");
    let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(&stream)
        .arg("-")
        .arg("+")
        .query_async(&mut r)
        .await
        .unwrap();
    let got: Vec<Uuid> = entries
        .ids
        .iter()
        .map(|e| e.get::<String>("outbox_id").unwrap().parse().unwrap())
        .collect();
    assert_eq!(got.len(), 5000, "one entry per message");
    assert_eq!(got.into_iter().collect::<HashSet<_>>(), ids);
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut r)
        .await
        .unwrap();
    assert!(histories(&c).await.iter().all(|h| h == "1:DISPATCHED"));
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_jetstream_receives_5000_once_and_drops_a_redelivery() {
    require("NATS", "127.0.0.1:4222", "nats-server -js").await;
    let db = TestDb::new().await;
    let c = db.client().await;
    let ids = fill(&c, "orders", 5000).await;
    let prefix = db.name.replace('_', "-");
    let nats = async_nats::connect("127.0.0.1:4222").await.unwrap();
    let js = async_nats::jetstream::new(nats);
    let mut stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: prefix.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .unwrap();
    let config = format!(
        "[destinations.events]\ntype = \"nats\"\nsubject = \"{prefix}.{{topic}}\"\n\n\
         [destinations.nowhere]\ntype = \"nats\"\nsubject = \"no-stream-{prefix}.{{topic}}\"\n\n\
         [[routes]]\ntopic = \"lost.*\"\ndestination = \"nowhere\"\n\n\
         [[routes]]\ntopic = \"*\"\ndestination = \"events\"\n"
    );
    let lost = fill(&c, "lost.one", 3).await;
    relay_until_drained(&db, &c, &config, &[]).await;

    let info = stream.info().await.unwrap();
    assert_eq!(info.state.messages, 5000);
    // Redeliver one already-delivered outbox_id: JetStream's duplicate window drops it.
    let one = ids.iter().next().unwrap().to_string();
    let ack = js
        .send_publish(
            format!("{prefix}.orders"),
            async_nats::jetstream::message::PublishMessage::build()
                .payload("again".into())
                .message_id(&one),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(ack.duplicate, "same Nats-Msg-Id within the window");
    assert_eq!(stream.info().await.unwrap().state.messages, 5000);

    let dead = common::dead_letters(&c).await;
    assert_eq!(dead.iter().map(|d| d.0).collect::<HashSet<_>>(), lost);
    assert!(
        dead.iter().all(|d| d.1.contains("no JetStream stream")),
        "{dead:?}"
    );
    js.delete_stream(&prefix).await.unwrap();
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_confirms_5000_messages_and_reports_unroutable_ones() {
    use lapin::options::QueueDeleteOptions;
    require("RabbitMQ", "127.0.0.1:5672", "rabbitmq-server -detached").await;
    let db = TestDb::new().await;
    let c = db.client().await;
    let ids = fill(&c, "orders", 5000).await;
    let unroutable = fill(&c, "nobody.listens", 2).await;
    let queue = format!("{}-orders", db.name);
    let (_conn, ch) = declare_queue(&queue).await;
    // Default exchange: the routing key is the queue name.
    let config = format!(
        "[destinations.rabbit]\ntype = \"amqp\"\nexchange = \"\"\nrouting_key = \"{}-{{topic}}\"\n\n\
         [[routes]]\ntopic = \"*\"\ndestination = \"rabbit\"\n",
        db.name
    );
    relay_until_drained(&db, &c, &config, &[]).await;

    let received = take_message_ids(&ch, &queue).await;
    let got: HashSet<Uuid> = received.iter().copied().collect();
    assert_eq!(got.len(), received.len(), "a message arrived twice");
    assert_eq!(got, ids);
    let dead = common::dead_letters(&c).await;
    assert_eq!(dead.iter().map(|d| d.0).collect::<HashSet<_>>(), unroutable);
    assert!(dead.iter().all(|d| d.1.contains("unroutable")), "{dead:?}");
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    db.finish().await;
}

/// A RabbitMQ queue named `queue` (declared on the default exchange, so the routing key
/// is the queue name), with the connection and channel that declared it.
async fn declare_queue(queue: &str) -> (lapin::Connection, lapin::Channel) {
    let conn =
        lapin::Connection::connect("amqp://guest:guest@127.0.0.1:5672/%2f", Default::default())
            .await
            .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        queue.into(),
        lapin::options::QueueDeclareOptions::default(),
        Default::default(),
    )
    .await
    .unwrap();
    (conn, ch)
}

/// Takes every message from `queue`; returns their message_ids (outbox_ids) in order,
/// checking each was published persistent.
async fn take_message_ids(ch: &lapin::Channel, queue: &str) -> Vec<Uuid> {
    let mut ids = Vec::new();
    while let Some(m) = ch
        .basic_get(
            queue.into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
    {
        assert_eq!(
            m.delivery.properties.delivery_mode(),
            &Some(2),
            "persistent"
        );
        let id = m
            .delivery
            .properties
            .message_id()
            .as_ref()
            .unwrap()
            .to_string();
        ids.push(id.parse().unwrap());
    }
    ids
}

/// What the test HTTP server saw, and how it answers.
#[derive(Default)]
struct Hook {
    requests: Vec<(axum::http::HeaderMap, Vec<u8>)>,
    /// Status codes to answer first, in order; then 200.
    script: Vec<u16>,
    /// Status for every request to topic `rejected`.
    down: bool,
}

impl Hook {
    /// The outbox ids the server received (the `idempotency-key` header), without repeats.
    fn delivered_ids(&self) -> HashSet<Uuid> {
        self.requests
            .iter()
            .map(|(h, _)| h["idempotency-key"].to_str().unwrap().parse().unwrap())
            .collect()
    }
}

async fn start_hook(hook: Arc<Mutex<Hook>>) -> (String, tokio::task::JoinHandle<()>) {
    start_hook_on(hook, 0).await
}

/// The test webhook server on 127.0.0.1:`port` (0: any free port).
async fn start_hook_on(hook: Arc<Mutex<Hook>>, port: u16) -> (String, tokio::task::JoinHandle<()>) {
    use axum::http::StatusCode;
    let app = axum::Router::new().route(
        "/hooks/{topic}",
        axum::routing::post(
            |axum::extract::Path(topic): axum::extract::Path<String>,
             axum::extract::State(hook): axum::extract::State<Arc<Mutex<Hook>>>,
             headers: axum::http::HeaderMap,
             body: axum::body::Bytes| async move {
                let mut h = hook.lock().unwrap();
                if h.down {
                    return StatusCode::SERVICE_UNAVAILABLE;
                }
                h.requests.push((headers, body.to_vec()));
                if topic == "rejected" {
                    return StatusCode::BAD_REQUEST;
                }
                if h.script.is_empty() {
                    StatusCode::OK
                } else {
                    StatusCode::from_u16(h.script.remove(0)).unwrap()
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let url = format!("http://{}/hooks/{{topic}}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        axum::serve(listener, app.with_state(hook)).await.unwrap();
    });
    (url, server)
}

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

#[tokio::test(flavor = "multi_thread")]
async fn http_webhooks_5000_exactly_once_signed_retried_and_rejected() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let ids = fill(&c, "orders", 5000).await;
    let rejected = fill(&c, "rejected", 1).await;
    let hook = Arc::new(Mutex::new(Hook {
        script: vec![503],
        ..Hook::default()
    }));
    let (url, _server) = start_hook(hook.clone()).await;
    let config = format!(
        "[destinations.hooks]\ntype = \"http\"\nurl = \"{url}\"\nsigning_secret = \"{SECRET}\"\n\n\
         [[routes]]\ntopic = \"*\"\ndestination = \"hooks\"\n"
    );
    relay_until_drained(&db, &c, &config, &[]).await;

    {
        let h = hook.lock().unwrap();
        let key =
            |hm: &axum::http::HeaderMap, n: &str| hm.get(n).map(|v| v.to_str().unwrap().to_owned());
        let delivered: HashSet<Uuid> = h
            .requests
            .iter()
            .filter(|(hm, _)| key(hm, "outbox-topic").as_deref() == Some("orders"))
            .map(|(hm, _)| key(hm, "idempotency-key").unwrap().parse().unwrap())
            .collect();
        assert_eq!(delivered, ids, "every message reached the server");
        assert_eq!(
            h.requests.len(),
            5000 + 1 + 1,
            "5000 + one 503 retried + one rejected"
        );

        // Verify every signature independently (Standard Webhooks: HMAC-SHA256, base64).
        use base64::Engine;
        use hmac::Mac;
        let secret = base64::engine::general_purpose::STANDARD
            .decode(SECRET.trim_start_matches("whsec_"))
            .unwrap();
        for (hm, body) in &h.requests {
            let id = key(hm, "webhook-id").unwrap();
            assert_eq!(Some(id.clone()), key(hm, "idempotency-key"));
            let ts = key(hm, "webhook-timestamp").unwrap();
            let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&secret).unwrap();
            mac.update(format!("{id}.{ts}.").as_bytes());
            mac.update(body);
            let expected =
                base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
            assert_eq!(
                key(hm, "webhook-signature").unwrap(),
                format!("v1,{expected}")
            );
        }
    }

    let mut hist = histories(&c).await;
    hist.sort();
    assert_eq!(
        hist.iter()
            .filter(|h| *h == "1:RETRYABLE 2:DISPATCHED")
            .count(),
        1,
        "503 then 200"
    );
    assert_eq!(
        hist.iter().filter(|h| *h == "1:FAILED").count(),
        1,
        "400 dead-letters"
    );
    assert_eq!(hist.iter().filter(|h| *h == "1:DISPATCHED").count(), 4999);
    let dead = common::dead_letters(&c).await;
    assert_eq!(dead.iter().map(|d| d.0).collect::<HashSet<_>>(), rejected);
    assert!(dead[0].1.contains("400"), "{dead:?}");
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_http_server_opens_the_circuit_and_nothing_is_attempted_until_it_is_back() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let hook = Arc::new(Mutex::new(Hook::default()));
    let (url, server) = start_hook(hook.clone()).await;
    let port: u16 = url
        .split(':')
        .nth(2)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let config = format!(
        "[destinations.hooks]\ntype = \"http\"\nurl = \"{url}\"\ntimeout_ms = 1000\n\n\
         [[routes]]\ntopic = \"*\"\ndestination = \"hooks\"\n"
    );
    let mut w = start_with_config(
        &db,
        "breaker",
        &config,
        &[
            "--retry-base-ms",
            "10",
            "--retry-cap-ms",
            "20",
            "--circuit-failures",
            "3",
            "--circuit-cooldown-ms",
            "3000",
            "--batch-size",
            "50",
        ],
    );
    let first = fill(&c, "orders", 100).await;
    eventually(MINUTE, "the first messages to be delivered", || async {
        pending(&c).await == 0
    })
    .await;

    // The destination goes away mid-run.
    server.abort();
    let _ = server.await;
    let rest = fill(&c, "orders", 200).await;
    eventually(MINUTE, "the circuit to open", || async {
        w.log_text().contains("circuit open")
    })
    .await;
    assert_no_attempts_while_open(&c).await;

    // It comes back on the same address: everything is delivered, no restart needed.
    let (_, _server) = start_hook_on(hook.clone(), port).await;
    eventually(
        MINUTE,
        "everything to be delivered once it is back",
        || async { pending(&c).await == 0 },
    )
    .await;
    assert!(w.log_text().contains("circuit closed"), "{}", w.log_text());
    let delivered = hook.lock().unwrap().delivered_ids();
    assert_eq!(delivered, first.union(&rest).copied().collect());
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_outage_costs_one_attempt_per_failure_and_probe_and_no_message_two() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let hook = Arc::new(Mutex::new(Hook {
        down: true,
        ..Hook::default()
    }));
    let (url, _server) = start_hook(hook.clone()).await;
    let config = db.scratch_dir().join("outage.toml");
    std::fs::write(
        &config,
        format!(
            "[destinations.hooks]\ntype = \"http\"\nurl = \"{url}\"\n\n\
             [[routes]]\ntopic = \"*\"\ndestination = \"hooks\"\n"
        ),
    )
    .unwrap();
    let telemetry = format!("127.0.0.1:{}", common::free_port());
    // Defaults otherwise: batch 500, 3 batches in flight.
    let mut w = Relayer::start(
        &db,
        "outage",
        &[
            "--config",
            &config.display().to_string(),
            "--telemetry-addr",
            &telemetry,
            "--circuit-failures",
            "5",
            "--circuit-cooldown-ms",
            "1000",
        ],
    );
    let all = fill(&c, "orders", 3000).await;
    let outage = std::time::Instant::now();
    eventually(MINUTE, "the circuit to open", || async {
        w.log_text().contains("circuit open")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let (status, body) = outbox_relay::http::probe(&telemetry, "/readyz")
        .await
        .unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("destination hooks: down"), "{body}");

    let r = c
        .query_one(
            "SELECT coalesce(sum(n), 0)::bigint, coalesce(max(n), 0)::int \
             FROM (SELECT count(*) AS n FROM outbox.attempts GROUP BY outbox_id) AS a",
            &[],
        )
        .await
        .unwrap();
    let (attempts, most): (i64, i32) = (r.get(0), r.get(1));
    let probes = i64::try_from(outage.elapsed().as_secs()).unwrap() + 1;
    assert!(
        (5..=5 + probes).contains(&attempts),
        "{attempts} attempts in a {probes} s outage (5 failures to open + one per probe)"
    );
    assert_eq!(most, 1, "no message gets two attempts from one outage");
    let log = w.log_text();
    for change in [
        "circuit open",
        "circuit half-open",
        "not claiming its topics",
    ] {
        assert!(log.contains(change), "{change:?} not logged:\n{log}");
    }

    hook.lock().unwrap().down = false;
    eventually(
        MINUTE,
        "everything to be delivered once it is back",
        || async { pending(&c).await == 0 },
    )
    .await;
    assert!(w.log_text().contains("circuit closed"), "{}", w.log_text());
    let delivered = hook.lock().unwrap().delivered_ids();
    assert_eq!(delivered, all);
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_connection_loss_and_a_stalled_server_are_survived() {
    // A Redis of its own: the test kills its connections and freezes it.
    let port = common::free_port();
    let server = std::process::Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server (Debian package redis-server) must be installed");
    let server = KillOnDrop(server);
    let url = format!("redis://127.0.0.1:{port}");
    eventually(MINUTE, "the test's redis-server to answer", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    let db = TestDb::new().await;
    let c = db.client().await;
    let stream = format!("outbox-test:{}", db.name);
    let config = format!(
        "[destinations.streams]\ntype = \"redis\"\nurl = \"{url}\"\nstream = \"{stream}\"\ntimeout_ms = 300\n\n\
         [[routes]]\ntopic = \"*\"\ndestination = \"streams\"\n"
    );
    let mut w = start_with_config(
        &db,
        "redis-loss",
        &config,
        &[
            "--retry-base-ms",
            "10",
            "--retry-cap-ms",
            "20",
            "--circuit-failures",
            "2",
            "--circuit-cooldown-ms",
            "3000",
            "--batch-size",
            "50",
        ],
    );
    let admin = redis::Client::open(url.as_str()).unwrap();
    let mut r = admin.get_multiplexed_async_connection().await.unwrap();
    let mut ids = fill(&c, "orders", 100).await;
    eventually(MINUTE, "the first messages", || async {
        pending(&c).await == 0
    })
    .await;

    // The server closes our connection.
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("SKIPME")
        .arg("yes")
        .query_async(&mut r)
        .await
        .unwrap();
    assert!(killed >= 1);
    ids.extend(fill(&c, "orders", 100).await);
    eventually(MINUTE, "delivery after reconnecting", || async {
        pending(&c).await == 0
    })
    .await;

    // The server stalls (frozen: accepts nothing, answers nothing): timeouts open the circuit.
    let pid = server.0.id().to_string();
    let signal = |name: &str| {
        std::process::Command::new("kill")
            .args([name, &pid])
            .status()
            .unwrap();
    };
    signal("-STOP");
    ids.extend(fill(&c, "orders", 100).await);
    eventually(MINUTE, "the circuit to open", || async {
        w.log_text().contains("circuit open")
    })
    .await;
    assert_no_attempts_while_open(&c).await;
    signal("-CONT");
    eventually(MINUTE, "delivery after the stall", || async {
        pending(&c).await == 0
    })
    .await;
    assert!(w.log_text().contains("circuit closed"), "{}", w.log_text());

    let mut r = admin.get_multiplexed_async_connection().await.unwrap();
    let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(&stream)
        .arg("-")
        .arg("+")
        .query_async(&mut r)
        .await
        .unwrap();
    let got: HashSet<Uuid> = entries
        .ids
        .iter()
        .map(|e| e.get::<String>("outbox_id").unwrap().parse().unwrap())
        .collect();
    assert_eq!(got, ids, "every message arrived (at least once)");
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut r)
        .await
        .unwrap();
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));
    drop(server);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_topic_no_route_takes_is_dead_lettered_with_the_reason() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let out = db.scratch_dir().join("orders.jsonl");
    let config = format!(
        "[destinations.files]\ntype = \"file\"\npath = \"{}\"\n\n\
         [[routes]]\ntopic = \"orders.*\"\ndestination = \"files\"\n",
        out.display()
    );
    let routed = fill(&c, "orders.created", 10).await;
    let stray = fill(&c, "payments", 2).await;
    relay_until_drained(&db, &c, &config, &[]).await;
    let lines = std::fs::read_to_string(&out).unwrap();
    assert_eq!(lines.lines().count(), routed.len());
    let dead = common::dead_letters(&c).await;
    assert_eq!(dead.iter().map(|d| d.0).collect::<HashSet<_>>(), stray);
    assert!(
        dead.iter()
            .all(|d| d.1.contains("no route for topic \"payments\"")),
        "{dead:?}"
    );
    db.finish().await;
}

/// A server process the test started, stopped however the test ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Closes the RabbitMQ connection of process `pid` from the server side.
fn close_rabbit_connection_of(pid: u32) -> bool {
    let out = std::process::Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "--quiet",
            "--no-table-headers",
            "pid",
            "client_properties",
        ])
        .output()
        .expect("rabbitmqctl (installed with rabbitmq-server)");
    let listing = String::from_utf8_lossy(&out.stdout);
    let needle = format!("outbox-relay pid {pid}\"");
    let Some(line) = listing.lines().find(|l| l.contains(&needle)) else {
        return false;
    };
    let connection = line.split('\t').next().unwrap().trim();
    std::process::Command::new("rabbitmqctl")
        .args([
            "close_connection",
            connection,
            "closed by the connection-loss test",
        ])
        .status()
        .expect("rabbitmqctl close_connection")
        .success()
}

#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_closing_the_connection_server_side_is_survived() {
    use lapin::options::QueueDeleteOptions;
    require("RabbitMQ", "127.0.0.1:5672", "rabbitmq-server -detached").await;
    let db = TestDb::new().await;
    let c = db.client().await;
    let queue = format!("{}-loss", db.name);
    let (_conn, ch) = declare_queue(&queue).await;
    let config = format!(
        "[destinations.rabbit]\ntype = \"amqp\"\nrouting_key = \"{queue}\"\n\n\
         [[routes]]\ntopic = \"*\"\ndestination = \"rabbit\"\n"
    );
    let mut w = start_with_config(
        &db,
        "rabbit-loss",
        &config,
        &["--retry-base-ms", "10", "--retry-cap-ms", "50"],
    );
    let mut ids = fill(&c, "orders", 100).await;
    eventually(MINUTE, "the first messages", || async {
        pending(&c).await == 0
    })
    .await;
    assert!(
        close_rabbit_connection_of(w.pid()),
        "the relayer's connection was found and closed"
    );
    ids.extend(fill(&c, "orders", 100).await);
    eventually(MINUTE, "delivery over a new connection", || async {
        pending(&c).await == 0
    })
    .await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));

    let got: HashSet<Uuid> = take_message_ids(&ch, &queue).await.into_iter().collect();
    assert_eq!(got, ids, "every message confirmed (at least once)");
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    db.finish().await;
}

/// A nats-server with JetStream of the test's own, on `port`, storing in `dir`.
fn start_nats(port: u16, dir: &std::path::Path) -> KillOnDrop {
    let child = std::process::Command::new("nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .or_else(|_| {
            std::process::Command::new("/usr/sbin/nats-server")
                .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
                .arg(dir)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
        })
        .expect("nats-server (Debian package nats-server) must be installed");
    KillOnDrop(child)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_nats_server_restart_mid_run_is_survived_and_deduplicated() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let port = common::free_port();
    let store = db.scratch_dir().join("jetstream");
    let server = start_nats(port, &store);
    let url = format!("nats://127.0.0.1:{port}");
    eventually(MINUTE, "the test's nats-server to answer", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    let js = async_nats::jetstream::new(async_nats::connect(&url).await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "RESTART".into(),
        subjects: vec!["restart.>".into()],
        duplicate_window: Duration::from_secs(120),
        storage: async_nats::jetstream::stream::StorageType::File,
        ..Default::default()
    })
    .await
    .unwrap();
    let config = format!(
        "[destinations.events]\ntype = \"nats\"\nurl = \"{url}\"\nsubject = \"restart.{{topic}}\"\ntimeout_ms = 500\n\n\
         [[routes]]\ntopic = \"*\"\ndestination = \"events\"\n"
    );
    let mut w = start_with_config(
        &db,
        "nats-restart",
        &config,
        &[
            "--retry-base-ms",
            "10",
            "--retry-cap-ms",
            "50",
            "--circuit-failures",
            "2",
            "--circuit-cooldown-ms",
            "3000",
        ],
    );
    let mut ids = fill(&c, "orders", 100).await;
    eventually(MINUTE, "the first messages", || async {
        pending(&c).await == 0
    })
    .await;

    // The server goes away mid-run, then comes back on the same port and store.
    drop(server);
    ids.extend(fill(&c, "orders", 100).await);
    eventually(MINUTE, "the circuit to open", || async {
        w.log_text().contains("circuit open")
    })
    .await;
    assert_no_attempts_while_open(&c).await;
    let _server = start_nats(port, &store);
    eventually(MINUTE, "delivery after the restart", || async {
        pending(&c).await == 0
    })
    .await;
    assert!(w.log_text().contains("circuit closed"), "{}", w.log_text());
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));

    let js = async_nats::jetstream::new(async_nats::connect(&url).await.unwrap());
    let mut stream = js.get_stream("RESTART").await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        ids.len() as u64,
        "every message stored once: redeliveries were dropped by Nats-Msg-Id"
    );
    db.finish().await;
}

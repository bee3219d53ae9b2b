//! Harness of the `http` destination: a webhook server of the test's own (axum), which
//! records every request and can answer a script of statuses, go down, or stop answering.
//! Also the HTTP-only checks: Standard Webhooks signatures, retries on 503, and a topic
//! that must stay one path segment.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use axum::http::{HeaderMap, StatusCode};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::common::{self, TestDb};
use crate::{
    Arrived, Freeze, Harness, InProcess, KillConnections, MINUTE, Outage, UnsendableHeader,
    drained, histories,
};

/// What the server saw, and how it answers.
#[derive(Default)]
pub struct Seen {
    /// The topic in the request path (percent-decoded), the headers and the body.
    pub requests: Vec<(String, HeaderMap, Vec<u8>)>,
    /// Status codes to answer first, in order; then 200.
    pub script: Vec<u16>,
    /// Answer 503 to everything.
    pub down: bool,
    /// Hold every request unanswered.
    pub frozen: bool,
    /// Take every request (it is recorded) and answer 200 only after this long.
    pub late: Option<std::time::Duration>,
    /// Take every request of this topic (it is recorded) and answer 200 only after this
    /// long; other topics are answered as usual.
    pub slow_topic: Option<(String, std::time::Duration)>,
}

/// The test webhook server: POST /hooks/{topic}; topic `rejected` gets 400.
pub struct Hooks {
    pub seen: Arc<Mutex<Seen>>,
    port: u16,
    server: Option<(CancellationToken, tokio::task::JoinHandle<()>)>,
}

impl Hooks {
    pub async fn serve() -> Hooks {
        let mut hooks = Hooks {
            seen: Arc::default(),
            port: common::free_port(),
            server: None,
        };
        hooks.listen().await;
        hooks
    }

    /// `url` of the destination: `http://127.0.0.1:PORT/hooks/{topic}`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hooks/{{topic}}", self.port)
    }

    async fn listen(&mut self) {
        let app = axum::Router::new().route(
            "/hooks/{topic}",
            axum::routing::post(
                |axum::extract::Path(topic): axum::extract::Path<String>,
                 axum::extract::State(seen): axum::extract::State<Arc<Mutex<Seen>>>,
                 headers: HeaderMap,
                 body: axum::body::Bytes| async move {
                    while seen.lock().unwrap().frozen {
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    }
                    let late = {
                        let s = seen.lock().unwrap();
                        match &s.slow_topic {
                            Some((slow, after)) if *slow == topic => Some(*after),
                            _ => s.late,
                        }
                    };
                    if let Some(after) = late {
                        seen.lock()
                            .unwrap()
                            .requests
                            .push((topic, headers, body.to_vec()));
                        tokio::time::sleep(after).await;
                        return StatusCode::OK;
                    }
                    let mut s = seen.lock().unwrap();
                    if s.down {
                        return StatusCode::SERVICE_UNAVAILABLE;
                    }
                    let rejected = topic == "rejected";
                    s.requests.push((topic, headers, body.to_vec()));
                    if rejected {
                        StatusCode::BAD_REQUEST
                    } else if s.script.is_empty() {
                        StatusCode::OK
                    } else {
                        StatusCode::from_u16(s.script.remove(0)).unwrap()
                    }
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", self.port))
            .await
            .unwrap();
        let stop = CancellationToken::new();
        let serving = axum::serve(listener, app.with_state(self.seen.clone()))
            .with_graceful_shutdown(stop.clone().cancelled_owned());
        let task = tokio::spawn(async move {
            serving.await.unwrap();
        });
        self.server = Some((stop, task));
    }

    /// Stops listening and closes every connection.
    async fn shut(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            stop.cancel();
            task.await.unwrap();
        }
    }

    /// The outbox ids received on `topic` (the `idempotency-key` header), without repeats.
    pub fn delivered(&self, topic: &str) -> HashSet<Uuid> {
        self.seen
            .lock()
            .unwrap()
            .requests
            .iter()
            .filter(|(t, _, _)| t == topic)
            .map(|(_, h, _)| h["idempotency-key"].to_str().unwrap().parse().unwrap())
            .collect()
    }
}

impl Harness for Hooks {
    const DEDUPES: bool = false;

    async fn start(_: &TestDb) -> Self {
        Hooks::serve().await
    }

    fn table(&self) -> String {
        format!("type = \"http\"\nurl = \"{}\"\n", self.url())
    }

    async fn received(&self) -> Vec<Arrived> {
        self.seen
            .lock()
            .unwrap()
            .requests
            .iter()
            .filter(|(topic, _, _)| topic == "orders")
            .map(|(_, h, _)| Arrived {
                id: h["idempotency-key"].to_str().unwrap().parse().unwrap(),
                headers: h
                    .iter()
                    .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap().to_owned()))
                    .collect::<BTreeMap<_, _>>(),
            })
            .collect()
    }

    async fn refused_message(&self, c: &Client) -> (Uuid, &'static str) {
        (
            crate::enqueue(
                c,
                "rejected",
                None,
                serde_json::json!({ "secret": crate::REFUSED_PAYLOAD_MARK }),
            )
            .await,
            "HTTP 400",
        )
    }
}

impl UnsendableHeader for Hooks {
    fn unsendable_header(&self) -> (String, String) {
        ("bad name".into(), "x".into())
    }
}

impl KillConnections for Hooks {
    async fn kill_connections(&mut self) {
        self.shut().await;
        self.listen().await;
    }
}

impl Outage for Hooks {
    async fn stop(&mut self) {
        self.shut().await;
    }

    async fn restart(&mut self) {
        self.listen().await;
    }
}

impl Freeze for Hooks {
    async fn freeze(&mut self) {
        self.seen.lock().unwrap().frozen = true;
    }

    async fn thaw(&mut self) {
        self.seen.lock().unwrap().frozen = false;
    }
}

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// A relayer with one `http` destination `hooks` at `url` and `extra` settings in its table.
pub fn relayer(
    db: &TestDb,
    worker: &str,
    url: &str,
    extra: &str,
    flags: &[&str],
) -> common::Relayer {
    let path = db.scratch_dir().join(format!("{worker}.toml"));
    std::fs::write(
        &path,
        format!(
            "[destinations.hooks]\ntype = \"http\"\nurl = \"{url}\"\n{extra}\n\
             [[routes]]\ntopic = \"*\"\ndestination = \"hooks\"\n"
        ),
    )
    .unwrap();
    let path = path.display().to_string();
    let mut args = vec![
        "--config",
        &path,
        "--retry-base-ms",
        "50",
        "--retry-cap-ms",
        "200",
    ];
    args.extend_from_slice(flags);
    if !flags.contains(&"--telemetry-addr") {
        args.push("--no-telemetry");
    }
    common::Relayer::start(db, worker, &args)
}

/// A receiver that takes every request and answers after the dispatch deadline: each call
/// was sent and may have arrived, so each is an attempt, and the attempt budget ends the
/// resending (a request the relayer made is never without its attempt row).
#[tokio::test(flavor = "multi_thread")]
async fn calls_answered_after_the_deadline_are_attempts_and_the_budget_ends_them() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let hooks = Hooks::serve().await;
    hooks.seen.lock().unwrap().late = Some(std::time::Duration::from_millis(1_500));
    let mut ids = HashSet::new();
    for i in 0..6 {
        let id: Uuid = c
            .query_one(
                "SELECT outbox.enqueue('orders', convert_to($1, 'UTF8'), p_max_attempts => 2, \
                 p_content_type => 'application/json')",
                &[&format!("{{\"n\": {i}}}")],
            )
            .await
            .unwrap()
            .get(0);
        ids.insert(id);
    }
    let mut w = relayer(
        &db,
        "late",
        &hooks.url(),
        "timeout_ms = 500",
        &["--circuit-failures", "10"],
    );
    common::eventually(MINUTE, "every message to run out of attempts", || async {
        common::count(&c, "SELECT count(*) FROM outbox.dead_letters").await == 6
    })
    .await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());
    let history = histories(&c).await;
    assert_eq!(history.len(), 6, "{history:?}");
    assert!(
        history.values().all(|h| h == "1:RETRYABLE 2:RETRYABLE"),
        "two attempts each, the budget: {history:?}"
    );
    let errors = common::count(
        &c,
        "SELECT count(*) FROM outbox.attempts WHERE error LIKE '%timed out%' \
            OR error LIKE '%did not answer%'",
    )
    .await;
    assert_eq!(errors, 12, "each attempt says it got no answer");
    let requests = hooks.seen.lock().unwrap().requests.len();
    assert_eq!(
        requests, 12,
        "as many requests as attempts: none sent without its attempt"
    );
    assert_eq!(hooks.delivered("orders"), ids);
    db.finish().await;
}

/// One slow request after quick ones, one request at a time: the quick ones answered before
/// the dispatch deadline are delivered (one request, one DISPATCHED attempt each), and only
/// the slow one is unanswered; the deadline does not turn the batch's deliveries into
/// resends.
#[tokio::test(flavor = "multi_thread")]
async fn what_was_answered_before_the_deadline_stays_delivered() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let hooks = Hooks::serve().await;
    hooks.seen.lock().unwrap().slow_topic =
        Some(("slow".into(), std::time::Duration::from_millis(1_500)));
    c.batch_execute(
        "SELECT outbox.enqueue('orders', convert_to(format('{\"n\": %s}', n), 'UTF8')) \
           FROM generate_series(1, 20) AS n; \
         SELECT outbox.enqueue('slow', convert_to('{}', 'UTF8'), p_max_attempts => 2)",
    )
    .await
    .unwrap();
    let mut w = relayer(
        &db,
        "one-slow",
        &hooks.url(),
        "timeout_ms = 500\nconcurrency = 1",
        &["--circuit-failures", "10"],
    );
    common::eventually(
        MINUTE,
        "the slow message to run out of attempts",
        || async {
            common::count(&c, "SELECT count(*) FROM outbox.dead_letters").await == 1
                && common::pending(&c).await == 0
        },
    )
    .await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());
    let history = histories(&c).await;
    let quick: Vec<&String> = history
        .values()
        .filter(|h| h.contains("DISPATCHED"))
        .collect();
    assert_eq!(quick.len(), 20, "{history:?}");
    assert!(
        quick.iter().all(|h| *h == "1:DISPATCHED"),
        "each quick message is delivered by its first request: {history:?}"
    );
    let (orders, slow) = {
        let seen = hooks.seen.lock().unwrap();
        let count = |topic: &str| seen.requests.iter().filter(|r| r.0 == topic).count();
        (count("orders"), count("slow"))
    };
    assert_eq!(orders, 20, "no quick message is sent twice");
    assert_eq!(slow, 2, "the slow one is sent once per attempt");
    db.finish().await;
}

/// One request at a time, the first one slow: it is unanswered at the dispatch deadline,
/// and the messages whose turn had not come are given back unsent, without an attempt
/// (the budget counts calls that were made), then delivered by their first attempt.
#[tokio::test(flavor = "multi_thread")]
async fn messages_not_sent_by_the_deadline_are_given_back_without_an_attempt() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let hooks = Hooks::serve().await;
    hooks.seen.lock().unwrap().slow_topic =
        Some(("slow".into(), std::time::Duration::from_millis(1_500)));
    c.batch_execute(
        "SELECT outbox.enqueue('slow', convert_to('{}', 'UTF8'), p_max_attempts => 1, \
           p_traceparent => '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'); \
         SELECT outbox.enqueue('orders', convert_to(format('{\"n\": %s}', n), 'UTF8')) \
           FROM generate_series(1, 5) AS n",
    )
    .await
    .unwrap();
    let mut w = relayer(
        &db,
        "one-at-a-time",
        &hooks.url(),
        "timeout_ms = 500\nconcurrency = 1",
        &["--circuit-failures", "10"],
    );
    common::eventually(MINUTE, "every message to be settled", || async {
        common::pending(&c).await == 0
    })
    .await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());
    let history = histories(&c).await;
    assert_eq!(history.len(), 6, "{history:?}");
    assert_eq!(
        history.values().filter(|h| *h == "1:DISPATCHED").count(),
        5,
        "the messages behind the slow one were not charged for the call they did not get: \
         {history:?}"
    );
    assert_eq!(
        history.values().filter(|h| *h == "1:RETRYABLE").count(),
        1,
        "the slow one's call is its attempt: {history:?}"
    );
    // The log line of its outcome carries its creation context's trace and span ids.
    let log = w.log_text();
    assert!(
        log.lines().any(|l| l.contains("dead-lettered")
            && l.contains("4bf92f3577b34da6a3ce929d0e0e4736")
            && l.contains("00f067aa0ba902b7")),
        "{log}"
    );
    let orders = hooks
        .seen
        .lock()
        .unwrap()
        .requests
        .iter()
        .filter(|r| r.0 == "orders")
        .count();
    assert_eq!(orders, 5);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn webhooks_are_signed_the_standard_webhooks_way_and_a_503_is_retried() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let hooks = Hooks::serve().await;
    hooks.seen.lock().unwrap().script = vec![503];
    let ids: HashSet<Uuid> = common::fill(&c, "orders", 200, None)
        .await
        .into_iter()
        .collect();
    let mut w = relayer(
        &db,
        "signed",
        &hooks.url(),
        &format!("signing_secret = \"{SECRET}\""),
        &[],
    );
    drained(&c).await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));

    assert_eq!(hooks.delivered("orders"), ids);
    use base64::Engine;
    use hmac::Mac;
    let secret = base64::engine::general_purpose::STANDARD
        .decode(SECRET.trim_start_matches("whsec_"))
        .unwrap();
    {
        let seen = hooks.seen.lock().unwrap();
        assert_eq!(seen.requests.len(), 201, "200 + one 503 retried");
        for (_, h, body) in &seen.requests {
            let header = |n: &str| h[n].to_str().unwrap().to_owned();
            let (id, ts) = (header("webhook-id"), header("webhook-timestamp"));
            assert_eq!(id, header("idempotency-key"));
            let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&secret).unwrap();
            mac.update(format!("{id}.{ts}.").as_bytes());
            mac.update(body);
            let expected =
                base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
            assert_eq!(header("webhook-signature"), format!("v1,{expected}"));
        }
    }
    let history = histories(&c).await;
    assert_eq!(
        history
            .values()
            .filter(|h| *h == "1:RETRYABLE 2:DISPATCHED")
            .count(),
        1,
        "503 then 200"
    );
    assert_eq!(
        history.values().filter(|h| *h == "1:DISPATCHED").count(),
        199
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_topic_with_slashes_and_query_characters_stays_one_path_segment() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let hooks = Hooks::serve().await;
    let hostile = "a/../b?x#y";
    let id = crate::enqueue(&c, hostile, None, serde_json::json!({})).await;
    let dots = crate::enqueue(&c, "..", None, serde_json::json!({})).await;
    let mut w = relayer(&db, "encoded", &hooks.url(), "", &[]);
    drained(&c).await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));
    // The server routed the request to /hooks/{topic} with the whole topic as the segment.
    assert_eq!(hooks.delivered(hostile), HashSet::from([id]));
    assert_eq!(hooks.seen.lock().unwrap().requests.len(), 1);
    let dead = common::dead_letters(&c).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].0, dots);
    assert!(
        dead[0].1.contains("cannot be a URL path segment"),
        "{dead:?}"
    );
    db.finish().await;
}

impl InProcess for Hooks {}

/// `created_at` of `id` as CloudEvents' `time` writes it (RFC 3339, microseconds, UTC).
pub async fn enqueue_time(c: &Client, id: Uuid) -> String {
    let at: chrono::DateTime<chrono::Utc> = c
        .query_one(
            "SELECT created_at FROM outbox.messages WHERE outbox_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// The CloudEvents envelope over HTTP: binary mode puts each attribute in its `ce-` header
/// (the content type in `Content-Type`, the body untouched); structured mode sends the JSON
/// event format with every attribute and the payload as `data`. A message's creation trace
/// context is the distributed-tracing extension (`ce-traceparent`, or `traceparent` in the
/// event) and the W3C headers of the request in both modes.
#[tokio::test(flavor = "multi_thread")]
async fn the_cloudevents_envelope_maps_every_attribute_in_both_modes() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let hooks = Hooks::serve().await;
    const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    const TRACESTATE: &str = "congo=t61rcWkgMzE";
    let traced = serde_json::json!({"traceparent": TRACEPARENT, "tracestate": TRACESTATE});
    let binary = crate::enqueue(&c, "binary", Some("order-7"), traced.clone()).await;
    let structured = crate::enqueue(&c, "structured", Some("order-8"), traced).await;
    let unkeyed = crate::enqueue(&c, "binary", None, serde_json::json!({})).await;
    let (binary_time, structured_time) = (
        enqueue_time(&c, binary).await,
        enqueue_time(&c, structured).await,
    );
    let url = hooks.url();
    let path = db.scratch_dir().join("cloudevents.toml");
    std::fs::write(
        &path,
        format!(
            "[destinations.binary]\ntype = \"http\"\nurl = \"{url}\"\nenvelope = \"cloudevents\"\n\
             cloudevents_source = \"/shop/{{topic}}\"\n\n\
             [destinations.structured]\ntype = \"http\"\nurl = \"{url}\"\n\
             envelope = \"cloudevents\"\ncloudevents_mode = \"structured\"\n\
             cloudevents_type = \"com.example.{{topic}}\"\n\n\
             [[routes]]\ntopic = \"binary\"\ndestination = \"binary\"\n\n\
             [[routes]]\ntopic = \"structured\"\ndestination = \"structured\"\n"
        ),
    )
    .unwrap();
    let path = path.display().to_string();
    let mut w = common::Relayer::start(&db, "cloudevents", &["--config", &path, "--no-telemetry"]);
    drained(&c).await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));

    let requests = hooks.seen.lock().unwrap().requests.clone();
    let request = |id: Uuid| {
        requests
            .iter()
            .find(|(_, h, _)| h["idempotency-key"].to_str().unwrap() == id.to_string())
            .unwrap_or_else(|| panic!("{id} arrived"))
    };
    let (_, headers, body) = request(binary);
    let header = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(header("ce-specversion").as_deref(), Some("1.0"));
    assert_eq!(header("ce-id"), Some(binary.to_string()));
    assert_eq!(header("ce-source").as_deref(), Some("/shop/binary"));
    assert_eq!(header("ce-type").as_deref(), Some("binary"));
    assert_eq!(header("ce-time"), Some(binary_time));
    assert_eq!(header("ce-partitionkey").as_deref(), Some("order-7"));
    assert_eq!(header("ce-traceparent").as_deref(), Some(TRACEPARENT));
    assert_eq!(header("ce-tracestate").as_deref(), Some(TRACESTATE));
    assert_eq!(header("traceparent").as_deref(), Some(TRACEPARENT));
    assert_eq!(header("tracestate").as_deref(), Some(TRACESTATE));
    assert_eq!(header("content-type").as_deref(), Some("application/json"));
    assert_eq!(
        header("ce-datacontenttype"),
        None,
        "Content-Type carries it"
    );
    let payload: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(
        payload,
        serde_json::json!({"hello": "world"}),
        "the body as enqueued"
    );
    let (_, headers, _) = request(unkeyed);
    assert!(
        headers.get("ce-partitionkey").is_none(),
        "no key, no partitionkey"
    );
    assert!(
        headers.get("ce-traceparent").is_none() && headers.get("traceparent").is_none(),
        "no trace context, no traceparent"
    );
    assert_eq!(headers["ce-id"].to_str().unwrap(), unkeyed.to_string());

    let (_, headers, body) = request(structured);
    assert_eq!(
        headers["content-type"].to_str().unwrap(),
        "application/cloudevents+json; charset=UTF-8"
    );
    assert!(
        headers.keys().all(|n| !n.as_str().starts_with("ce-")),
        "structured mode has no ce- headers: {headers:?}"
    );
    let event: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(
        event,
        serde_json::json!({
            "specversion": "1.0",
            "id": structured.to_string(),
            "source": "/outbox-relay",
            "type": "com.example.structured",
            "time": structured_time,
            "datacontenttype": "application/json",
            "partitionkey": "order-8",
            "traceparent": TRACEPARENT,
            "tracestate": TRACESTATE,
            "data": {"hello": "world"},
        })
    );
    assert_eq!(headers["traceparent"].to_str().unwrap(), TRACEPARENT);
    assert_eq!(headers["tracestate"].to_str().unwrap(), TRACESTATE);
    db.finish().await;
}

/// When the last of `ids` was recorded (its attempt written, and the message deleted from
/// the pending table in the same transaction).
async fn last_recorded(c: &tokio_postgres::Client, ids: &[Uuid]) -> chrono::DateTime<chrono::Utc> {
    c.query_one(
        "SELECT max(created_at) FROM outbox.attempts WHERE outbox_id = ANY($1)",
        &[&ids],
    )
    .await
    .unwrap()
    .get(0)
}

/// A destination whose budget is one part at a time (`max_in_flight = 1`): a batch whose
/// first wave was recorded and whose runs still go in waves (500 ms a request) gives its
/// place in the budget for one among the parts with only runs left, so that the next batch,
/// enqueued after the first was recorded in part, is delivered while the runs go on, not
/// when they end.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_with_only_runs_left_does_not_hold_the_destinations_budget() {
    const RUN: usize = 8;
    let db = TestDb::new().await;
    let mut c = db.client().await;
    let hooks = Hooks::serve().await;
    hooks.seen.lock().unwrap().slow_topic =
        Some(("slow".into(), std::time::Duration::from_millis(500)));
    let ids =
        |rows: Vec<tokio_postgres::Row>| -> Vec<Uuid> { rows.iter().map(|r| r.get(0)).collect() };
    // One transaction, so that the relayer's first claim takes all of it in one batch.
    let runs = {
        let t = c.transaction().await.unwrap();
        let runs = ids(t
            .query(
                "SELECT outbox.enqueue('slow', convert_to(format('{\"n\": %s}', n), 'UTF8'), \
                                       p_message_key => 'k' || (n % 2)) \
                   FROM generate_series(1, $1::int) AS n ORDER BY n",
                &[&i32::try_from(2 * RUN).unwrap()],
            )
            .await
            .unwrap());
        t.execute(
            "SELECT outbox.enqueue('orders', convert_to(format('{\"n\": %s}', n), 'UTF8')) \
               FROM generate_series(1, 20) AS n",
            &[],
        )
        .await
        .unwrap();
        t.commit().await.unwrap();
        runs
    };
    let mut w = relayer(
        &db,
        "budget",
        &hooks.url(),
        "max_in_flight = 1",
        &["--lease-secs", "6"],
    );
    // The first batch's free messages recorded: its runs go on.
    common::eventually(
        MINUTE,
        "the first batch's unkeyed messages to be recorded",
        || async { common::pending(&c).await <= i64::try_from(2 * RUN).unwrap() },
    )
    .await;
    let next = ids(c
        .query(
            "SELECT outbox.enqueue('orders', convert_to(format('{\"later\": %s}', n), 'UTF8')) \
               FROM generate_series(1, 20) AS n",
            &[],
        )
        .await
        .unwrap());
    common::eventually(MINUTE, "every message to be delivered", || async {
        common::pending(&c).await == 0
    })
    .await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());

    let next_max = last_recorded(&c, &next).await;
    let runs_done = last_recorded(&c, &runs).await;
    assert!(
        runs_done - next_max >= chrono::Duration::milliseconds(1_000),
        "the next batch, recorded at {next_max}, waited for the runs of the batch before it, \
         which ended at {runs_done}"
    );
    db.finish().await;
}

/// A batch of unkeyed messages and long runs of two keys whose every request takes 300 ms:
/// the runs go in waves (one message of a key per request), and the unkeyed messages (and
/// the key whose only message was in the first wave) are recorded as soon as the first wave
/// answered, while the runs go on, not when the longest run ends. The runs outlast the
/// publish window of a 3 s lease: the lease keeper extends what is still being delivered,
/// and the messages already recorded are no lost lease to it. Each message is sent once and
/// recorded once.
#[tokio::test(flavor = "multi_thread")]
async fn unkeyed_messages_are_recorded_without_waiting_for_the_runs_of_their_batch() {
    const RUN: usize = 8;
    let db = TestDb::new().await;
    let mut c = db.client().await;
    let hooks = Hooks::serve().await;
    hooks.seen.lock().unwrap().slow_topic =
        Some(("slow".into(), std::time::Duration::from_millis(300)));
    // One transaction, so that the relayer's first claim takes all of it in one batch.
    let (runs, first_wave) = {
        let t = c.transaction().await.unwrap();
        let ids = |rows: Vec<tokio_postgres::Row>| -> Vec<Uuid> {
            rows.iter().map(|r| r.get(0)).collect()
        };
        let runs = ids(t
            .query(
                "SELECT outbox.enqueue('slow', convert_to(format('{\"n\": %s}', n), 'UTF8'), \
                                       p_message_key => 'k' || (n % 2)) \
                   FROM generate_series(1, $1::int) AS n ORDER BY n",
                &[&i32::try_from(2 * RUN).unwrap()],
            )
            .await
            .unwrap());
        let mut first_wave = ids(t
            .query(
                "SELECT outbox.enqueue('orders', convert_to(format('{\"n\": %s}', n), 'UTF8')) \
                   FROM generate_series(1, 20) AS n ORDER BY n",
                &[],
            )
            .await
            .unwrap());
        first_wave.extend(ids(t
            .query(
                "SELECT outbox.enqueue('slow', convert_to('{}', 'UTF8'), \
                                       p_message_key => 'single')",
                &[],
            )
            .await
            .unwrap()));
        t.commit().await.unwrap();
        (runs, first_wave)
    };
    let mut w = relayer(&db, "runs", &hooks.url(), "", &["--lease-secs", "3"]);
    common::eventually(MINUTE, "every message to be delivered", || async {
        common::pending(&c).await == 0
    })
    .await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0), "{}", w.log_text());

    let history = histories(&c).await;
    assert_eq!(history.len(), runs.len() + first_wave.len(), "{history:?}");
    assert!(
        history.values().all(|h| h == "1:DISPATCHED"),
        "each message recorded once, by its first attempt: {history:?}"
    );
    let requests = hooks.seen.lock().unwrap().requests.len();
    assert_eq!(
        requests,
        runs.len() + first_wave.len(),
        "each message sent once"
    );
    let log = w.log_text();
    assert!(
        !log.contains("leases were lost"),
        "recorded messages are no lost lease to the lease keeper: {log}"
    );

    // When each was recorded (and deleted from the pending table, in the same transaction):
    // the first wave's at its answer, the runs' last messages seven waves (2.1 s) later.
    let first_max = last_recorded(&c, &first_wave).await;
    let runs_done = last_recorded(&c, &runs).await;
    assert!(
        runs_done - first_max >= chrono::Duration::milliseconds(1_500),
        "the unkeyed messages, recorded at {first_max}, waited for the runs, which ended at \
         {runs_done}"
    );
    db.finish().await;
}

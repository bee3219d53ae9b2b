//! The whole trace of a message (issue 54): a producer instrumented with the OpenTelemetry
//! Python SDK enqueues inside its span's transaction (its context in the headers), the
//! relayer runs with OTLP export on (http/protobuf, from the config file's `[tracing]`), an
//! HTTP consumer continues the context it receives with the same SDK, and the OTLP receiver
//! of tests/support (decoding with `opentelemetry-proto`) collects the spans of all three
//! services. Asserted: producer span → the relayer's `send` span (linked, and its child on
//! the first attempt when configured) → the consumer's span, with the messaging
//! attributes; a message the consumer refuses once shows one `send` span per attempt, each
//! with its outcome.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::common::{KillOnDrop, Relayer, TestDb, count, eventually, free_port};

fn support(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/support")
        .join(file)
}

/// The virtual environment `make test` installs (scripts/test-services.sh).
fn python() -> PathBuf {
    let python = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("venv/bin/python");
    let ok = Command::new(&python)
        .args(["-c", "import opentelemetry.sdk, opentelemetry.proto, opentelemetry.exporter.otlp.proto.http, psycopg"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{} with opentelemetry-sdk, opentelemetry-proto, opentelemetry-exporter-otlp-proto-http \
         and psycopg (`make test` installs them: scripts/test-services.sh)",
        python.display()
    );
    python
}

/// Starts a Python service of tests/support and waits for its `listening` line.
fn serve(python: &Path, args: &[&str], env: &[(&str, &str)]) -> KillOnDrop {
    let mut child = Command::new(python)
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start a Python service");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "listening", "{args:?} did not start");
    KillOnDrop(child)
}

fn spans(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn attr<'a>(span: &'a Value, name: &str) -> &'a Value {
    &span["attributes"][name]
}

/// Runs the three services and the relayer; returns the spans collected, the producer's
/// trace id and the outbox ids of the message delivered at once and of the one refused once.
async fn whole_trace(
    db: &TestDb,
    parent_first_attempt: bool,
) -> (Vec<Value>, String, String, String) {
    let python = python();
    let dir = db.scratch_dir();
    let collected = dir.join(format!("spans-{parent_first_attempt}.jsonl"));
    let _ = std::fs::remove_file(&collected);
    let receiver_port = free_port().to_string();
    let _receiver = serve(
        &python,
        &[
            support("otlp_receiver.py").to_str().unwrap(),
            &receiver_port,
            collected.to_str().unwrap(),
        ],
        &[],
    );
    let endpoint = format!("http://127.0.0.1:{receiver_port}");
    let consumer_port = free_port();
    let _consumer = serve(
        &python,
        &[
            support("traced_services.py").to_str().unwrap(),
            "consume",
            &consumer_port.to_string(),
        ],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)],
    );

    let produced = Command::new(&python)
        .args([
            support("traced_services.py").to_str().unwrap(),
            "produce",
            "orders.placed",
            r#"{"order": 1}"#,
            r#"{"order": 2, "note": "fail-once"}"#,
        ])
        .env("DATABASE_URL", &db.url)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .output()
        .unwrap();
    assert!(
        produced.status.success(),
        "producer: {}",
        String::from_utf8_lossy(&produced.stderr)
    );
    let out = String::from_utf8(produced.stdout).unwrap();
    let words: Vec<&str> = out.split_whitespace().collect();
    let [trace_id, delivered, refused_once] = words[..] else {
        panic!("producer printed {out:?}");
    };

    let config = dir.join(format!("traced-{parent_first_attempt}.toml"));
    std::fs::write(
        &config,
        format!(
            "[destinations.billing]\ntype = \"http\"\nurl = \"http://127.0.0.1:{consumer_port}/{{topic}}\"\n\
             [[routes]]\ntopic = \"*\"\ndestination = \"billing\"\n\
             [tracing]\nexport = \"otlp\"\nendpoint = \"{endpoint}\"\nprotocol = \"http/protobuf\"\n\
             service_name = \"relay\"\nparent_first_attempt = {parent_first_attempt}\n\
             resource_attributes = {{ \"deployment.environment.name\" = \"test\" }}\n"
        ),
    )
    .unwrap();
    let mut relayer = Relayer::start(
        db,
        "traced",
        &[
            "--config",
            config.to_str().unwrap(),
            "--no-telemetry",
            "--retry-base-ms",
            "50",
            "--retry-cap-ms",
            "100",
        ],
    );
    let c = db.client().await;
    eventually(
        Duration::from_secs(30),
        "both messages delivered",
        || async { count(&c, "SELECT count(*) FROM outbox.messages").await == 0 },
    )
    .await;
    // Shutdown sends the spans still batched.
    relayer.signal("TERM");
    assert_eq!(
        relayer.exit_code(Duration::from_secs(20)).await,
        Some(0),
        "{}",
        relayer.log_text()
    );
    eventually(
        Duration::from_secs(10),
        "the consumer's three spans",
        || async {
            spans(&collected)
                .iter()
                .filter(|s| s["service"] == "billing")
                .count()
                == 3
        },
    )
    .await;
    (
        spans(&collected),
        trace_id.to_owned(),
        delivered.to_owned(),
        refused_once.to_owned(),
    )
}

/// The producer's span and, for `outbox_id`, the relayer's send spans by attempt and the
/// consumer's span under each.
fn trail<'a>(all: &'a [Value], outbox_id: &str) -> (&'a Value, Vec<(&'a Value, &'a Value)>) {
    let producer = all
        .iter()
        .find(|s| s["service"] == "shop")
        .expect("the producer's span");
    let mut sends: Vec<&Value> = all
        .iter()
        .filter(|s| s["service"] == "relay" && attr(s, "messaging.message.id") == outbox_id)
        .collect();
    sends.sort_by_key(|s| attr(s, "outbox.attempt").as_i64());
    let pairs = sends
        .into_iter()
        .map(|send| {
            let consumer = all
                .iter()
                .find(|s| s["service"] == "billing" && s["parent_span_id"] == send["span_id"])
                .unwrap_or_else(|| panic!("no consumer span under {send}"));
            (send, consumer)
        })
        .collect();
    (producer, pairs)
}

fn assert_send_span(send: &Value, producer: &Value, attempt: i64) {
    assert_eq!(send["name"], "send billing");
    assert_eq!(send["kind"], "SPAN_KIND_PRODUCER");
    assert_eq!(send["resource"]["deployment.environment.name"], "test");
    assert_eq!(attr(send, "messaging.system"), "http");
    assert_eq!(attr(send, "messaging.operation.type"), "send");
    assert_eq!(attr(send, "messaging.operation.name"), "POST");
    assert_eq!(attr(send, "messaging.destination.name"), "orders.placed");
    assert_eq!(attr(send, "outbox.attempt"), attempt);
    // The creation context is a link on every attempt.
    assert_eq!(
        send["links"],
        serde_json::json!([{"trace_id": producer["trace_id"], "span_id": producer["span_id"]}]),
        "{send}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_traced_message_is_one_trace_from_producer_to_consumer_with_a_send_span_per_attempt() {
    let db = TestDb::new().await;
    let (all, trace_id, delivered, refused_once) = whole_trace(&db, true).await;

    let (producer, attempts) = trail(&all, &delivered);
    assert_eq!(producer["name"], "create orders.placed");
    assert_eq!(producer["trace_id"], trace_id);
    let [(send, consumer)] = attempts[..] else {
        panic!("one attempt of {delivered}: {attempts:?}");
    };
    assert_send_span(send, producer, 1);
    // The first attempt is the producer's child: one connected trace.
    assert_eq!(send["trace_id"], trace_id);
    assert_eq!(send["parent_span_id"], producer["span_id"]);
    assert_eq!(attr(send, "outbox.outcome"), "delivered");
    assert_eq!(send["status"]["code"], "STATUS_CODE_UNSET");
    assert_eq!(consumer["trace_id"], trace_id);
    assert_eq!(consumer["kind"], "SPAN_KIND_CONSUMER");
    assert_eq!(attr(consumer, "messaging.message.id"), delivered.as_str());

    let (_, attempts) = trail(&all, &refused_once);
    let [(first, first_consumer), (second, second_consumer)] = attempts[..] else {
        panic!("two attempts of {refused_once}: {attempts:?}");
    };
    assert_send_span(first, producer, 1);
    assert_eq!(first["parent_span_id"], producer["span_id"]);
    assert_eq!(attr(first, "outbox.outcome"), "retryable");
    assert_eq!(attr(first, "error.type"), "retryable");
    assert_eq!(first["status"]["code"], "STATUS_CODE_ERROR");
    assert!(
        first["status"]["message"].as_str().unwrap().contains("503"),
        "{first}"
    );
    assert_eq!(attr(first_consumer, "http.response.status_code"), 503);
    // A retry is a trace of its own, linked to the creation context: the consumer continues
    // the send span's context (the current hop), not the producer's.
    assert_send_span(second, producer, 2);
    assert_ne!(second["trace_id"], trace_id);
    assert_eq!(second["parent_span_id"], "");
    assert_eq!(attr(second, "outbox.outcome"), "delivered");
    assert_eq!(second_consumer["trace_id"], second["trace_id"]);
    assert_eq!(attr(second_consumer, "http.response.status_code"), 204);

    // The claims that returned messages and the completions are spans of their own.
    for function in ["claim_outbox_batch_seq", "complete_outbox_batch"] {
        let calls: Vec<&Value> = all
            .iter()
            .filter(|s| s["service"] == "relay" && s["name"] == function)
            .collect();
        assert!(
            calls.len() >= 2,
            "a {function} span per call, two at least: {calls:?}"
        );
        for call in calls {
            assert_eq!(call["kind"], "SPAN_KIND_CLIENT");
            assert_eq!(attr(call, "db.system.name"), "postgresql");
            assert_eq!(attr(call, "db.operation.name"), function);
            assert_eq!(attr(call, "outbox.worker_id"), "traced");
            assert!(
                attr(call, "messaging.batch.message_count")
                    .as_i64()
                    .unwrap()
                    >= 1
            );
        }
    }
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn without_parent_first_attempt_every_send_span_is_a_root_linked_to_the_producer() {
    let db = TestDb::new().await;
    let (all, trace_id, delivered, _) = whole_trace(&db, false).await;
    let (producer, attempts) = trail(&all, &delivered);
    let [(send, consumer)] = attempts[..] else {
        panic!("one attempt of {delivered}: {attempts:?}");
    };
    assert_send_span(send, producer, 1);
    assert_ne!(send["trace_id"], trace_id);
    assert_eq!(send["parent_span_id"], "");
    assert_eq!(consumer["trace_id"], send["trace_id"]);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn spans_are_exported_over_grpc_too() {
    let python = python();
    let grpc = Command::new(&python)
        .args(["-c", "import grpc"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        grpc,
        "grpcio in {} (`make test` installs it)",
        python.display()
    );
    let db = TestDb::new().await;
    let dir = db.scratch_dir();
    let collected = dir.join("spans-grpc.jsonl");
    let port = free_port().to_string();
    let _receiver = serve(
        &python,
        &[
            support("otlp_receiver.py").to_str().unwrap(),
            &port,
            collected.to_str().unwrap(),
            "grpc",
        ],
        &[],
    );
    let c = db.client().await;
    let producer = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let id: uuid::Uuid = c
        .query_one(
            "SELECT outbox.enqueue('orders.placed', '{}'::jsonb, p_headers => jsonb_build_object('traceparent', $1::text))",
            &[&producer],
        )
        .await
        .unwrap()
        .get(0);
    let config = dir.join("grpc.toml");
    std::fs::write(
        &config,
        format!("[tracing]\nexport = \"otlp\"\nprotocol = \"grpc\"\nendpoint = \"http://127.0.0.1:{port}\"\n"),
    )
    .unwrap();
    let mut relayer = Relayer::start(
        &db,
        "grpc",
        &[
            "--config",
            config.to_str().unwrap(),
            "--sink",
            "null",
            "--no-telemetry",
        ],
    );
    eventually(Duration::from_secs(30), "the message delivered", || async {
        count(&c, "SELECT count(*) FROM outbox.messages").await == 0
    })
    .await;
    relayer.signal("TERM");
    assert_eq!(
        relayer.exit_code(Duration::from_secs(20)).await,
        Some(0),
        "{}",
        relayer.log_text()
    );
    let all = spans(&collected);
    let send = all
        .iter()
        .find(|s| s["name"] == "send null")
        .unwrap_or_else(|| panic!("no send span over gRPC: {all:?}\n{}", relayer.log_text()));
    assert_eq!(send["service"], "outbox-relay");
    assert_eq!(attr(send, "messaging.message.id"), id.to_string().as_str());
    assert_eq!(attr(send, "messaging.system"), "null");
    assert_eq!(
        send["links"],
        serde_json::json!([{"trace_id": "0af7651916cd43dd8448eb211c80319c", "span_id": "b7ad6b7169203331"}])
    );
    db.finish().await;
}

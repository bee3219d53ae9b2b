//! The creation trace context at enqueue (03_enqueue.sql, docs/tracing.md): taken from the
//! arguments, else from the transaction's settings, else from the headers as given; stored
//! as the headers `traceparent` and `tracestate`; a malformed one refused with P7001 naming
//! where it came from and quoting it, and the calls of the previous signatures unchanged.

use super::*;
use common::pending;
use tokio_postgres::Client;

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const TRACESTATE: &str = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";
const OTHER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";

/// The headers of the pending message `id`.
async fn headers(c: &Client, id: Uuid) -> serde_json::Value {
    c.query_one(
        "SELECT headers FROM outbox.messages WHERE outbox_id = $1",
        &[&id],
    )
    .await
    .unwrap()
    .get(0)
}

async fn one_id(c: &Client, sql: &str) -> Uuid {
    c.query_one(sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

#[tokio::test]
async fn the_arguments_are_stored_as_the_headers_traceparent_and_tracestate() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let positional = one_id(
        &c,
        &format!(
            "SELECT outbox.enqueue('t', '\\x01'::bytea, NULL, '{{\"x-tenant\": \"acme\"}}', NULL, NULL, \
             NULL, 'application/x', '{TRACEPARENT}', '{TRACESTATE}')"
        ),
    )
    .await;
    assert_eq!(
        headers(&c, positional).await,
        serde_json::json!({"x-tenant": "acme", "traceparent": TRACEPARENT, "tracestate": TRACESTATE})
    );
    let named_json = one_id(
        &c,
        &format!("SELECT outbox.enqueue('t', '{{}}'::jsonb, p_traceparent => '{TRACEPARENT}')"),
    )
    .await;
    assert_eq!(
        headers(&c, named_json).await,
        serde_json::json!({"traceparent": TRACEPARENT})
    );
    // The argument replaces both headers of p_headers: a tracestate belongs to the trace
    // of the traceparent beside it.
    let replaced = one_id(
        &c,
        &format!(
            "SELECT outbox.enqueue('t', '{{}}'::jsonb, p_headers => \
             '{{\"traceparent\": \"{TRACEPARENT}\", \"tracestate\": \"{TRACESTATE}\", \"x\": \"1\"}}', \
             p_traceparent => '{OTHER}')"
        ),
    )
    .await;
    assert_eq!(
        headers(&c, replaced).await,
        serde_json::json!({"traceparent": OTHER, "x": "1"})
    );
    // With neither an argument nor a setting, the headers are kept as given, checked or not.
    let as_given = one_id(
        &c,
        "SELECT outbox.enqueue('t', '{}'::jsonb, p_headers => '{\"traceparent\": \"00-x\"}')",
    )
    .await;
    assert_eq!(
        headers(&c, as_given).await,
        serde_json::json!({"traceparent": "00-x"})
    );
    db.finish().await;
}

/// `SET LOCAL outbox.traceparent` in the producer's transaction gives its enqueue calls,
/// unchanged, the context; the setting ends with the transaction; an argument wins over
/// it and it over the headers. Run as a producer's login, which has no right on the
/// helper that checks the context.
#[tokio::test]
async fn set_local_gives_an_unchanged_enqueue_call_the_transactions_context() {
    let db = TestDb::new().await;
    let mut producer = common::connect(&db.login("producer", Some("outbox_producer")).await)
        .await
        .unwrap();
    let tx = producer.transaction().await.unwrap();
    tx.batch_execute(&format!(
        "SET LOCAL outbox.traceparent = '{TRACEPARENT}'; \
         SELECT set_config('outbox.tracestate', '{TRACESTATE}', true)"
    ))
    .await
    .unwrap();
    let plain: Uuid = tx
        .query_one("SELECT outbox.enqueue('t', '{\"n\": 1}'::jsonb)", &[])
        .await
        .unwrap()
        .get(0);
    let over_headers: Uuid = tx
        .query_one(
            &format!(
                "SELECT outbox.enqueue('t', '{{}}'::jsonb, NULL, \
                 '{{\"traceparent\": \"{OTHER}\", \"tracestate\": \"a=b\"}}')"
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let argument: Uuid = tx
        .query_one(
            "SELECT outbox.enqueue('t', '\\x00'::bytea, p_traceparent => $1)",
            &[&OTHER],
        )
        .await
        .unwrap()
        .get(0);
    tx.commit().await.unwrap();
    let after: Uuid = producer
        .query_one("SELECT outbox.enqueue('t', '{}'::jsonb)", &[])
        .await
        .unwrap()
        .get(0);

    let c = db.client().await;
    let from_setting = serde_json::json!({"traceparent": TRACEPARENT, "tracestate": TRACESTATE});
    assert_eq!(headers(&c, plain).await, from_setting);
    assert_eq!(headers(&c, over_headers).await, from_setting);
    assert_eq!(
        headers(&c, argument).await,
        serde_json::json!({"traceparent": OTHER}),
        "the argument, without the setting's tracestate"
    );
    assert_eq!(
        headers(&c, after).await,
        serde_json::json!({}),
        "the setting ended with the transaction"
    );
    drop(producer);
    db.finish().await;
}

#[tokio::test]
async fn a_malformed_trace_context_is_refused_with_p7001_naming_it_and_its_value() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let too_many = (0..33)
        .map(|i| format!("k{i}=v"))
        .collect::<Vec<_>>()
        .join(",");
    let too_long = format!("k={}", "v".repeat(255)) + &format!(",j={}", "v".repeat(255));
    let long_key = format!("{}=v", "k".repeat(257));
    let long_value = format!("k={}", "v".repeat(257));
    let long_tenant = format!("{}@dt=v", "t".repeat(242));
    let long_system = format!("t@{}=v", "s".repeat(15));
    let cases: Vec<(&str, String, &str)> = vec![
        ("p_tracestate", long_key, "is not key=value"),
        ("p_tracestate", long_value, "is not key=value"),
        ("p_tracestate", long_tenant, "is not key=value"),
        ("p_tracestate", long_system, "is not key=value"),
        ("p_traceparent", "".into(), "is not a W3C traceparent"),
        (
            "p_traceparent",
            TRACEPARENT.to_uppercase(),
            "is not a W3C traceparent",
        ),
        (
            "p_traceparent",
            TRACEPARENT.replacen("00-", "01-", 1),
            "is not a W3C traceparent",
        ),
        (
            "p_traceparent",
            format!("{TRACEPARENT}-"),
            "is not a W3C traceparent",
        ),
        (
            "p_traceparent",
            format!(" {TRACEPARENT}"),
            "is not a W3C traceparent",
        ),
        // 55 characters, but a trace id of 33 digits and a parent id of 15.
        (
            "p_traceparent",
            "00-0af7651916cd43dd8448eb211c80319c0-b7ad6b716920333-01".into(),
            "is not a W3C traceparent",
        ),
        (
            "p_traceparent",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01".into(),
            "not all 0",
        ),
        (
            "p_traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01".into(),
            "not all 0",
        ),
        ("p_tracestate", too_many.clone(), "33 members, at most 32"),
        (
            "p_tracestate",
            too_long.clone(),
            "515 characters, at most 512",
        ),
        (
            "p_tracestate",
            "Congo=t61".into(),
            "member 'Congo=t61' is not key=value",
        ),
        (
            "p_tracestate",
            "congo".into(),
            "member 'congo' is not key=value",
        ),
        (
            "p_tracestate",
            "congo=".into(),
            "member 'congo=' is not key=value",
        ),
        ("p_tracestate", "congo=a=b".into(), "is not key=value"),
        ("p_tracestate", "congo=é".into(), "is not key=value"),
    ];
    for (argument, value, problem) in &cases {
        let (traceparent, tracestate) = if *argument == "p_traceparent" {
            (value.as_str(), None)
        } else {
            (TRACEPARENT, Some(value.as_str()))
        };
        for form in ["'{}'::jsonb", "'\\x00'::bytea"] {
            let (code, message) = sqlstate(
                c.query_one(
                    &format!(
                        "SELECT outbox.enqueue('t', {form}, p_traceparent => $1, p_tracestate => $2)"
                    ),
                    &[&traceparent, &tracestate],
                )
                .await,
            );
            assert_eq!(code, "P7001", "{argument} {value:?}: {message}");
            let quoted = format!("'{value}'");
            assert!(
                message.starts_with(&format!("invalid argument {argument}: "))
                    && message.contains(&quoted)
                    && message.contains(problem),
                "{argument} {value:?}: {message}"
            );
        }
    }
    let (code, message) = sqlstate(
        c.query_one(
            "SELECT outbox.enqueue('t', '{}'::jsonb, p_tracestate => 'a=b')",
            &[],
        )
        .await,
    );
    assert_eq!(code, "P7001");
    assert!(
        message.starts_with("invalid argument p_tracestate: 'a=b' comes without a traceparent"),
        "{message}"
    );

    // The settings are named as themselves; a tracestate set alone is refused too.
    for (setting, value, named) in [
        ("outbox.traceparent", "00-abc-def-01", "outbox.traceparent"),
        ("outbox.tracestate", "a=b", "outbox.tracestate"),
    ] {
        let mut c = db.client().await;
        let tx = c.transaction().await.unwrap();
        tx.query_one("SELECT set_config($1, $2, true)", &[&setting, &value])
            .await
            .unwrap();
        let (code, message) = sqlstate(
            tx.query_one("SELECT outbox.enqueue('t', '{}'::jsonb)", &[])
                .await,
        );
        assert_eq!(code, "P7001", "{message}");
        assert!(
            message.starts_with(&format!("invalid argument {named}: '{value}'")),
            "{message}"
        );
    }
    let mut c2 = db.client().await;
    let tx = c2.transaction().await.unwrap();
    tx.batch_execute(&format!(
        "SET LOCAL outbox.traceparent = '{TRACEPARENT}'; SET LOCAL outbox.tracestate = 'a=b,,Bad'"
    ))
    .await
    .unwrap();
    let (code, message) = sqlstate(
        tx.query_one("SELECT outbox.enqueue('t', '{}'::jsonb)", &[])
            .await,
    );
    assert_eq!(code, "P7001");
    assert!(
        message.starts_with("invalid argument outbox.tracestate: 'a=b,,Bad'")
            && message.contains("member 'Bad'"),
        "{message}"
    );
    drop(tx);
    assert_eq!(pending(&c).await, 0, "a refused enqueue inserts nothing");
    db.finish().await;
}

/// What W3C Trace Context allows is accepted: 32 members, empty members, spaces and tabs
/// around the commas, multi-tenant keys, values with spaces inside, 512 characters, keys
/// and values of 256, any flags.
#[tokio::test]
async fn every_well_formed_trace_context_is_accepted_as_given() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let thirty_two = (0..32)
        .map(|i| format!("k{i}=v"))
        .collect::<Vec<_>>()
        .join(",");
    let at_limit = format!("k={}", "v".repeat(254)) + &format!(",j={}", "v".repeat(253));
    assert_eq!(at_limit.len(), 512);
    let states = [
        thirty_two,
        at_limit,
        format!("{}=v", "k".repeat(256)),
        format!("k={}", "v".repeat(256)),
        format!("{}@{}=v", "t".repeat(241), "s".repeat(14)),
        "congo=t61rcWkgMzE, ,\trojo=00f067aa0ba902b7 ,".to_owned(),
        "fw529a3039@dt=1 a b,a1-b_c*d/e=~!\"#$%&'()*+-./:;<>?@[\\]^_`{|}".to_owned(),
    ];
    for (i, state) in states.iter().enumerate() {
        let traceparent = format!(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333{i}-{}",
            ["00", "01", "ff", "a9", "03", "02", "10"][i]
        );
        let id: Uuid = c
            .query_one(
                "SELECT outbox.enqueue('t', '{}'::jsonb, p_traceparent => $1, p_tracestate => $2)",
                &[&traceparent, state],
            )
            .await
            .unwrap_or_else(|e| panic!("{state:?}: {e}"))
            .get(0);
        assert_eq!(
            headers(&c, id).await,
            serde_json::json!({"traceparent": traceparent, "tracestate": state})
        );
    }
    db.finish().await;
}

/// The calls of the signatures before the trace context, by position and by name, reach
/// the new forms unchanged.
#[tokio::test]
async fn the_calls_of_the_previous_signatures_still_resolve() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = Uuid::new_v4();
    let calls = [
        "SELECT outbox.enqueue('t', '\\x00'::bytea)".to_owned(),
        "SELECT outbox.enqueue('t', '\\x00'::bytea, 'k', '{}', NULL, NULL, 3, 'text/plain')"
            .to_owned(),
        "SELECT outbox.enqueue('t', '{}'::jsonb, 'k', '{}', now(), NULL, 3)".to_owned(),
        format!(
            "SELECT outbox.enqueue(p_topic => 't', p_payload => '{{}}'::jsonb, p_outbox_id => '{id}', \
             p_max_attempts => 2)"
        ),
        "SELECT outbox.enqueue(p_topic => 't', p_payload => '\\x00'::bytea, \
         p_content_type => 'text/plain')"
            .to_owned(),
    ];
    for call in &calls {
        let id = one_id(&c, call).await;
        assert_eq!(headers(&c, id).await, serde_json::json!({}), "{call}");
    }
    assert_eq!(pending(&c).await, 5);
    db.finish().await;
}

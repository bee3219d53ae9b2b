//! Outboxes in schemas other than `outbox` (`outbox_schema`): several schemas of one
//! database are independent outboxes, each migrated, served and versioned on its own, with
//! its own wake-up channel; a schema that belongs to something else is never migrated into;
//! a missing one is named.

use crate::common;

use std::time::Duration;

use common::{TestDb, connect, eventually, text, verb};
use outbox_relay::connection::with_schema;
use outbox_relay::message::{NewMessage, WorkerId};
use outbox_relay::store::{ClaimSizes, Store, TopicFilter};

fn sizes() -> ClaimSizes {
    ClaimSizes {
        max_batch_bytes: None,
        max_message_bytes: None,
    }
}

#[tokio::test]
async fn two_schemas_beside_the_default_one_are_three_independent_outboxes() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let tenant = |schema: &str| with_schema(&db.url, schema);

    // Migrated by the verb, as an operator does, with the global option.
    for schema in ["tenant_a", "tenant_b"] {
        let out = verb(&["--outbox-schema", schema, "migrate"], &db.url);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(
            text(&out.stdout).contains("applied V1__tables"),
            "{}",
            text(&out.stdout)
        );
    }
    let again = verb(&["--outbox-schema", "tenant_a", "migrate"], &db.url);
    assert!(
        text(&again.stdout).contains("schema is up to date"),
        "{}",
        text(&again.stdout)
    );
    // Each schema keeps its own history; the default outbox's is untouched.
    let versions = |table: &'static str| {
        let c = &c;
        async move {
            c.query_one(&format!("SELECT count(*), max(version) FROM {table}"), &[])
                .await
                .unwrap()
                .get::<_, i32>(1)
        }
    };
    let needed = outbox_relay::schema::version();
    assert_eq!(versions("tenant_a.refinery_schema_history").await, needed);
    assert_eq!(versions("tenant_b.refinery_schema_history").await, needed);
    assert_eq!(versions("public.refinery_schema_history").await, needed);
    let a = Store::connect(&tenant("tenant_a"), 2).unwrap();
    let b = Store::connect(&tenant("tenant_b"), 2).unwrap();
    let default = Store::connect(&db.url, 2).unwrap();
    for store in [&a, &b, &default] {
        assert_eq!(store.check_schema().await.unwrap(), needed);
    }

    // A message enqueued in one schema is claimed there and nowhere else, and wakes the
    // listeners of that schema's channel only.
    let listener = connect(&db.url).await.unwrap();
    let (heard_tx, mut heard) = tokio::sync::mpsc::unbounded_channel();
    let (client, mut connection) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(async move {
        use futures_util::StreamExt;
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            if let tokio_postgres::AsyncMessage::Notification(n) = m {
                let _ = heard_tx.send(n.channel().to_owned());
            }
        }
    });
    client
        .batch_execute("LISTEN tenant_a_new; LISTEN tenant_b_new; LISTEN outbox_new")
        .await
        .unwrap();
    let id = a
        .enqueue(&NewMessage {
            topic: "orders".into(),
            key: Some("k1".into()),
            payload: serde_json::json!({"n": 1}).into(),
            ..NewMessage::default()
        })
        .await
        .unwrap();
    let channel = tokio::time::timeout(Duration::from_secs(5), heard.recv())
        .await
        .expect("a notification within 5 s")
        .unwrap();
    assert_eq!(channel, "tenant_a_new");
    let worker = WorkerId::new("w1");
    for store in [&b, &default] {
        let none = store
            .claim(10, &worker, 30, None, TopicFilter::default(), sizes())
            .await
            .unwrap();
        assert!(none.is_empty(), "{} claimed {none:?}", store.schema());
    }
    let claimed = a
        .claim(10, &worker, 30, None, TopicFilter::default(), sizes())
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].id, id);
    let pending = |schema: &'static str| {
        let c = &c;
        async move {
            c.query_one(&format!("SELECT count(*) FROM {schema}.messages"), &[])
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    assert_eq!(
        (
            pending("tenant_a").await,
            pending("tenant_b").await,
            pending("outbox").await
        ),
        (1, 0, 0)
    );
    // The lease is fenced in its own schema: another schema's functions know nothing of it.
    let done = a
        .complete(
            &worker,
            &[outbox_relay::message::Completion {
                id: claimed[0].id,
                lease_token: claimed[0].lease_token,
                state: outbox_relay::message::AttemptState::Dispatched,
                error: None,
                retry_at: None,
            }],
        )
        .await
        .unwrap();
    assert!(!done[0].lease_lost);
    let attempts: i64 = c
        .query_one(
            "SELECT count(*) FROM tenant_a.attempts WHERE state = 'DISPATCHED'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(attempts, 1);
    assert_eq!(pending("tenant_a").await, 0);

    // `status` reads the schema it is given.
    c.execute("SELECT tenant_b.enqueue('invoices', '{}'::jsonb)", &[])
        .await
        .unwrap();
    let out = verb(
        &["--outbox-schema", "tenant_b", "status", "--json"],
        &db.url,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("invoices"),
        "{}",
        text(&out.stdout)
    );
    drop(listener);
    db.finish().await;
}

#[tokio::test]
async fn a_schema_that_holds_something_else_is_never_migrated_into_and_a_missing_one_is_named() {
    let db = TestDb::empty().await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE SCHEMA app; CREATE TABLE app.orders (id int); GRANT SELECT ON app.orders TO PUBLIC",
    )
    .await
    .unwrap();
    let out = verb(&["--outbox-schema", "app", "migrate"], &db.url);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("schema app exists and holds no outbox"),
        "{stderr}"
    );
    // Nothing changed: no outbox object, the application's grant still there.
    let (objects, public_select): (i64, bool) = {
        let row = c
            .query_one(
                "SELECT (SELECT count(*) FROM pg_class WHERE relnamespace = 'app'::regnamespace), \
                        has_table_privilege('public', 'app.orders', 'SELECT')",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!((objects, public_select), (1, true));

    // A schema of its own is migrated, and no schema outbox appears beside it.
    let out = verb(&["--outbox-schema", "tenant_y", "migrate"], &db.url);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let schemas: Vec<String> = c
        .query(
            "SELECT nspname::text FROM pg_namespace WHERE nspname IN ('outbox', 'tenant_y')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(schemas, ["tenant_y"]);

    // A schema never migrated is named, with the command that fixes it.
    let store = Store::connect(&with_schema(&db.url, "tenant_z"), 2).unwrap();
    let e = store.check_schema().await.unwrap_err().to_string();
    assert!(
        e.contains("schema tenant_z does not exist") && e.contains("outbox-relay migrate"),
        "{e}"
    );

    // Names that are not a plain schema of the outbox's own are refused before connecting.
    for (bad, says) in [
        ("Tenant", "lower-case identifier"),
        ("x".repeat(49).as_str(), "at most 48"),
        ("a-b", "lower-case identifier"),
        ("public", "schema of its own"),
        ("pg_x", "schema of its own"),
    ] {
        let out = verb(&["--outbox-schema", bad, "migrate"], &db.url);
        let stderr = text(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains("outbox_schema") && stderr.contains(says),
            "{bad}: {stderr}"
        );
    }
    eventually(Duration::from_secs(5), "nothing created", || async {
        connect(&db.url)
            .await
            .unwrap()
            .query_one("SELECT to_regnamespace('tenant_z') IS NULL", &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;
    db.finish().await;
}

#[tokio::test]
async fn on_the_default_database_a_missing_schema_asks_for_the_outboxs_database_by_name() {
    // No URL given: the store is on the server's `postgres` database, where migrating is not
    // the fix; naming the outbox's database is.
    let db = TestDb::empty().await;
    let e = Store::connect(&db.url, 2)
        .unwrap()
        .on_default_database()
        .check_schema()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("does not exist")
            && e.contains("set DATABASE_URL or --database-url to the outbox's database")
            && !e.contains("run `outbox-relay migrate` (as the schema owner)"),
        "{e}"
    );
    // Given by name, the same database is told to be migrated.
    let e = Store::connect(&db.url, 2)
        .unwrap()
        .check_schema()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("run `outbox-relay migrate` (as the schema owner)"),
        "{e}"
    );
    db.finish().await;
}

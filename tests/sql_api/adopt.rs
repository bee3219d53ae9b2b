//! Adopted tables (`schema/10_adopt.sql`): an application's own outbox table, written by
//! its unchanged INSERT statements, relayed through `outbox.enqueue` in the inserting
//! transaction; the adoption removed without a trace; the rights it takes and needs.

use tokio_postgres::Client;

use crate::common::eventually;

use super::*;

use crate::common::quarkus::{
    DELETE as QUARKUS_DELETE, INSERT as QUARKUS_INSERT, TABLE as QUARKUS_TABLE, TRACE, TRACEPARENT,
};

/// One message of the outbox as text: topic, key, payload, content type, headers.
async fn message(
    c: &Client,
    id: Uuid,
) -> (String, Option<String>, String, String, serde_json::Value) {
    let r = c
        .query_one(
            "SELECT topic, message_key, convert_from(payload, 'UTF8'), content_type, headers \
             FROM outbox.messages WHERE outbox_id = $1",
            &[&id],
        )
        .await
        .expect("the row's message");
    (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4))
}

async fn insert_event(
    c: &impl tokio_postgres::GenericClient,
    id: Uuid,
    aggregate: &str,
    payload: serde_json::Value,
) {
    let at = chrono::NaiveDate::from_ymd_opt(2026, 11, 28)
        .unwrap()
        .and_hms_micro_opt(16, 0, 0, 123_456)
        .unwrap();
    c.execute(
        QUARKUS_INSERT,
        &[
            &"Order",
            &aggregate,
            &"OrderCreated",
            &at,
            &payload,
            &TRACE,
            &id,
        ],
    )
    .await
    .expect("the application's insert");
}

#[tokio::test]
async fn the_debezium_preset_relays_each_inserted_row_also_when_it_is_deleted_at_once() {
    let db = TestDb::new().await;
    let mut c = db.client().await;
    c.batch_execute(QUARKUS_TABLE).await.unwrap();
    let mapping: serde_json::Value = c
        .query_one("SELECT outbox.adopt_table('outboxevent')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(mapping["topic"], "aggregatetype");
    assert_eq!(mapping["payload_kind"], "json");

    // Insert, then delete in the same transaction (the extension's default).
    let id = Uuid::new_v4();
    let tx = c.transaction().await.unwrap();
    insert_event(
        &tx,
        id,
        "42",
        serde_json::json!({"orderId": 42, "lines": [1, 2]}),
    )
    .await;
    tx.execute(QUARKUS_DELETE, &[&id]).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count(&c, "SELECT count(*) FROM outboxevent").await, 0);
    let (topic, key, payload, content_type, headers) = message(&c, id).await;
    assert_eq!(topic, "Order");
    assert_eq!(key.as_deref(), Some("42"));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&payload).unwrap(),
        serde_json::json!({"orderId": 42, "lines": [1, 2]})
    );
    assert_eq!(content_type, "application/json");
    assert_eq!(
        headers,
        serde_json::json!({
            "type": "OrderCreated",
            "timestamp": "2026-11-28T16:00:00.123456",
            "tracingspancontext": TRACE,
            "traceparent": TRACEPARENT,
        })
    );

    // A rollback relays nothing.
    let rolled_back = Uuid::new_v4();
    let tx = c.transaction().await.unwrap();
    insert_event(&tx, rolled_back, "43", serde_json::json!({})).await;
    tx.rollback().await.unwrap();
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.messages").await,
        1,
        "the rolled back row is not in the outbox"
    );

    // An id the outbox knows is refused as enqueue refuses it, and fails the insert.
    let (code, text) = sqlstate(
        c.execute(
            QUARKUS_INSERT,
            &[
                &"Order",
                &"42",
                &"OrderCreated",
                &chrono::Utc::now().naive_utc(),
                &serde_json::json!({}),
                &None::<&str>,
                &id,
            ],
        )
        .await,
    );
    assert_eq!(code, "23505", "{text}");
    assert!(text.contains("was used before"), "{text}");
    assert_eq!(count(&c, "SELECT count(*) FROM outboxevent").await, 0);
    db.finish().await;
}

#[tokio::test]
async fn updates_and_deletes_of_old_rows_are_not_relayed_and_an_update_warns() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(QUARKUS_TABLE).await.unwrap();
    c.execute("SELECT outbox.adopt_table('outboxevent')", &[])
        .await
        .unwrap();
    let id = Uuid::new_v4();
    insert_event(&c, id, "7", serde_json::json!({"n": 1})).await;
    insert_event(&c, Uuid::new_v4(), "7", serde_json::json!({"n": 2})).await;
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.messages").await, 2);

    // The warning arrives as a notice on the connection that updated.
    let (client, mut connection) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let (tx, mut notices) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(m)) = futures_util::StreamExt::next(&mut messages).await {
            if let tokio_postgres::AsyncMessage::Notice(n) = m {
                let _ = tx.send((n.severity().to_owned(), n.message().to_owned()));
            }
        }
    });
    let updated = client
        .execute("UPDATE outboxevent SET type = 'OrderChanged'", &[])
        .await
        .unwrap();
    assert_eq!(updated, 2);
    client
        .execute("DELETE FROM outboxevent", &[])
        .await
        .unwrap();
    client.execute("SELECT 1", &[]).await.unwrap();
    drop(client);
    let mut warnings = Vec::new();
    while let Some(n) = notices.recv().await {
        warnings.push(n);
    }
    assert_eq!(
        warnings,
        vec![(
            "WARNING".to_owned(),
            "outbox: an UPDATE of the adopted table public.outboxevent is not relayed (only \
             inserted rows are)"
                .to_owned()
        )],
        "one warning for the statement that updated two rows, none for the delete"
    );
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.messages").await, 2);
    db.finish().await;
}

/// The table's definition, rights and triggers as pg_dump prints them.
fn dump_table(url: &str) -> String {
    let config: tokio_postgres::Config = url.parse().unwrap();
    let out = std::process::Command::new("pg_dump")
        .args([
            "--schema-only",
            "--table",
            "public.outboxevent",
            "-h",
            "127.0.0.1",
        ])
        .args(["-p", &config.get_ports()[0].to_string(), "-U", "postgres"])
        .arg(config.get_dbname().unwrap())
        .output()
        .expect("pg_dump");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|l| {
            !l.starts_with("--") && !l.starts_with("\\restrict") && !l.starts_with("\\unrestrict")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test]
async fn unadopting_leaves_the_table_as_it_was_and_its_own_triggers_alone() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(QUARKUS_TABLE).await.unwrap();
    // The application's own trigger, with the name the adoption uses for its own.
    c.batch_execute(
        "CREATE FUNCTION public.audit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
         CREATE TRIGGER audit AFTER INSERT ON outboxevent FOR EACH ROW EXECUTE FUNCTION public.audit();
         GRANT INSERT ON outboxevent TO outbox_producer;",
    )
    .await
    .unwrap();
    let before = dump_table(&db.url);
    c.execute("SELECT outbox.adopt_table('outboxevent')", &[])
        .await
        .unwrap();
    assert_eq!(
        count(
            &c,
            "SELECT count(*) FROM outbox.adopted_tables WHERE table_name = 'outboxevent'"
        )
        .await,
        1
    );
    assert_ne!(
        dump_table(&db.url),
        before,
        "the adoption's triggers are on the table"
    );
    // Adopting again replaces the mapping; one adoption.
    c.execute(
        "SELECT outbox.adopt_table('outboxevent', 'debezium', '{\"key\": \"type\"}')",
        &[],
    )
    .await
    .unwrap();
    let mapping: serde_json::Value = c
        .query_one("SELECT mapping FROM outbox.adopted_tables", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(mapping["key"], "type");
    let removed: bool = c
        .query_one("SELECT outbox.unadopt_table('outboxevent')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(removed);
    assert_eq!(dump_table(&db.url), before, "the table as it was");
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.adopted_tables").await,
        0
    );
    let again: bool = c
        .query_one("SELECT outbox.unadopt_table('outboxevent')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!again, "a table not adopted: nothing to remove");
    insert_event(&c, Uuid::new_v4(), "1", serde_json::json!({})).await;
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.messages").await, 0);
    db.finish().await;
}

/// The producer's login needs its INSERT on the table and outbox_producer, nothing else (no
/// right on the trigger functions); without outbox_producer its insert fails, so that no
/// row is inserted unrelayed. Adopting needs the TRIGGER right on the table.
#[tokio::test]
async fn the_trigger_runs_with_the_inserting_role_s_rights() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(QUARKUS_TABLE).await.unwrap();
    let producer = db.login("app", Some("outbox_producer")).await;
    let stranger = db.login("stranger", None).await;
    let relay = db.login("relay", Some("outbox_relay")).await;
    for login in ["app", "stranger", "relay"] {
        c.batch_execute(&format!(
            "GRANT INSERT ON outboxevent TO {}_{login}",
            db.name
        ))
        .await
        .unwrap();
    }
    // outbox_relay without the TRIGGER right on the table cannot adopt it.
    let relay = common::connect(&relay).await.unwrap();
    let (code, _) = sqlstate(
        relay
            .execute("SELECT outbox.adopt_table('public.outboxevent')", &[])
            .await,
    );
    assert_eq!(code, "42501");
    c.batch_execute(&format!(
        "GRANT TRIGGER ON outboxevent TO {}_relay",
        db.name
    ))
    .await
    .unwrap();
    relay
        .execute("SELECT outbox.adopt_table('public.outboxevent')", &[])
        .await
        .expect("with the TRIGGER right, outbox_relay adopts");

    let app = common::connect(&producer).await.unwrap();
    let id = Uuid::new_v4();
    insert_event(&app, id, "1", serde_json::json!({"a": 1})).await;
    assert_eq!(message(&c, id).await.0, "Order");
    let executable: bool = c
        .query_one(
            &format!(
                "SELECT has_function_privilege('{}_app', 'outbox.adopted_row()', 'EXECUTE')",
                db.name
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        !executable,
        "the producer holds no right on the trigger function"
    );

    let stranger = common::connect(&stranger).await.unwrap();
    let at = chrono::Utc::now().naive_utc();
    let (code, _) = sqlstate(
        stranger
            .execute(
                QUARKUS_INSERT,
                &[
                    &"Order",
                    &"2",
                    &"OrderCreated",
                    &at,
                    &serde_json::json!({}),
                    &None::<&str>,
                    &Uuid::new_v4(),
                ],
            )
            .await,
    );
    assert_eq!(
        code, "42501",
        "a login outside outbox_producer cannot insert unrelayed"
    );
    assert_eq!(count(&c, "SELECT count(*) FROM outboxevent").await, 1);
    db.finish().await;
}

/// A table of another shape, by a mapping of its columns: a topic for every row, a bytea
/// payload, a delay, a header and an attempt budget.
#[tokio::test]
async fn a_generic_mapping_relays_a_table_of_any_shape() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE SCHEMA shop;
         CREATE TABLE shop.events (n bigserial, order_ref text, body bytea, kind text, not_before timestamptz)",
    )
    .await
    .unwrap();
    let mapping = serde_json::json!({
        "topic_value": "orders", "key": "order_ref", "payload": "body",
        "headers": {"event-kind": "kind"}, "available_at": "not_before", "max_attempts": 3,
    });
    c.execute(
        "SELECT outbox.adopt_table('shop.events', NULL, $1)",
        &[&mapping],
    )
    .await
    .unwrap();
    c.batch_execute(
        "INSERT INTO shop.events (order_ref, body, kind, not_before)
         VALUES ('o-1', '\\x00ff'::bytea, 'paid', now() + interval '1 hour'),
                (NULL, NULL, NULL, NULL)",
    )
    .await
    .unwrap();
    let rows = c
        .query(
            "SELECT topic, message_key, payload, content_type, headers, max_attempts,
                    available_at > now() + interval '50 minutes'
               FROM outbox.messages ORDER BY seq",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].get::<_, String>(0), "orders");
    assert_eq!(rows[0].get::<_, Option<String>>(1).as_deref(), Some("o-1"));
    assert_eq!(rows[0].get::<_, Vec<u8>>(2), vec![0x00, 0xff]);
    assert_eq!(rows[0].get::<_, String>(3), "application/octet-stream");
    assert_eq!(
        rows[0].get::<_, serde_json::Value>(4),
        serde_json::json!({"event-kind": "paid"})
    );
    assert_eq!(rows[0].get::<_, i32>(5), 3);
    assert!(rows[0].get::<_, bool>(6), "delayed by not_before");
    assert_eq!(rows[1].get::<_, Option<String>>(1), None);
    assert_eq!(
        rows[1].get::<_, Vec<u8>>(2),
        Vec::<u8>::new(),
        "a NULL payload is empty"
    );
    assert_eq!(
        rows[1].get::<_, String>(3),
        "application/octet-stream",
        "of no type"
    );
    assert_eq!(
        rows[1].get::<_, serde_json::Value>(4),
        serde_json::json!({})
    );

    // Mappings refused, naming the argument.
    for (preset, mapping, says) in [
        (
            None,
            serde_json::json!({"payload": "body"}),
            "needs one of topic",
        ),
        (
            None,
            serde_json::json!({"topic_value": "t"}),
            "needs payload",
        ),
        (
            None,
            serde_json::json!({"topic_value": "t", "payload": "nope"}),
            "has no column",
        ),
        (
            None,
            serde_json::json!({"topic_value": "t", "payload": "body", "id": "n"}),
            "of type bigint",
        ),
        (
            None,
            serde_json::json!({"topic_value": "t", "payload": "body", "color": "n"}),
            "not a mapping key",
        ),
        (Some("debezium"), serde_json::json!({}), "has no column"),
        (Some("kafka-connect"), serde_json::json!({}), "not a preset"),
    ] {
        let (code, text) = sqlstate(
            c.execute(
                "SELECT outbox.adopt_table('shop.events', $1, $2)",
                &[&preset, &mapping],
            )
            .await,
        );
        assert_eq!(code, "P7001", "{mapping}: {text}");
        assert!(text.contains(says), "{mapping}: {text}");
    }
    let (code, _) = sqlstate(
        c.execute("SELECT outbox.adopt_table('outbox.messages')", &[])
            .await,
    );
    assert_eq!(code, "P7001", "the outbox's own table is not adopted");
    db.finish().await;
}

/// The cut-over of docs/from-debezium.md: one transaction adopts the table and takes it out
/// of the connector's publication. Postgres decodes each transaction with the publication as
/// it was then, so every row committed before the cut-over is in the connector's stream and
/// not in the outbox, and every row committed after it is in the outbox and not in the
/// stream, also for a connector that reads the stream only after the cut-over. On a cluster
/// of its own with `wal_level = logical`, a `pgoutput` slot stands for Debezium's; one
/// insert is in flight when the cut-over starts (the cut-over waits for it) and one starts
/// while it waits (and waits for it in turn).
#[tokio::test(flavor = "multi_thread")]
async fn the_cut_over_splits_the_rows_between_debezium_s_slot_and_the_outbox() {
    // Decoding reads only flushed WAL: each commit flushed before it returns, as by default
    // (the harness turns it off).
    let cluster =
        common::cluster::Cluster::start(&[("wal_level", "logical"), ("synchronous_commit", "on")]);
    let db = TestDb::new_in(&cluster).await;
    let mut c = db.client().await;
    c.batch_execute(QUARKUS_TABLE).await.unwrap();
    c.batch_execute("CREATE PUBLICATION dbz_publication FOR TABLE public.outboxevent")
        .await
        .unwrap();
    // A statement of its own: a slot is not created in a transaction that wrote.
    c.batch_execute("SELECT pg_create_logical_replication_slot('debezium', 'pgoutput')")
        .await
        .unwrap();

    let before = Uuid::new_v4();
    insert_event(&c, before, "1", serde_json::json!({"n": 1})).await;
    // An insert in flight when the cut-over starts.
    let mut in_flight_client = db.client().await;
    let in_flight = Uuid::new_v4();
    let tx = in_flight_client.transaction().await.unwrap();
    insert_event(&tx, in_flight, "2", serde_json::json!({"n": 2})).await;

    let cut_over = tokio::spawn(async move {
        let tx = c.transaction().await.unwrap();
        tx.execute("SELECT outbox.adopt_table('public.outboxevent')", &[])
            .await
            .unwrap();
        tx.batch_execute("ALTER PUBLICATION dbz_publication DROP TABLE public.outboxevent")
            .await
            .unwrap();
        tx.commit().await.unwrap();
        c
    });
    let observer = db.client().await;
    eventually(
        MINUTE_SQL,
        "the cut-over to wait for the insert in flight",
        || async {
            count(
                &observer,
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE '%adopt_table%'",
            )
            .await
                == 1
        },
    )
    .await;
    // An insert that starts while the cut-over waits: it waits for the cut-over in turn.
    let after_waiting = Uuid::new_v4();
    let waiting_client = db.client().await;
    let waiting = tokio::spawn(async move {
        insert_event(
            &waiting_client,
            after_waiting,
            "3",
            serde_json::json!({"n": 3}),
        )
        .await;
    });
    eventually(
        MINUTE_SQL,
        "the insert to wait for the cut-over",
        || async {
            count(
                &observer,
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE 'INSERT INTO outboxevent%'",
            )
            .await
                == 1
        },
    )
    .await;
    tx.commit().await.unwrap();
    let c = cut_over.await.unwrap();
    waiting.await.unwrap();
    let after = Uuid::new_v4();
    insert_event(&c, after, "4", serde_json::json!({"n": 4})).await;

    // All the slot streams, read only now (a connector that lagged behind the cut-over):
    // pgoutput's insert messages ('I', 73), each holding the row's text.
    let streamed: Vec<String> = c
        .query(
            "SELECT encode(data, 'escape') FROM pg_logical_slot_peek_binary_changes('debezium', \
                 NULL, NULL, 'proto_version', '1', 'publication_names', 'dbz_publication') \
              WHERE get_byte(data, 0) = 73",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let enqueued: Vec<Uuid> = c
        .query("SELECT outbox_id FROM outbox.messages ORDER BY seq", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let in_stream = |id: Uuid| {
        streamed
            .iter()
            .filter(|m| m.contains(&id.to_string()))
            .count()
    };
    assert_eq!(
        streamed.len(),
        2,
        "only the rows before the cut-over: {streamed:?}"
    );
    for (id, what) in [(before, "before"), (in_flight, "in flight")] {
        assert_eq!(in_stream(id), 1, "the row {what}: streamed");
        assert!(!enqueued.contains(&id), "the row {what}: not in the outbox");
    }
    assert_eq!(
        enqueued,
        vec![after_waiting, after],
        "the rows after it: the relayer's"
    );
    c.batch_execute("SELECT pg_drop_replication_slot('debezium')")
        .await
        .unwrap();
    db.finish().await;
}

const MINUTE_SQL: std::time::Duration = std::time::Duration::from_secs(60);

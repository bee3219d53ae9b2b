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

/// The Quarkus extension's outbox table, adopted with the `debezium` preset.
async fn adopt_quarkus_table(c: &tokio_postgres::Client) {
    c.batch_execute(QUARKUS_TABLE).await.unwrap();
    c.execute("SELECT outbox.adopt_table('outboxevent')", &[])
        .await
        .unwrap();
}

/// A connection to `url` and the (severity, message) of every notice it receives, until
/// the client is dropped.
async fn with_notices(
    url: &str,
) -> (
    tokio_postgres::Client,
    tokio::sync::mpsc::UnboundedReceiver<(String, String)>,
) {
    let (client, mut connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let (tx, notices) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(m)) = futures_util::StreamExt::next(&mut messages).await {
            if let tokio_postgres::AsyncMessage::Notice(n) = m {
                let _ = tx.send((n.severity().to_owned(), n.message().to_owned()));
            }
        }
    });
    (client, notices)
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
    assert!(mapping.get("payload_kind").is_none(), "{mapping}");

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
    adopt_quarkus_table(&c).await;
    let id = Uuid::new_v4();
    insert_event(&c, id, "7", serde_json::json!({"n": 1})).await;
    insert_event(&c, Uuid::new_v4(), "7", serde_json::json!({"n": 2})).await;
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.messages").await, 2);

    // The warning arrives as a notice on the connection that updated.
    let (client, mut notices) = with_notices(&db.url).await;
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
            "SELECT count(*) FROM outbox.adopted_tables WHERE table_name = 'public.outboxevent'"
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
        (
            Some("debezium"),
            serde_json::json!({}),
            "lacks the column(s) aggregateid, aggregatetype, id, payload that the preset debezium expects",
        ),
        (
            None,
            serde_json::json!({"topic_value": "t", "payload": "body", "max_attempts": 1.5}),
            "max_attempts must be a whole number",
        ),
        (
            None,
            serde_json::json!({"topic_value": "t", "payload": "body", "max_attempts": 3e9}),
            "max_attempts must be a whole number",
        ),
        (
            None,
            serde_json::json!({"topic_value": "t", "payload": "body", "max_attempts": 0}),
            "max_attempts must be a whole number",
        ),
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

/// The payload is the column's stored value, whatever the inserting session's settings: a
/// bytea's bytes under `bytea_output = 'escape'`, a json column's text as stored (key order,
/// white space and duplicate keys kept), a text column's text ('' an empty payload).
#[tokio::test]
async fn payloads_arrive_as_stored_whatever_the_session_s_settings() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE TABLE raw_events (aggregatetype text, b bytea, j json, t text);
         SELECT outbox.adopt_table('raw_events', NULL, '{\"topic\": \"aggregatetype\", \"payload\": \"b\"}')",
    )
    .await
    .unwrap();
    let bytes: Vec<u8> = (0..=255u8).chain(*b"\\x00").collect();
    c.batch_execute("SET bytea_output = 'escape'")
        .await
        .unwrap();
    c.execute(
        "INSERT INTO raw_events (aggregatetype, b) VALUES ('bytes', $1)",
        &[&bytes],
    )
    .await
    .unwrap();
    let json = "{ \"b\": 1,\n  \"a\": 2, \"a\": 3 }";
    c.execute(
        "SELECT outbox.adopt_table('raw_events', NULL, '{\"topic\": \"aggregatetype\", \"payload\": \"j\"}')",
        &[],
    )
    .await
    .unwrap();
    c.execute(
        "INSERT INTO raw_events (aggregatetype, j) VALUES ('json', $1::text::json)",
        &[&json],
    )
    .await
    .unwrap();
    c.execute(
        "SELECT outbox.adopt_table('raw_events', NULL, '{\"topic\": \"aggregatetype\", \"payload\": \"t\"}')",
        &[],
    )
    .await
    .unwrap();
    c.execute(
        "INSERT INTO raw_events (aggregatetype, t) VALUES ('text', '')",
        &[],
    )
    .await
    .unwrap();
    let payload = |topic: &'static str| {
        let c = &c;
        async move {
            let r = c
                .query_one(
                    "SELECT payload, content_type FROM outbox.messages WHERE topic = $1",
                    &[&topic],
                )
                .await
                .unwrap();
            (r.get::<_, Vec<u8>>(0), r.get::<_, String>(1))
        }
    };
    assert_eq!(
        payload("bytes").await,
        (bytes, "application/octet-stream".to_owned()),
        "the bytes, byte for byte"
    );
    assert_eq!(
        payload("json").await,
        (json.as_bytes().to_vec(), "application/json".to_owned()),
        "the json column's stored text"
    );
    assert_eq!(
        payload("text").await,
        (Vec::new(), "text/plain; charset=utf-8".to_owned()),
        "an empty text is an empty payload"
    );
    db.finish().await;
}

/// The mapping names columns and the trigger reads their types at each insert: a mapped
/// column renamed after the adoption fails the insert naming the table and the column and
/// saying to adopt again; a column's new type is the one used; a NULL or empty topic names
/// the topic column and the table.
#[tokio::test]
async fn ddl_after_the_adoption_fails_inserts_clearly_or_follows_the_column_s_type() {
    let db = TestDb::new().await;
    let c = db.client().await;
    adopt_quarkus_table(&c).await;
    let insert =
        "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, timestamp, payload)
                  VALUES (gen_random_uuid(), $1, 'k', 'T', now(), $2::text::json)";

    c.batch_execute("ALTER TABLE outboxevent RENAME COLUMN payload TO body")
        .await
        .unwrap();
    let (code, text) = sqlstate(
        c.execute(
            "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, timestamp, body)
             VALUES (gen_random_uuid(), 'Order', 'k', 'T', now(), '{}')",
            &[],
        )
        .await,
    );
    assert_eq!(code, "42703", "{text}");
    assert!(
        text.contains("public.outboxevent has no column payload"),
        "{text}"
    );
    assert!(text.contains("outbox-relay adopt"), "{text}");
    assert_eq!(count(&c, "SELECT count(*) FROM outboxevent").await, 0);

    // The column back, of another type: text now, and sent as text.
    c.batch_execute(
        "ALTER TABLE outboxevent RENAME COLUMN body TO payload;
         ALTER TABLE outboxevent ALTER COLUMN payload TYPE text",
    )
    .await
    .unwrap();
    c.execute(
        "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, timestamp, payload)
         VALUES (gen_random_uuid(), 'Order', 'k', 'T', now(), 'plain')",
        &[],
    )
    .await
    .unwrap();
    let content_type: String = c
        .query_one("SELECT content_type FROM outbox.messages", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(content_type, "text/plain; charset=utf-8");
    c.batch_execute("DELETE FROM outboxevent; ALTER TABLE outboxevent ALTER COLUMN payload TYPE json USING payload::json")
        .await
        .unwrap();

    for topic in [None, Some("")] {
        let (code, text) = sqlstate(c.execute(insert, &[&topic, &"{}"]).await);
        if topic.is_none() {
            // NOT NULL of the Quarkus table refuses it first.
            assert_eq!(code, "23502", "{text}");
            continue;
        }
        assert_eq!(code, "P7001", "{text}");
        assert!(
            text.contains("topic column aggregatetype of the adopted table public.outboxevent"),
            "{text}"
        );
        assert!(!text.contains("p_topic"), "{text}");
    }
    db.finish().await;
}

/// A table's own trigger of the adoption's names is neither replaced by adopt_table nor
/// dropped by unadopt_table.
#[tokio::test]
async fn a_trigger_of_the_table_s_own_under_the_adoption_s_name_is_left_alone() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(QUARKUS_TABLE).await.unwrap();
    c.batch_execute(
        "CREATE FUNCTION audit() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NULL; END$$;
         CREATE TRIGGER outbox_adopt_updates AFTER UPDATE ON outboxevent
             FOR EACH ROW EXECUTE FUNCTION audit()",
    )
    .await
    .unwrap();
    let (code, text) = sqlstate(
        c.execute("SELECT outbox.adopt_table('outboxevent')", &[])
            .await,
    );
    assert_eq!(code, "42710", "{text}");
    assert!(
        text.contains("already has a trigger named outbox_adopt_updates"),
        "{text}"
    );
    let removed: bool = c
        .query_one("SELECT outbox.unadopt_table('outboxevent')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!removed);
    assert_eq!(
        count(
            &c,
            "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'outboxevent'::regclass \
             AND tgname = 'outbox_adopt_updates' AND tgfoid = 'audit()'::regprocedure"
        )
        .await,
        1,
        "the table's own trigger is still there"
    );
    db.finish().await;
}

/// The UPDATE warning comes only from a statement that updated rows: not from an UPDATE of
/// no rows nor from an INSERT … ON CONFLICT DO UPDATE that inserted.
#[tokio::test]
async fn only_an_update_of_rows_warns() {
    let db = TestDb::new().await;
    let (c, mut notices) = with_notices(&db.url).await;
    adopt_quarkus_table(&c).await;
    let upsert =
        "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, timestamp, payload)
                  VALUES ($1, 'Order', 'k', 'T', now(), '{}')
                  ON CONFLICT (id) DO UPDATE SET type = 'again'";
    let id = Uuid::new_v4();
    c.execute(upsert, &[&id]).await.unwrap();
    c.execute("UPDATE outboxevent SET type = 'x' WHERE false", &[])
        .await
        .unwrap();
    c.execute("UPDATE outboxevent SET type = 'x'", &[])
        .await
        .unwrap();
    drop(c);
    let mut warnings = Vec::new();
    while let Some((_, n)) = notices.recv().await {
        warnings.push(n);
    }
    assert_eq!(warnings.len(), 1, "only the UPDATE of a row: {warnings:?}");
    db.finish().await;
}

/// A partitioned table is adopted as a whole: a partition is refused naming its parent,
/// inserts into any partition are relayed, and the list shows the parent once,
/// schema-qualified.
#[tokio::test]
async fn a_partitioned_table_is_adopted_through_its_parent_and_listed_qualified() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE TABLE events (aggregatetype text, aggregateid text, id uuid, payload jsonb)
             PARTITION BY LIST (aggregatetype);
         CREATE TABLE events_order PARTITION OF events FOR VALUES IN ('Order');
         SELECT outbox.adopt_table('events')",
    )
    .await
    .unwrap();
    for sql in [
        "SELECT outbox.adopt_table('events_order')",
        "SELECT outbox.unadopt_table('events_order')",
    ] {
        let (code, text) = sqlstate(c.execute(sql, &[]).await);
        assert_eq!(code, "P7001", "{text}");
        assert!(
            text.contains("public.events_order is a partition of public.events"),
            "{text}"
        );
    }
    c.execute(
        "INSERT INTO events VALUES ('Order', 'k', gen_random_uuid(), '{}')",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.messages").await, 1);
    let listed: Vec<String> = c
        .query("SELECT table_name FROM outbox.adopted_tables", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(listed, vec!["public.events".to_owned()]);
    db.finish().await;
}

/// The transaction's `SET LOCAL outbox.traceparent` is the creation context of an adopted
/// row too, in place of its `tracingspancontext`'s traceparent (03_enqueue.sql: the setting
/// wins over the headers), which stays a header of its own.
#[tokio::test]
async fn the_transactions_trace_context_wins_over_the_adopted_rows() {
    const CURRENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let db = TestDb::new().await;
    let mut c = db.client().await;
    adopt_quarkus_table(&c).await;
    let id = Uuid::new_v4();
    let tx = c.transaction().await.unwrap();
    tx.batch_execute(&format!("SET LOCAL outbox.traceparent = '{CURRENT}'"))
        .await
        .unwrap();
    insert_event(&tx, id, "42", serde_json::json!({})).await;
    tx.commit().await.unwrap();
    let (_, _, _, _, headers) = message(&c, id).await;
    assert_eq!(headers["traceparent"], CURRENT);
    assert_eq!(headers["tracingspancontext"], TRACE);
    assert_ne!(CURRENT, TRACEPARENT);
    db.finish().await;
}

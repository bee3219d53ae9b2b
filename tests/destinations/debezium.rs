//! The debezium envelope of the `kafka` destination, fed by an adopted table: an
//! application that writes Debezium's outbox table with the Quarkus extension's unchanged
//! statements gets, on a Kafka-protocol broker (tansu), the records Debezium's outbox event
//! router documents for the same rows, read back with kcat (an independent client) and
//! compared field by field with what the router's documentation says it writes:
//!
//! - topic `outbox.event.<aggregatetype>` (`route.topic.replacement` =
//!   `outbox.event.${routedByValue}`, routed by `aggregatetype`);
//! - key the row's `aggregateid` (`table.field.event.key`);
//! - header `id` the row's `id` (`table.field.event.id`), and the columns of
//!   `table.fields.additional.placement` (`type:header:eventType`), nothing else;
//! - value the `payload` column alone: with `table.expand.json.payload = true` the JSON
//!   itself, otherwise the JSON converter's string of the column's text; a NULL payload with
//!   `route.tombstone.on.empty.payload = true` a tombstone (no value).

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::common::quarkus::{DELETE, INSERT, TABLE, TRACE};
use crate::common::{self, TestDb, eventually, pending};
use crate::kafka::{Record, Tansu};
use crate::{Harness, MINUTE};
use tokio_postgres::Client;
use uuid::Uuid;

/// One row of the Quarkus table, as the application inserts it.
struct Row {
    id: Uuid,
    aggregatetype: &'static str,
    aggregateid: String,
    kind: &'static str,
    payload: Option<serde_json::Value>,
}

impl Row {
    fn new(
        aggregatetype: &'static str,
        aggregateid: &str,
        payload: Option<serde_json::Value>,
    ) -> Row {
        Row {
            id: Uuid::new_v4(),
            aggregatetype,
            aggregateid: aggregateid.to_owned(),
            kind: "Created",
            payload,
        }
    }

    /// The extension's insert of this row.
    async fn insert(&self, c: &impl tokio_postgres::GenericClient) {
        let now = chrono::Utc::now().naive_utc();
        c.execute(
            INSERT,
            &[
                &self.aggregatetype,
                &self.aggregateid,
                &self.kind,
                &now,
                &self.payload,
                &TRACE,
                &self.id,
            ],
        )
        .await
        .expect("the application's insert");
    }

    /// The extension's transaction: insert, then delete the row (remove-after-insert).
    async fn insert_and_remove(&self, c: &mut Client) {
        let tx = c.transaction().await.unwrap();
        self.insert(&tx).await;
        tx.execute(DELETE, &[&self.id]).await.unwrap();
        tx.commit().await.unwrap();
    }
}

/// What the router writes for a row, by its documentation (see the module's header):
/// (topic, key, headers, value as text; None for a tombstone).
fn documented(
    row: &Row,
    placement: &[(&str, &str)],
    expand: bool,
    tombstone: bool,
) -> (
    String,
    Option<String>,
    BTreeMap<String, String>,
    Option<String>,
) {
    let mut headers = BTreeMap::from([("id".to_owned(), row.id.to_string())]);
    for (column, alias) in placement {
        let value = match *column {
            "type" => row.kind,
            other => panic!("the test places type only, not {other}"),
        };
        headers.insert((*alias).to_owned(), value.to_owned());
    }
    let value = match &row.payload {
        None if tombstone => None,
        None => Some("null".to_owned()),
        Some(p) if expand => Some(p.to_string()),
        // The JSON converter writes the column's text (Postgres prints jsonb with ", " and
        // ": ") as a JSON string.
        Some(p) => Some(serde_json::Value::String(jsonb_text(p)).to_string()),
    };
    (
        format!("outbox.event.{}", row.aggregatetype),
        Some(row.aggregateid.clone()),
        headers,
        value,
    )
}

/// A flat JSON object as Postgres prints it as jsonb text (keys shorter first, then by
/// bytes; `": "` and `", "`); enough for the payloads of this test.
fn jsonb_text(v: &serde_json::Value) -> String {
    let object = v.as_object().expect("an object payload");
    let mut keys: Vec<&String> = object.keys().collect();
    keys.sort_by(|a, b| a.len().cmp(&b.len()).then(a.cmp(b)));
    let parts: Vec<String> = keys
        .iter()
        .map(|k| {
            format!(
                "{}: {}",
                serde_json::Value::String((*k).clone()),
                object[*k]
            )
        })
        .collect();
    format!("{{{}}}", parts.join(", "))
}

/// The record's value compared as the consumer reads it: JSON when it is JSON (a consumer
/// of the expanded form parses it), else as text.
fn same_value(record: &Record, expected: &Option<String>) {
    match (&record.payload, expected) {
        (None, None) => {}
        (Some(got), Some(want)) => {
            let parsed = |s: &str| serde_json::from_str::<serde_json::Value>(s).ok();
            match (parsed(got), parsed(want)) {
                (Some(g), Some(w)) => assert_eq!(g, w, "value of {:?}", record.key),
                _ => assert_eq!(got, want, "value of {:?}", record.key),
            }
            if let Some(serde_json::Value::String(want_text)) = parsed(want) {
                assert_eq!(
                    parsed(got),
                    Some(serde_json::Value::String(want_text)),
                    "the string form is a JSON string of the column's text"
                );
            }
        }
        (got, want) => panic!(
            "value of {:?}: got {got:?}, documented {want:?}",
            record.key
        ),
    }
}

fn config(db: &TestDb, h: &Tansu) -> String {
    let brokers = h.brokers();
    let path = db.scratch_dir().join("debezium.toml");
    std::fs::write(
        &path,
        format!(
            "[destinations.orders]\ntype = \"kafka\"\nbrokers = \"{brokers}\"\n\
             envelope = \"debezium\"\ndebezium_placement = \"type:header:eventType\"\n\n\
             [destinations.customers]\ntype = \"kafka\"\nbrokers = \"{brokers}\"\n\
             envelope = \"debezium\"\ntopic = \"outbox.event.$${{routedByValue}}\"\n\
             debezium_value = \"string\"\ndebezium_tombstone_on_empty_payload = true\n\n\
             [[routes]]\ntopic = \"Order\"\ndestination = \"orders\"\n\n\
             [[routes]]\ntopic = \"Customer\"\ndestination = \"customers\"\n"
        ),
    )
    .unwrap();
    path.display().to_string()
}

async fn relay_until_drained(
    db: &TestDb,
    h: &Tansu,
    c: &Client,
    worker: &str,
    limit: std::time::Duration,
) {
    let path = config(db, h);
    let mut w = common::Relayer::start(db, worker, &["--config", &path, "--no-telemetry"]);
    eventually(limit, "the outbox to drain", || async {
        pending(c).await == 0
    })
    .await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unchanged_quarkus_application_gets_the_records_debezium_documents() {
    let db = TestDb::new().await;
    let mut c = db.client().await;
    let h = Tansu::start(&db).await;
    h.create_topic("outbox.event.Order", 3);
    h.create_topic("outbox.event.Customer", 1);
    c.batch_execute(TABLE).await.unwrap();
    let adopted = common::verb(&["adopt", "outboxevent", "--preset", "debezium"], &db.url);
    assert!(
        adopted.status.success(),
        "{}",
        common::text(&adopted.stderr)
    );
    assert!(common::text(&adopted.stdout).starts_with("adopted outboxevent: "));

    let t0 = chrono::Utc::now().timestamp_millis();
    let placed = Row::new(
        "Order",
        "42",
        Some(serde_json::json!({"orderId": 42, "lines": [{"sku": "a b", "qty": 2}], "note": null})),
    );
    placed.insert_and_remove(&mut c).await;
    // Inserted and kept: the application removes it later, which relays nothing more.
    let kept = Row::new("Order", "43", Some(serde_json::json!({"orderId": 43})));
    kept.insert(&c).await;
    c.execute("DELETE FROM outboxevent", &[]).await.unwrap();
    // Rolled back: nothing relayed.
    let rolled_back = Row::new("Order", "44", Some(serde_json::json!({"orderId": 44})));
    let tx = c.transaction().await.unwrap();
    rolled_back.insert(&tx).await;
    tx.rollback().await.unwrap();
    let string_form = Row::new(
        "Customer",
        "c-1",
        Some(serde_json::json!({"name": "Ann", "id": 1})),
    );
    string_form.insert_and_remove(&mut c).await;
    let emptied = Row::new("Customer", "c-2", None);
    emptied.insert_and_remove(&mut c).await;
    let t1 = chrono::Utc::now().timestamp_millis();

    relay_until_drained(&db, &h, &c, "debezium", MINUTE).await;

    let orders = h.records("outbox.event.Order");
    let customers = h.records("outbox.event.Customer");
    assert_eq!(orders.len(), 2, "{orders:?}");
    assert_eq!(customers.len(), 2, "{customers:?}");
    let cases = [
        (&placed, &orders, &[("type", "eventType")][..], true, false),
        (&kept, &orders, &[("type", "eventType")][..], true, false),
        (&string_form, &customers, &[][..], false, true),
        (&emptied, &customers, &[][..], false, true),
    ];
    for (row, records, placement, expand, tombstone) in cases {
        let (topic, key, headers, value) = documented(row, placement, expand, tombstone);
        let record = records
            .iter()
            .find(|r| r.headers().get("id") == Some(&row.id.to_string()))
            .unwrap_or_else(|| panic!("no record with id {} on {topic}", row.id));
        assert_eq!(record.key, key, "key of {}", row.id);
        assert_eq!(
            record.headers(),
            headers,
            "headers of {} (and none else)",
            row.id
        );
        assert_eq!(record.headers.len(), 2 * headers.len(), "each header once");
        same_value(record, &value);
        assert!(
            (t0 - 1000..=t1 + 1000).contains(&record.ts),
            "the record's time is the insert's: {} not in {t0}..{t1}",
            record.ts
        );
    }
    let ids: HashSet<String> = orders
        .iter()
        .chain(&customers)
        .map(|r| r.headers()["id"].clone())
        .collect();
    assert!(
        !ids.contains(&rolled_back.id.to_string()),
        "the rolled back row"
    );

    // The adoption listed, then removed with one command; the table relays nothing more.
    let listed = common::verb(&["adopt", "--list"], &db.url);
    assert!(
        common::text(&listed.stdout).starts_with("public.outboxevent\t{"),
        "{}",
        common::text(&listed.stdout)
    );
    let removed = common::verb(&["adopt", "--remove", "outboxevent"], &db.url);
    assert_eq!(
        common::text(&removed.stdout),
        "outboxevent is no longer adopted\n"
    );
    Row::new("Order", "45", Some(serde_json::json!({})))
        .insert(&c)
        .await;
    assert_eq!(pending(&c).await, 0);
    assert_eq!(
        common::text(&common::verb(&["adopt", "--list"], &db.url).stdout),
        ""
    );
    db.finish().await;
}

/// 10,000 rows from 4 producers at once, each its own aggregates, each row in the
/// extension's insert-and-delete transaction: every row arrives once, and each aggregate's
/// records sit in one partition in the order its producer committed them.
#[tokio::test(flavor = "multi_thread")]
async fn ten_thousand_rows_from_four_producers_keep_each_aggregate_s_order() {
    const PRODUCERS: usize = 4;
    const PER_PRODUCER: usize = 2_500;
    const AGGREGATES: usize = 8;
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = Tansu::start(&db).await;
    h.create_topic("outbox.event.Order", 3);
    h.create_topic("outbox.event.Customer", 1);
    c.batch_execute(TABLE).await.unwrap();
    c.execute("SELECT outbox.adopt_table('outboxevent')", &[])
        .await
        .unwrap();

    let mut producers = tokio::task::JoinSet::new();
    for p in 0..PRODUCERS {
        let mut app = db.client().await;
        producers.spawn(async move {
            for seq in 0..PER_PRODUCER {
                let aggregate = format!("p{p}-{}", seq % AGGREGATES);
                Row::new(
                    "Order",
                    &aggregate,
                    Some(serde_json::json!({"producer": p, "seq": seq})),
                )
                .insert_and_remove(&mut app)
                .await;
            }
        });
    }
    let started = std::time::Instant::now();
    while let Some(done) = producers.join_next().await {
        done.unwrap();
    }
    eprintln!(
        "{} rows inserted by {PRODUCERS} producers in {:?}",
        PRODUCERS * PER_PRODUCER,
        started.elapsed()
    );
    assert_eq!(
        common::count(&c, "SELECT count(*) FROM outbox.messages").await,
        i64::try_from(PRODUCERS * PER_PRODUCER).unwrap()
    );
    assert_eq!(
        common::count(&c, "SELECT count(*) FROM outboxevent").await,
        0
    );

    relay_until_drained(&db, &h, &c, "debezium-load", 3 * MINUTE).await;

    let records = h.records("outbox.event.Order");
    let ids: HashSet<String> = records.iter().map(|r| r.headers()["id"].clone()).collect();
    assert_eq!(ids.len(), PRODUCERS * PER_PRODUCER, "every row arrived");
    assert_eq!(records.len(), ids.len(), "and once");
    let mut partition: HashMap<String, i32> = HashMap::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    for r in &records {
        let key = r.key.clone().expect("keyed by aggregateid");
        let value: serde_json::Value = serde_json::from_str(r.payload.as_deref().unwrap()).unwrap();
        assert_eq!(
            key,
            format!(
                "p{}-{}",
                value["producer"],
                value["seq"].as_i64().unwrap() % 8
            )
        );
        assert_eq!(
            *partition.entry(key.clone()).or_insert(r.partition),
            r.partition,
            "{key} in one partition"
        );
        let seq = value["seq"].as_i64().unwrap();
        let before = last.insert(key.clone(), seq).unwrap_or(-1);
        assert!(
            seq > before,
            "{key}: seq {seq} at offset {} after {before}",
            r.offset
        );
    }
    assert_eq!(partition.len(), PRODUCERS * AGGREGATES);
    db.finish().await;
}

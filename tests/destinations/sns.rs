//! Harness of the `sns` destination: a topic per test on a moto server of its own (see
//! `aws.rs`), with an SQS queue subscribed to it, read back from that queue with boto3 (the
//! notification's `Message` and `MessageAttributes`). The refused message is bound for a
//! topic that does not exist. Besides the conformance scenarios: per-key order and
//! deduplication through a FIFO topic and a FIFO queue subscribed to it.
//!
//! Where moto differs from SNS: it delivers to the subscribed queue inside the publish call,
//! so what the publish acknowledged is in the queue when the test reads it (SNS delivers
//! moments later, and retries a failed delivery by the subscription's policy).

use std::collections::{BTreeMap, HashMap};

use tokio_postgres::Client;
use uuid::Uuid;

use crate::aws::{ACCOUNT, Moto, QueueMessage, REGION};
use crate::common::{TestDb, eventually, pending};
use crate::{
    Arrived, Freeze, Harness, InProcess, KillConnections, MINUTE, Outage, histories, start_relayer,
    stop_relayer,
};

/// Not [`crate::UnsendableHeader`]: a header that cannot be an attribute travels in the
/// `outbox-headers` attribute.
pub struct Topic {
    moto: Moto,
    /// The topic name template of the relayer's table.
    topic: &'static str,
}

impl Topic {
    fn messages(&self, topic: &str) -> Vec<QueueMessage> {
        self.moto.read(&["sns-read", topic])
    }
}

impl Harness for Topic {
    const DEDUPES: bool = false;

    async fn start(_db: &TestDb) -> Self {
        let moto = Moto::start().await;
        moto.run(&["sns-create", "orders"]);
        Topic {
            moto,
            topic: "{topic}",
        }
    }

    fn table(&self) -> String {
        format!(
            "type = \"sns\"\ntopic_arn = \"arn:aws:sns:{REGION}:{ACCOUNT}:{}\"\nregion = \"{REGION}\"\nendpoint_url = \"{}\"\n",
            self.topic,
            self.moto.endpoint()
        )
    }

    async fn received(&self) -> Vec<Arrived> {
        self.messages("orders")
            .iter()
            .map(QueueMessage::arrived)
            .collect()
    }

    async fn refused_message(&self, c: &Client) -> (Uuid, &'static str) {
        (
            crate::enqueue(
                c,
                "nobody",
                None,
                serde_json::json!({ "secret": crate::REFUSED_PAYLOAD_MARK }),
            )
            .await,
            "nobody",
        )
    }
}

impl KillConnections for Topic {
    async fn kill_connections(&mut self) {
        self.moto.proxy.kill_connections();
    }
}

impl Outage for Topic {
    async fn stop(&mut self) {
        self.moto.proxy.stop().await;
    }

    async fn restart(&mut self) {
        self.moto.proxy.listen().await;
    }
}

impl Freeze for Topic {
    async fn freeze(&mut self) {
        self.moto.proxy.freeze();
    }

    async fn thaw(&mut self) {
        self.moto.proxy.thaw();
    }
}

impl InProcess for Topic {}

/// Through a FIFO topic to a FIFO queue, a key's messages are received in enqueue order (the
/// group is the key), and a message published twice is received once (its deduplication id
/// is the outbox_id).
#[tokio::test(flavor = "multi_thread")]
async fn a_fifo_topic_keeps_each_keys_order_and_drops_a_redelivery() {
    const KEYS: i64 = 20;
    const PER_KEY: i64 = 25;
    let db = TestDb::new().await;
    let c = db.client().await;
    let moto = Moto::start().await;
    moto.run(&["sns-create", "orders.fifo"]);
    let h = Topic {
        moto,
        topic: "{topic}.fifo",
    };
    c.execute(
        "SELECT outbox.enqueue('orders', jsonb_build_object('seq', s), 'key-' || (s % $1::bigint), '{}'::jsonb) \
         FROM generate_series(0, $2::bigint - 1) AS s",
        &[&KEYS, &(KEYS * PER_KEY)],
    )
    .await
    .unwrap();
    let unkeyed = crate::enqueue(&c, "orders", None, serde_json::json!({})).await;
    let w = start_relayer(&db, &h, "fifo", 10_000);
    eventually(MINUTE, "the outbox to drain", || async {
        pending(&c).await == 0
    })
    .await;
    c.execute(
        "INSERT INTO outbox.messages (outbox_id, topic, payload) VALUES ($1, 'orders', '{}')",
        &[&unkeyed],
    )
    .await
    .unwrap();
    eventually(MINUTE, "the redelivery to drain", || async {
        pending(&c).await == 0
    })
    .await;
    stop_relayer(w).await;
    assert_eq!(histories(&c).await[&unkeyed], "1:DISPATCHED 2:DISPATCHED");

    let mut last: HashMap<String, i64> = HashMap::new();
    let mut counts: BTreeMap<String, i64> = BTreeMap::new();
    let mut unkeyed_copies = 0;
    for m in h.messages("orders.fifo") {
        let headers = m.headers();
        if headers["outbox-id"] == unkeyed.to_string() {
            unkeyed_copies += 1;
            continue;
        }
        let key = headers["outbox-key"].clone();
        assert_eq!(
            m.group.as_deref(),
            Some(key.as_str()),
            "the group is the key"
        );
        let seq = serde_json::from_str::<serde_json::Value>(&m.body).unwrap()["seq"]
            .as_i64()
            .unwrap();
        let previous = last.insert(key.clone(), seq).unwrap_or(-1);
        assert!(seq > previous, "{key}: seq {seq} received after {previous}");
        *counts.entry(key).or_default() += 1;
    }
    assert_eq!(
        unkeyed_copies, 1,
        "the redelivery was dropped by its deduplication id"
    );
    assert_eq!(counts.len(), usize::try_from(KEYS).unwrap());
    assert!(counts.values().all(|n| *n == PER_KEY), "{counts:?}");
    db.finish().await;
}

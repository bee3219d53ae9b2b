//! Harness of the `sqs` destination: a standard queue per test on a moto server of its own
//! (see `aws.rs`), read back with boto3. The queue's `MaximumMessageSize` is 1 KiB, so that
//! a bigger message is one SQS refuses. Besides the conformance scenarios: per-key order and
//! deduplication on a FIFO queue.
//!
//! Where moto differs from SQS: it refuses a whole `SendMessageBatch` for one entry over the
//! size limit, where SQS refuses that entry (the refusal scenario passes either way: the
//! destination sends the entries of a refused call again one by one); its FIFO
//! deduplication interval is SQS's 5 minutes, measured by moto's clock.

use std::collections::{BTreeMap, HashMap};

use tokio_postgres::Client;
use uuid::Uuid;

use crate::aws::{Moto, QueueMessage, REGION};
use crate::common::{self, TestDb, eventually, pending};
use crate::{
    Arrived, Freeze, Harness, InProcess, KillConnections, MINUTE, Outage, histories, start_relayer,
    stop_relayer,
};

/// Not [`crate::UnsendableHeader`]: a header that cannot be an attribute travels in the
/// `outbox-headers` attribute.
pub struct Queue {
    moto: Moto,
    /// The queue template of the relayer's table.
    queue: &'static str,
    /// The destination's `runs_in_one_call`.
    runs_in_one_call: bool,
}

impl Queue {
    fn messages(&self, queue: &str) -> Vec<QueueMessage> {
        self.moto.read(&["sqs-read", queue])
    }
}

impl Harness for Queue {
    const DEDUPES: bool = false;

    async fn start(_db: &TestDb) -> Self {
        let moto = Moto::start().await;
        moto.run(&["sqs-create", "orders", "1024"]);
        Queue {
            moto,
            queue: "{topic}",
            runs_in_one_call: false,
        }
    }

    fn table(&self) -> String {
        format!(
            "type = \"sqs\"\nqueue = \"{}\"\nregion = \"{REGION}\"\nendpoint_url = \"{}\"\nruns_in_one_call = {}\n",
            self.queue,
            self.moto.endpoint(),
            self.runs_in_one_call
        )
    }

    async fn received(&self) -> Vec<Arrived> {
        self.messages("orders")
            .iter()
            .map(QueueMessage::arrived)
            .collect()
    }

    async fn refused_message(&self, c: &Client) -> (Uuid, &'static str) {
        // Over the queue's MaximumMessageSize.
        let id = c
            .query_one(
                "SELECT outbox.enqueue('orders', jsonb_build_object('secret', $1::text, 'pad', repeat('x', 2000)))",
                &[&crate::REFUSED_PAYLOAD_MARK],
            )
            .await
            .unwrap()
            .get(0);
        (id, "shorter than 1024 bytes")
    }
}

impl KillConnections for Queue {
    async fn kill_connections(&mut self) {
        self.moto.proxy.kill_connections();
    }
}

impl Outage for Queue {
    async fn stop(&mut self) {
        self.moto.proxy.stop().await;
    }

    async fn restart(&mut self) {
        self.moto.proxy.listen().await;
    }
}

impl Freeze for Queue {
    async fn freeze(&mut self) {
        self.moto.proxy.freeze();
    }

    async fn thaw(&mut self) {
        self.moto.proxy.thaw();
    }
}

impl InProcess for Queue {}

/// On a FIFO queue a key's messages are received in enqueue order (the group is the key),
/// an unkeyed message is a group of its own, and a message relayed twice is received once
/// (its deduplication id is the outbox_id).
#[tokio::test(flavor = "multi_thread")]
async fn a_fifo_queue_keeps_each_keys_order_and_drops_a_redelivery() {
    const KEYS: i64 = 20;
    const PER_KEY: i64 = 25;
    let db = TestDb::new().await;
    let c = db.client().await;
    let moto = Moto::start().await;
    moto.run(&["sqs-create", "orders.fifo"]);
    let h = Queue {
        moto,
        queue: "{topic}.fifo",
        runs_in_one_call: false,
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
    // The unkeyed message again, under its id, as after a crash before completion.
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

    let messages = h.messages("orders.fifo");
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut counts: BTreeMap<String, i64> = BTreeMap::new();
    let mut unkeyed_copies = 0;
    for m in &messages {
        let headers = m.headers();
        if headers["outbox-id"] == unkeyed.to_string() {
            unkeyed_copies += 1;
            assert_eq!(m.group.as_deref(), Some(unkeyed.to_string().as_str()));
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

/// A message bound for a queue that does not exist is dead-lettered naming the queue (the
/// GetQueueUrl refusal); the messages for the queue that exists arrive.
#[tokio::test(flavor = "multi_thread")]
async fn a_queue_that_does_not_exist_dead_letters_its_messages_with_the_reason() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = Queue::start(&db).await;
    let lost = crate::enqueue(&c, "nobody", None, serde_json::json!({})).await;
    let ids = common::fill(&c, "orders", 5, None).await;
    let w = start_relayer(&db, &h, "noqueue", 10_000);
    eventually(MINUTE, "the outbox to drain", || async {
        pending(&c).await == 0
    })
    .await;
    stop_relayer(w).await;
    let dead = common::dead_letters(&c).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, lost);
    assert!(
        dead[0].1.contains("nobody"),
        "the reason names the queue: {dead:?}"
    );
    // `Code: message`, the same for every message of the cause: no SDK dump, no request id.
    let reason = dead[0]
        .1
        .strip_prefix("sqs GetQueueUrl nobody: ")
        .unwrap_or_else(|| panic!("the reason starts with the call and the queue: {dead:?}"));
    let (code, message) = reason
        .split_once(": ")
        .unwrap_or_else(|| panic!("Code: message: {reason}"));
    assert!(
        code.chars().all(|c| c.is_ascii_alphanumeric() || c == '.')
            && !message.is_empty()
            && !reason.contains("request")
            && !reason.contains('{'),
        "{reason}"
    );
    let got: Vec<Uuid> = h.received().await.iter().map(|a| a.id).collect();
    assert_eq!(got.len(), ids.len());
    db.finish().await;
}

/// On a FIFO queue with `runs_in_one_call`, 10 % keyed traffic (ten keys among 2,000 messages) goes out in
/// `SendMessageBatch` calls that carry a key's run (several entries of one message group
/// in one call, up to SQS's 10): each group is received in enqueue order and every message
/// is there.
#[tokio::test(flavor = "multi_thread")]
async fn mixed_keyed_traffic_on_a_fifo_queue_goes_out_with_a_keys_run_in_one_call() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let moto = Moto::start().await;
    moto.run(&["sqs-create", "orders.fifo"]);
    let h = Queue {
        moto,
        queue: "{topic}.fifo",
        runs_in_one_call: true,
    };
    crate::mixed::enqueue(&c, "orders").await;
    let w = start_relayer(&db, &h, "mixed", 10_000);
    crate::drained(&c).await;
    stop_relayer(w).await;

    let arrived: Vec<(Option<String>, i64)> = h
        .messages("orders.fifo")
        .iter()
        .map(|m| {
            let key = m.headers().get("outbox-key").cloned();
            if let Some(key) = &key {
                assert_eq!(
                    m.group.as_deref(),
                    Some(key.as_str()),
                    "the group is the key"
                );
            }
            let seq = serde_json::from_str::<serde_json::Value>(&m.body).unwrap()["seq"]
                .as_i64()
                .unwrap();
            (key, seq)
        })
        .collect();
    crate::mixed::assert_arrived_in_key_order(&arrived);
    let requests =
        crate::mixed::requests_by_key(&h.moto.proxy.bodies(), "Entries", "MessageGroupId");
    crate::mixed::assert_runs_share_requests("sqs fifo", &requests, 10);
    db.finish().await;
}

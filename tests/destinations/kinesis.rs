//! Harness of the `kinesis` destination: a stream of 4 shards per test on a moto server of
//! its own (see `aws.rs`), read back shard by shard with boto3 (`GetRecords` from
//! `TRIM_HORIZON`). A record carries no headers: its data is the message as one JSON object,
//! whose `headers`, `outbox_id`, `topic`, `key` and `attempt_no` are what arrived. The
//! refused message is bound for a stream that does not exist. Besides the conformance
//! scenarios: per-key order within a shard, and a mixed keyed/unkeyed drain whose
//! `PutRecords` calls (as the proxy saw them) carry a key's run.
//!
//! Where moto differs from Kinesis: it never throttles a shard (so the retryable per-record
//! `ProvisionedThroughputExceededException` is not exercised here), does not reshard, and
//! its own code is not safe for concurrent writes: two `PutRecords` calls at once can give
//! two records one sequence number, and the second overwrites the first (seen: 4,993 of
//! 5,000 records kept, every one acknowledged). `moto_server.py` serialises a shard's writes,
//! as Kinesis does, so the harness's relayer sends with the destination's default
//! concurrency.

use std::collections::{BTreeSet, HashMap};

use tokio_postgres::Client;
use uuid::Uuid;

use crate::aws::{Moto, REGION, arrived_envelope};
use crate::common::{TestDb, eventually, pending};
use crate::{
    Arrived, Freeze, Harness, InProcess, KillConnections, MINUTE, Outage, start_relayer,
    stop_relayer,
};

/// Not [`crate::UnsendableHeader`]: the headers travel inside the record's JSON.
pub struct Stream {
    moto: Moto,
    /// The destination's `runs_in_one_call`.
    runs_in_one_call: bool,
}

/// One record as boto3 read it.
#[derive(Debug, serde::Deserialize)]
struct Record {
    shard: String,
    key: String,
    data: String,
}

impl Stream {
    fn records(&self) -> Vec<Record> {
        self.moto.read(&["kinesis-read", "orders"])
    }
}

impl Harness for Stream {
    const DEDUPES: bool = false;

    async fn start(_db: &TestDb) -> Self {
        let moto = Moto::start().await;
        moto.run(&["kinesis-create", "orders", "4"]);
        Stream {
            moto,
            runs_in_one_call: false,
        }
    }

    fn table(&self) -> String {
        format!(
            "type = \"kinesis\"\nstream = \"{{topic}}\"\nregion = \"{REGION}\"\nendpoint_url = \"{}\"\nruns_in_one_call = {}\n",
            self.moto.endpoint(),
            self.runs_in_one_call
        )
    }

    async fn received(&self) -> Vec<Arrived> {
        self.records()
            .iter()
            .map(|r| arrived_envelope(&serde_json::from_str(&r.data).unwrap()))
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

impl KillConnections for Stream {
    async fn kill_connections(&mut self) {
        self.moto.proxy.kill_connections();
    }
}

impl Outage for Stream {
    async fn stop(&mut self) {
        self.moto.proxy.stop().await;
    }

    async fn restart(&mut self) {
        self.moto.proxy.listen().await;
    }
}

impl Freeze for Stream {
    async fn freeze(&mut self) {
        self.moto.proxy.freeze();
    }

    async fn thaw(&mut self) {
        self.moto.proxy.thaw();
    }
}

impl InProcess for Stream {}

/// A key's records sit in one shard, in enqueue order; the partition key is the message key,
/// or the outbox_id of an unkeyed message.
#[tokio::test(flavor = "multi_thread")]
async fn each_keys_records_are_in_order_in_one_shard() {
    const KEYS: i64 = 24;
    const PER_KEY: i64 = 25;
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = Stream::start(&db).await;
    c.execute(
        "SELECT outbox.enqueue('orders', jsonb_build_object('seq', s), 'key-' || (s % $1::bigint), '{}'::jsonb) \
         FROM generate_series(0, $2::bigint - 1) AS s",
        &[&KEYS, &(KEYS * PER_KEY)],
    )
    .await
    .unwrap();
    let unkeyed = crate::enqueue(&c, "orders", None, serde_json::json!({})).await;
    let w = start_relayer(&db, &h, "order", 10_000);
    eventually(MINUTE, "the outbox to drain", || async {
        pending(&c).await == 0
    })
    .await;
    stop_relayer(w).await;

    let mut shards: HashMap<String, String> = HashMap::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut seen: HashMap<String, BTreeSet<i64>> = HashMap::new();
    let mut unkeyed_key = None;
    for r in h.records() {
        let envelope: serde_json::Value = serde_json::from_str(&r.data).unwrap();
        if envelope["outbox_id"] == unkeyed.to_string() {
            unkeyed_key = Some(r.key.clone());
            continue;
        }
        assert_eq!(
            envelope["key"],
            r.key.as_str(),
            "the partition key is the message key"
        );
        let seq = envelope["payload"]["seq"].as_i64().unwrap();
        let shard = shards.entry(r.key.clone()).or_insert(r.shard.clone());
        assert_eq!(*shard, r.shard, "every record of {} in one shard", r.key);
        let previous = last.insert(r.key.clone(), seq).unwrap_or(-1);
        assert!(seq > previous, "{}: seq {seq} after {previous}", r.key);
        seen.entry(r.key).or_default().insert(seq);
    }
    assert_eq!(unkeyed_key, Some(unkeyed.to_string()));
    assert_eq!(seen.len(), usize::try_from(KEYS).unwrap());
    assert!(
        seen.values()
            .all(|s| s.len() == usize::try_from(PER_KEY).unwrap()),
        "every message of every key"
    );
    db.finish().await;
}

/// With `runs_in_one_call`, 10 % keyed traffic (ten keys among 2,000 messages) goes out in
/// `PutRecords` calls that carry a key's run: read back shard by shard, each key's records
/// are in enqueue order and every message is there, and the proxy sees calls of many
/// records, some with several records of one key.
#[tokio::test(flavor = "multi_thread")]
async fn mixed_keyed_traffic_goes_out_with_a_keys_run_in_one_call() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = Stream {
        runs_in_one_call: true,
        ..Stream::start(&db).await
    };
    crate::mixed::enqueue(&c, "orders").await;
    let w = start_relayer(&db, &h, "mixed", 10_000);
    crate::drained(&c).await;
    stop_relayer(w).await;

    let arrived: Vec<(Option<String>, i64)> = h
        .records()
        .iter()
        .map(|r| {
            let envelope: serde_json::Value = serde_json::from_str(&r.data).unwrap();
            let key = envelope["key"].as_str().map(str::to_owned);
            if let Some(key) = &key {
                assert_eq!(*key, r.key, "the partition key is the message key");
            }
            (key, envelope["payload"]["seq"].as_i64().unwrap())
        })
        .collect();
    crate::mixed::assert_arrived_in_key_order(&arrived);
    let requests = crate::mixed::requests_by_key(&h.moto.proxy.bodies(), "Records", "PartitionKey");
    crate::mixed::assert_runs_share_requests("kinesis", &requests, 500);
    db.finish().await;
}

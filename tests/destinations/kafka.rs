//! Harness of the `kafka` destination: a Kafka-protocol broker of the test's own (`tansu`,
//! in-memory storage) behind a proxy of the test's own, which the broker advertises as its
//! address, so every connection the relayer makes after bootstrapping goes through it too
//! and the test can cut, stop or freeze them, and count the requests they carried. Topics are created explicitly (tansu does not
//! create them on first use); what arrived is read back with Debian's `kcat`, never with
//! the destination's own code. Debian's kcat links librdkafka 2.0.2, which cannot read
//! tansu 0.6.0's ApiVersions v3 answer ("Read underflow" in its tagged fields): kcat runs
//! against the librdkafka 2.x shared library the build compiled for `rdkafka-sys`.
//!
//! Where tansu differs from Apache Kafka: it is weaker on transactions (the destination uses
//! none: the idempotent producer alone keeps a broker retry from writing twice); it keeps no
//! replicas, so `acks = all` is the leader's ack; and after records timed out during an
//! outage, it answers the producer's epoch bump (KIP-360) with `ProducerFenced`, where
//! Kafka accepts it. The destination replaces a fenced producer and hands its records to
//! the new one, so the outage scenario passes either way.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::process::Command;

use tokio_postgres::Client;
use uuid::Uuid;

use crate::common::{self, TestDb, eventually, pending};
use crate::proxy::Proxy;
use crate::server::Server;
use crate::{
    Arrived, Freeze, Harness, InProcess, KillConnections, MINUTE, Outage, drained, histories,
    start_relayer, start_relayer_with, stop_relayer,
};

/// The topic the conformance scenarios deliver to.
const TOPIC: &str = "orders";
const PARTITIONS: i32 = 3;

/// Not [`crate::UnsendableHeader`]: a Kafka record header carries any name and any bytes.
pub struct Tansu {
    port: u16,
    proxy: Proxy,
    _broker: Server,
}

/// One record as kcat read it.
#[derive(Debug, serde::Deserialize)]
pub(crate) struct Record {
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    pub(crate) key: Option<String>,
    /// None: a tombstone.
    pub(crate) payload: Option<String>,
    /// The record's timestamp, milliseconds since the epoch.
    pub(crate) ts: i64,
    /// Name, value, name, value, …
    #[serde(default)]
    pub(crate) headers: Vec<String>,
}

/// The tansu binary: `$TANSU`, or the one `make test` installs under `target/tools`, or one
/// in `~/.cargo/bin`, or `tansu` on the PATH.
fn tansu() -> OsString {
    if let Some(path) = std::env::var_os("TANSU") {
        return path;
    }
    let local = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/tools/bin/tansu");
    if local.exists() {
        return local.into();
    }
    let installed = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cargo")))
        .map(|home| home.join("bin/tansu"))
        .filter(|p| p.exists());
    installed.map_or_else(|| "tansu".into(), OsString::from)
}

/// Where the build put the librdkafka shared library it compiled (`rdkafka-sys`'s output).
fn librdkafka_dir() -> std::path::PathBuf {
    let target = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target directory")
        .to_owned();
    ["debug", "release"]
        .iter()
        .filter_map(|profile| std::fs::read_dir(target.join(profile).join("build")).ok())
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("out/src"))
        .find(|dir| dir.join("librdkafka.so.1").exists())
        .expect("librdkafka.so.1 under target/*/build/rdkafka-sys-*/out/src")
}

impl Tansu {
    /// The address the broker advertises: the proxy.
    pub(crate) fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.proxy.port)
    }

    pub(crate) fn create_topic(&self, name: &str, partitions: i32) {
        let out = Command::new(tansu())
            .args([
                "topic",
                "create",
                name,
                "--partitions",
                &partitions.to_string(),
            ])
            .args(["--broker", &format!("tcp://127.0.0.1:{}", self.port)])
            .output()
            .expect("run tansu topic create");
        assert!(
            out.status.success(),
            "tansu topic create {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The Produce requests (API key 0) the relayer sent through the proxy so far.
    pub(crate) fn produce_requests(&self) -> usize {
        self.proxy
            .bodies()
            .iter()
            .filter(|r| r.get(..2) == Some(&[0, 0][..]))
            .count()
    }

    /// Every record of `topic`, partition by partition in offset order, read with kcat.
    pub(crate) fn records(&self, topic: &str) -> Vec<Record> {
        let out = Command::new("kcat")
            .env("LD_LIBRARY_PATH", librdkafka_dir())
            .args([
                "-C",
                "-b",
                &self.brokers(),
                "-t",
                topic,
                "-o",
                "beginning",
                "-e",
            ])
            .args(["-J", "-q"])
            .output()
            .expect("kcat must be installed (apt-get install kcat)");
        assert!(
            out.status.success(),
            "kcat -C {topic}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut records: Vec<Record> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
            .collect();
        records.sort_by_key(|r| (r.partition, r.offset));
        records
    }
}

impl Record {
    pub(crate) fn headers(&self) -> BTreeMap<String, String> {
        // A later header of the same name wins, as a consumer's lastHeader() would see it.
        self.headers
            .chunks(2)
            .map(|pair| (pair[0].clone(), pair.get(1).cloned().unwrap_or_default()))
            .collect()
    }
}

impl Harness for Tansu {
    const DEDUPES: bool = false;

    async fn start(db: &TestDb) -> Self {
        let dir = db.scratch_dir().join("tansu");
        std::fs::create_dir_all(&dir).unwrap();
        let port = common::free_port();
        let proxy = Proxy::recording_kafka(&format!("127.0.0.1:{port}")).await;
        let args = [
            "broker",
            "--storage-engine",
            "memory://tansu/",
            "--listener-url",
            &format!("tcp://127.0.0.1:{port}"),
            "--advertised-listener-url",
            &format!("tcp://127.0.0.1:{}", proxy.port),
        ]
        .map(OsString::from)
        .into();
        // From an empty directory: tansu reads a `.env` file from where it runs.
        let broker = Server::start_in(tansu(), args, port, Some(dir)).await;
        let h = Tansu {
            port,
            proxy,
            _broker: broker,
        };
        h.create_topic(TOPIC, PARTITIONS);
        h
    }

    fn table(&self) -> String {
        format!("type = \"kafka\"\nbrokers = \"{}\"\n", self.brokers())
    }

    async fn received(&self) -> Vec<Arrived> {
        self.records(TOPIC)
            .iter()
            .map(|r| {
                let headers = r.headers();
                Arrived {
                    id: headers["outbox-id"].parse().unwrap(),
                    headers,
                }
            })
            .collect()
    }

    async fn refused_message(&self, c: &Client) -> (Uuid, &'static str) {
        // No such topic, and the broker creates none on first use.
        (
            crate::enqueue(
                c,
                "nobody",
                None,
                serde_json::json!({ "secret": crate::REFUSED_PAYLOAD_MARK }),
            )
            .await,
            "nknown topic",
        )
    }
}

impl KillConnections for Tansu {
    async fn kill_connections(&mut self) {
        self.proxy.kill_connections();
    }
}

impl Outage for Tansu {
    async fn stop(&mut self) {
        self.proxy.stop().await;
    }

    async fn restart(&mut self) {
        self.proxy.listen().await;
    }
}

impl Freeze for Tansu {
    async fn freeze(&mut self) {
        self.proxy.freeze();
    }

    async fn thaw(&mut self) {
        self.proxy.thaw();
    }
}

/// Messages of one key reach one partition in enqueue order, also when the broker goes
/// away between two parts of the run and the keys' heads are retried: read back with kcat, each key's records sit
/// in one partition with their sequence numbers never going down (a retried head may
/// appear twice, never after its successor).
#[tokio::test(flavor = "multi_thread")]
async fn per_key_order_holds_per_partition_across_a_retry_of_the_head() {
    per_key_order_across_a_retry("").await;
}

/// The same with `runs_in_one_call`: a key's run is produced in one call, and the
/// idempotent producer keeps it in order through the outage and the retries.
#[tokio::test(flavor = "multi_thread")]
async fn with_runs_in_one_call_per_key_order_holds_per_partition_across_a_retry() {
    per_key_order_across_a_retry("runs_in_one_call = true\n").await;
}

/// A key's run of 40 is produced at once with `runs_in_one_call`: its records reach the
/// broker in a few Produce requests, where one message of a key per call (the default)
/// takes a request each, since each waits for its predecessor's report. Both drains are
/// counted through the proxy, and read back with kcat in enqueue order.
#[tokio::test(flavor = "multi_thread")]
async fn with_runs_in_one_call_a_keys_run_goes_in_a_few_produce_requests() {
    const RUN: i64 = 40;
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = Tansu::start(&db).await;
    let mut requests = Vec::new();
    for (round, settings) in ["", "runs_in_one_call = true\n"].into_iter().enumerate() {
        // The whole run is pending before the relayer starts: its first claim holds it.
        c.execute(
            "SELECT outbox.enqueue('orders', jsonb_build_object('seq', $1::bigint * 1000 + s), 'run', '{}'::jsonb) \
             FROM generate_series(0, $2::bigint - 1) AS s",
            &[&i64::try_from(round).unwrap(), &RUN],
        )
        .await
        .unwrap();
        let before = h.produce_requests();
        let w = start_relayer_with(&db, &h, &format!("run{round}"), 10_000, settings);
        drained(&c).await;
        stop_relayer(w).await;
        requests.push(h.produce_requests() - before);
    }
    let (waves, runs) = (requests[0], requests[1]);
    assert!(
        waves >= usize::try_from(RUN).unwrap(),
        "one message of a key per call: a Produce request each, {waves} for {RUN}"
    );
    assert!(
        runs <= usize::try_from(RUN / 4).unwrap(),
        "runs_in_one_call: the run in a few Produce requests, {runs} for {RUN} (one message \
         of a key per call took {waves})"
    );
    let seqs: Vec<i64> = h
        .records(TOPIC)
        .iter()
        .map(|r| {
            serde_json::from_str::<serde_json::Value>(r.payload.as_deref().unwrap()).unwrap()["seq"]
                .as_i64()
                .unwrap()
        })
        .collect();
    let expected: Vec<i64> = (0..RUN).chain(1000..1000 + RUN).collect();
    assert_eq!(seqs, expected, "both runs, once each, in enqueue order");
    eprintln!("a run of {RUN}: {waves} Produce requests one message per call, {runs} in one call");
    db.finish().await;
}

/// 24 keys of 40 messages, a third delivered before the broker goes away and the rest
/// enqueued meanwhile; the relayer's destination has `settings` besides the harness's.
async fn per_key_order_across_a_retry(settings: &str) {
    const KEYS: i64 = 24;
    const PER_KEY: i64 = 40;
    let db = TestDb::new().await;
    let c = db.client().await;
    let mut h = Tansu::start(&db).await;
    // A third is enqueued and delivered first, the rest while the broker is away, so the
    // keys' heads at that moment are certain to meet the outage (a relayer that took all
    // of it in one go would leave nothing to retry).
    let enqueue = |from: i64, to: i64| {
        let c = &c;
        async move {
            c.execute(
                "SELECT outbox.enqueue('orders', jsonb_build_object('seq', s), 'key-' || (s % $1::bigint), '{}'::jsonb) \
                 FROM generate_series($2::bigint, $3::bigint - 1) AS s",
                &[&KEYS, &from, &to],
            )
            .await
            .unwrap();
        }
    };
    enqueue(0, KEYS * PER_KEY / 3).await;
    let w = start_relayer_with(&db, &h, "order", 2_000, settings);
    eventually(MINUTE, "the first third delivered", || async {
        pending(&c).await == 0
    })
    .await;
    h.stop().await;
    enqueue(KEYS * PER_KEY / 3, KEYS * PER_KEY).await;
    eventually(MINUTE, "a head retried", || async {
        common::count(
            &c,
            "SELECT count(*) FROM outbox.attempts WHERE state = 'RETRYABLE'",
        )
        .await
            > 0
    })
    .await;
    h.restart().await;
    eventually(MINUTE, "the outbox to drain", || async {
        pending(&c).await == 0
    })
    .await;
    stop_relayer(w).await;

    let retried_then_delivered = histories(&c)
        .await
        .values()
        .filter(|h| h.contains("RETRYABLE") && h.ends_with("DISPATCHED"))
        .count();
    assert!(
        retried_then_delivered > 0,
        "some head was retried, then delivered"
    );

    let mut partitions: HashMap<String, i32> = HashMap::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut seen: HashMap<String, std::collections::BTreeSet<i64>> = HashMap::new();
    for r in h.records(TOPIC) {
        let key = r.key.clone().expect("a keyed record");
        let seq = serde_json::from_str::<serde_json::Value>(r.payload.as_deref().unwrap()).unwrap()
            ["seq"]
            .as_i64()
            .unwrap();
        let partition = *partitions.entry(key.clone()).or_insert(r.partition);
        assert_eq!(
            partition, r.partition,
            "every record of {key} in one partition"
        );
        let previous = last.insert(key.clone(), seq).unwrap_or(-1);
        assert!(
            seq >= previous,
            "{key}: seq {seq} at offset {} after {previous}",
            r.offset
        );
        seen.entry(key).or_default().insert(seq);
    }
    assert_eq!(seen.len(), usize::try_from(KEYS).unwrap());
    for (key, seqs) in seen {
        assert_eq!(
            seqs.len(),
            usize::try_from(PER_KEY).unwrap(),
            "every message of {key}"
        );
    }
    db.finish().await;
}

/// An unkeyed message is keyed by its outbox_id; a keyed one by its key.
#[tokio::test(flavor = "multi_thread")]
async fn the_record_key_is_the_message_key_or_else_the_outbox_id() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = Tansu::start(&db).await;
    let keyed = crate::enqueue(&c, TOPIC, Some("customer-9"), serde_json::json!({})).await;
    let unkeyed = crate::enqueue(&c, TOPIC, None, serde_json::json!({})).await;
    let w = start_relayer(&db, &h, "keys", 10_000);
    eventually(MINUTE, "the outbox to drain", || async {
        pending(&c).await == 0
    })
    .await;
    stop_relayer(w).await;
    let keys: HashMap<Uuid, Option<String>> = h
        .records(TOPIC)
        .into_iter()
        .map(|r| (r.headers()["outbox-id"].parse().unwrap(), r.key))
        .collect();
    assert_eq!(keys[&keyed].as_deref(), Some("customer-9"));
    assert_eq!(keys[&unkeyed], Some(unkeyed.to_string()));
    db.finish().await;
}

impl InProcess for Tansu {}

/// The CloudEvents envelope over Kafka: binary mode puts each attribute in its `ce_` header
/// (the content type in `content-type`, the value untouched); structured mode writes the
/// JSON event format as the value, with `content-type: application/cloudevents+json`.
#[tokio::test(flavor = "multi_thread")]
async fn the_cloudevents_envelope_maps_every_attribute_in_both_modes() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = Tansu::start(&db).await;
    h.create_topic("binary", 1);
    h.create_topic("structured", 1);
    let binary = crate::enqueue(&c, "binary", Some("order-7"), serde_json::json!({})).await;
    let structured = crate::enqueue(&c, "structured", None, serde_json::json!({})).await;
    let binary_time = crate::http::enqueue_time(&c, binary).await;
    let structured_time = crate::http::enqueue_time(&c, structured).await;
    let brokers = h.brokers();
    let path = db.scratch_dir().join("cloudevents.toml");
    std::fs::write(
        &path,
        format!(
            "[destinations.binary]\ntype = \"kafka\"\nbrokers = \"{brokers}\"\n\
             envelope = \"cloudevents\"\ncloudevents_source = \"/shop\"\n\n\
             [destinations.structured]\ntype = \"kafka\"\nbrokers = \"{brokers}\"\n\
             envelope = \"cloudevents\"\ncloudevents_mode = \"structured\"\n\
             cloudevents_type = \"com.example.{{topic}}\"\n\n\
             [[routes]]\ntopic = \"binary\"\ndestination = \"binary\"\n\n\
             [[routes]]\ntopic = \"structured\"\ndestination = \"structured\"\n"
        ),
    )
    .unwrap();
    let path = path.display().to_string();
    let mut w = common::Relayer::start(&db, "cloudevents", &["--config", &path, "--no-telemetry"]);
    eventually(MINUTE, "the outbox to drain", || async {
        pending(&c).await == 0
    })
    .await;
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));

    let records = h.records("binary");
    assert_eq!(records.len(), 1);
    let headers = records[0].headers();
    let expected = [
        ("ce_specversion", "1.0".to_owned()),
        ("ce_id", binary.to_string()),
        ("ce_source", "/shop".to_owned()),
        ("ce_type", "binary".to_owned()),
        ("ce_time", binary_time),
        ("ce_partitionkey", "order-7".to_owned()),
        ("content-type", "application/json".to_owned()),
    ];
    for (name, value) in expected {
        assert_eq!(headers.get(name), Some(&value), "{name} in {headers:?}");
    }
    assert!(
        !headers.contains_key("ce_datacontenttype"),
        "content-type carries it"
    );
    let value: serde_json::Value =
        serde_json::from_str(records[0].payload.as_deref().unwrap()).unwrap();
    assert_eq!(
        value,
        serde_json::json!({"hello": "world"}),
        "the value as enqueued"
    );

    let records = h.records("structured");
    assert_eq!(records.len(), 1);
    let headers = records[0].headers();
    assert_eq!(
        headers["content-type"],
        "application/cloudevents+json; charset=UTF-8"
    );
    assert!(headers.keys().all(|n| !n.starts_with("ce_")), "{headers:?}");
    let event: serde_json::Value =
        serde_json::from_str(records[0].payload.as_deref().unwrap()).unwrap();
    assert_eq!(
        event,
        serde_json::json!({
            "specversion": "1.0",
            "id": structured.to_string(),
            "source": "/outbox-relay",
            "type": "com.example.structured",
            "time": structured_time,
            "datacontenttype": "application/json",
        "data": {"hello": "world"},
        })
    );
    db.finish().await;
}

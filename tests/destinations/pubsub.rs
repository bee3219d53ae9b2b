//! Harness of the `pubsub` destination: a Google Cloud Pub/Sub emulator of the test's own
//! (the Google Cloud CLI's `cloud-pubsub-emulator`, Java 17) behind a proxy of the test's
//! own, so that the test can cut, stop or freeze the relayer's connections to it (and see
//! what each publish request carried). The
//! emulator is the program `gcloud beta emulators pubsub start` runs; the harness runs it
//! directly, so that the process it stops is the emulator itself (not gcloud's Python
//! wrapper) and it answers within about two seconds. The topic and a pull subscription
//! with message ordering are created, and what arrived is read back, through the
//! emulator's REST API by `tests/support/pubsub-client.py` (Python's standard library),
//! never with the destination's own code.
//!
//! Where the emulator differs from the service: it keeps everything in memory; it enforces
//! none of Pub/Sub's size limits (it took an 11 MB message; the destination checks them
//! itself, so the tests of them do not depend on the emulator); and it needs no
//! credentials. On ordering it shows what the service documents: an ordering-enabled
//! subscription hands out a key's messages in publish order (its message ids grow in
//! publish order), which the per-key order test below reads back.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::process::Command;
use std::sync::Mutex;

use tokio_postgres::Client;
use uuid::Uuid;

use crate::common::{self, TestDb, eventually, pending};
use crate::proxy::Proxy;
use crate::server::Server;
use crate::{
    Arrived, Freeze, Harness, InProcess, KillConnections, MINUTE, Outage, UnsendableHeader,
    histories, start_relayer, stop_relayer,
};

const PROJECT: &str = "outbox-test";
/// The topic the conformance scenarios deliver to, and the subscription reading it.
const TOPIC: &str = "orders";
const SUBSCRIPTION: &str = "orders-all";

/// Where the Google Cloud CLI's Debian package (google-cloud-cli-pubsub-emulator) puts the
/// emulator.
const EMULATOR: &str =
    "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator";

/// The emulator: `$PUBSUB_EMULATOR_BIN`, or the Debian package's.
fn emulator() -> OsString {
    let path = std::env::var_os("PUBSUB_EMULATOR_BIN").unwrap_or_else(|| EMULATOR.into());
    assert!(
        std::path::Path::new(&path).exists(),
        "the Google Cloud Pub/Sub emulator is not installed ({} is missing): apt-get install \
         google-cloud-cli-pubsub-emulator openjdk-17-jre-headless (Google Cloud's apt \
         repository), or gcloud components install pubsub-emulator and set PUBSUB_EMULATOR_BIN",
        path.display()
    );
    path
}

/// One message as the subscription handed it out.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Pulled {
    message_id: String,
    ordering_key: String,
    attributes: BTreeMap<String, String>,
    data: String,
}

pub struct Emulator {
    port: u16,
    proxy: Proxy,
    _server: Server,
    /// Everything pulled so far (pulling acknowledges, so it is kept here).
    pulled: Mutex<Vec<Pulled>>,
}

impl Emulator {
    fn client(&self, args: &[&str]) -> String {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/support/pubsub-client.py"
        );
        let out = Command::new("python3")
            .arg(script)
            .arg(format!("127.0.0.1:{}", self.port))
            .arg(PROJECT)
            .args(args)
            .output()
            .expect("python3 must be installed");
        assert!(
            out.status.success(),
            "pubsub-client.py {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Everything the subscription has handed out, in the order it did.
    fn pull(&self) -> Vec<Pulled> {
        let new: Vec<Pulled> = self
            .client(&["pull", SUBSCRIPTION])
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
            .collect();
        let mut pulled = self.pulled.lock().unwrap();
        pulled.extend(new);
        pulled.clone()
    }
}

impl Harness for Emulator {
    const DEDUPES: bool = false;
    const TRACEPARENT_ALSO_IN: &'static [&'static str] = &["googclient_traceparent"];

    async fn start(_db: &TestDb) -> Self {
        let port = common::free_port();
        let proxy = Proxy::recording(&format!("127.0.0.1:{port}")).await;
        let args = ["--host=127.0.0.1".to_owned(), format!("--port={port}")]
            .map(OsString::from)
            .into();
        let server = Server::start_in(emulator(), args, port, None).await;
        let h = Emulator {
            port,
            proxy,
            _server: server,
            pulled: Mutex::default(),
        };
        h.client(&["setup", TOPIC, SUBSCRIPTION]);
        h
    }

    fn table(&self) -> String {
        format!(
            "type = \"pubsub\"\nproject = \"{PROJECT}\"\nemulator_host = \"127.0.0.1:{}\"\n",
            self.proxy.port
        )
    }

    async fn received(&self) -> Vec<Arrived> {
        self.pull()
            .into_iter()
            .map(|m| Arrived {
                id: m.attributes["outbox-id"].parse().unwrap(),
                headers: m.attributes,
            })
            .collect()
    }

    async fn refused_message(&self, c: &Client) -> (Uuid, &'static str) {
        // No such topic: the emulator answers NOT_FOUND, for that topic's request alone.
        (
            crate::enqueue(
                c,
                "nobody",
                None,
                serde_json::json!({ "secret": crate::REFUSED_PAYLOAD_MARK }),
            )
            .await,
            "NOT_FOUND",
        )
    }
}

impl UnsendableHeader for Emulator {
    fn unsendable_header(&self) -> (String, String) {
        // Attribute names starting with "goog" are reserved.
        ("goog-trace".into(), "x".into())
    }
}

impl KillConnections for Emulator {
    async fn kill_connections(&mut self) {
        self.proxy.kill_connections();
    }
}

impl Outage for Emulator {
    async fn stop(&mut self) {
        self.proxy.stop().await;
    }

    async fn restart(&mut self) {
        self.proxy.listen().await;
    }
}

impl Freeze for Emulator {
    async fn freeze(&mut self) {
        self.proxy.freeze();
    }

    async fn thaw(&mut self) {
        self.proxy.thaw();
    }
}

impl InProcess for Emulator {}

/// Messages of one key arrive in enqueue order, each with the key as its ordering key, also
/// when the emulator goes away between two parts of the run and the keys' heads are
/// retried: read back from the ordering-enabled subscription, each key's sequence numbers
/// never go down (a retried head may appear twice, never after its successor), and the
/// emulator's message ids, given in publish order, grow with them.
#[tokio::test(flavor = "multi_thread")]
async fn per_key_order_holds_with_ordering_keys_across_a_retry_of_the_head() {
    const KEYS: i64 = 24;
    const PER_KEY: i64 = 40;
    let db = TestDb::new().await;
    let c = db.client().await;
    let mut h = Emulator::start(&db).await;
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
    let w = start_relayer(&db, &h, "order", 2_000);
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

    let mut last: HashMap<String, (i64, u64)> = HashMap::new();
    let mut seen: HashMap<String, std::collections::BTreeSet<i64>> = HashMap::new();
    for m in h.pull() {
        let key = m.attributes["outbox-key"].clone();
        assert_eq!(m.ordering_key, key, "the message key is the ordering key");
        let seq = serde_json::from_str::<serde_json::Value>(&m.data).unwrap()["seq"]
            .as_i64()
            .unwrap();
        let id: u64 = m.message_id.parse().expect("the emulator's numeric ids");
        let (previous, previous_id) = last.insert(key.clone(), (seq, id)).unwrap_or((-1, 0));
        assert!(
            seq >= previous && id > previous_id,
            "{key}: seq {seq} (id {id}) after {previous} (id {previous_id})"
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

/// A message over Pub/Sub's 10 MB is dead-lettered with the limit in its reason, without
/// being sent; the messages of its batch arrive (the emulator would have taken it: the
/// destination enforces the service's limit itself).
#[tokio::test(flavor = "multi_thread")]
async fn a_message_over_ten_megabytes_is_dead_lettered_alone() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = Emulator::start(&db).await;
    let big: Uuid = c
        .query_one(
            "SELECT outbox.enqueue('orders', convert_to(repeat('x', 10000001), 'UTF8'))",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let others: std::collections::HashSet<Uuid> = common::fill(&c, TOPIC, 20, None)
        .await
        .into_iter()
        .collect();
    let w = start_relayer(&db, &h, "big", 10_000);
    eventually(MINUTE, "the outbox to drain", || async {
        pending(&c).await == 0
    })
    .await;
    stop_relayer(w).await;
    let dead = common::dead_letters(&c).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, big);
    assert!(dead[0].1.contains("at most 10000000"), "{dead:?}");
    let got: std::collections::HashSet<Uuid> = h.received().await.iter().map(|a| a.id).collect();
    assert_eq!(got, others);
    db.finish().await;
}

/// Without `emulator_host`, `PUBSUB_EMULATOR_HOST` sends the relayer to the emulator,
/// without credentials.
#[tokio::test(flavor = "multi_thread")]
async fn pubsub_emulator_host_points_the_relayer_at_the_emulator() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = Emulator::start(&db).await;
    let ids: std::collections::HashSet<Uuid> =
        common::fill(&c, TOPIC, 5, None).await.into_iter().collect();
    let config = db.scratch_dir().join("env.toml");
    std::fs::write(
        &config,
        format!(
            "[destinations.d]\ntype = \"pubsub\"\nproject = \"{PROJECT}\"\n\n[[routes]]\ntopic = \"*\"\ndestination = \"d\"\n"
        ),
    )
    .unwrap();
    let log = db.scratch_dir().join("env.log");
    let mut relayer = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["run", "--worker-id", "env", "--poll-interval-ms", "100"])
        .args([
            "--telemetry-addr",
            &format!("127.0.0.1:{}", common::free_port()),
        ])
        .arg("--config")
        .arg(&config)
        .env("DATABASE_URL", &db.url)
        .env("PUBSUB_EMULATOR_HOST", format!("127.0.0.1:{}", h.port))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn outbox-relay");
    eventually(MINUTE, "the outbox to drain", || async {
        pending(&c).await == 0
    })
    .await;
    assert!(
        Command::new("kill")
            .args(["-TERM", &relayer.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    assert!(
        relayer.wait().unwrap().success(),
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    let got: std::collections::HashSet<Uuid> = h.received().await.iter().map(|a| a.id).collect();
    assert_eq!(got, ids);
    db.finish().await;
}

/// 10 % keyed traffic (ten keys among 2,000 messages) goes out in publish requests that carry
/// a key's run: each key's messages arrive in enqueue order at the ordering-enabled
/// subscription, every message is there, and the proxy sees requests of many messages,
/// some with several messages of one key.
#[tokio::test(flavor = "multi_thread")]
async fn mixed_keyed_traffic_goes_out_with_a_keys_run_in_one_request() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = Emulator::start(&db).await;
    crate::mixed::enqueue(&c, TOPIC).await;
    let w = start_relayer(&db, &h, "mixed", 10_000);
    crate::drained(&c).await;
    stop_relayer(w).await;

    let arrived: Vec<(Option<String>, i64)> = h
        .pull()
        .into_iter()
        .map(|m| {
            let key = m.attributes.get("outbox-key").cloned();
            assert_eq!(key.clone().unwrap_or_default(), m.ordering_key);
            let seq = serde_json::from_str::<serde_json::Value>(&m.data).unwrap()["seq"]
                .as_i64()
                .unwrap();
            (key, seq)
        })
        .collect();
    crate::mixed::assert_arrived_in_key_order(&arrived);
    let requests: Vec<Vec<Option<String>>> = h
        .proxy
        .bodies()
        .iter()
        .map(|body| {
            let body: serde_json::Value = serde_json::from_slice(body).unwrap();
            body["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["orderingKey"].as_str().map(str::to_owned))
                .collect()
        })
        .collect();
    crate::mixed::assert_runs_share_requests("pubsub", &requests, 1000);
    db.finish().await;
}

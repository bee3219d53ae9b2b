//! Harness of the `mqtt` destination: a Mosquitto of the test's own (an ACL that lets
//! anonymous clients use `outbox/orders` and nothing else, so the broker refuses a publish
//! to any other topic with an MQTT 5 PUBACK of reason "not authorized"), the relayer in
//! front of it through a proxy (killed, stopped and frozen without touching the broker), and
//! `mosquitto_sub` subscribed to `outbox/orders` at QoS 1 from the start, writing what
//! arrives as JSON lines (its user properties among them). What arrived is read once a
//! marker published after everything else has come through: Mosquitto forwards the
//! messages of one topic to a subscriber in the order it accepted them.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio_postgres::Client;
use uuid::Uuid;

use crate::common::{self, TestDb};
use crate::proxy::Proxy;
use crate::server::Server;
use crate::{
    Arrived, Freeze, Harness, InProcess, KillConnections, MINUTE, Outage, UnsendableHeader,
};

pub struct Broker {
    port: u16,
    proxy: Proxy,
    output: PathBuf,
    subscriber: Child,
    _server: Server,
}

impl Broker {
    /// Publishes a marker on `outbox/orders` straight to the broker and waits until the
    /// subscriber has written it; again every 2 s, since a marker published before the
    /// subscriber's subscription took effect is gone (a broker keeps nothing unsubscribed).
    async fn through(&self) {
        let deadline = std::time::Instant::now() + MINUTE;
        loop {
            let marker = format!("marker-{}", Uuid::new_v4());
            let published = Command::new("mosquitto_pub")
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args([
                    "-V",
                    "mqttv5",
                    "-q",
                    "1",
                    "-t",
                    "outbox/orders",
                    "-m",
                    &marker,
                ])
                .status()
                .expect("mosquitto_pub must be installed (mosquitto-clients)");
            assert!(published.success());
            let tried = std::time::Instant::now();
            while tried.elapsed() < Duration::from_secs(2) {
                if std::fs::read_to_string(&self.output).is_ok_and(|text| text.contains(&marker)) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the subscriber received no marker within {MINUTE:?}"
            );
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.subscriber.kill();
        let _ = self.subscriber.wait();
    }
}

impl Harness for Broker {
    const DEDUPES: bool = false;

    async fn start(db: &TestDb) -> Self {
        let port = common::free_port();
        let dir = db.scratch_dir();
        let acl = dir.join("mosquitto.acl");
        std::fs::write(&acl, "topic readwrite outbox/orders\n").unwrap();
        let conf = dir.join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "listener {port} 127.0.0.1\nallow_anonymous true\nacl_file {}\n\
                 max_queued_messages 0\npersistence false\n",
                acl.display()
            ),
        )
        .unwrap();
        let server = Server::start(
            "/usr/sbin/mosquitto",
            vec![OsString::from("-c"), conf.into_os_string()],
            port,
        )
        .await;
        let output = dir.join("mqtt-arrived.jsonl");
        let subscriber = Command::new("mosquitto_sub")
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args(["-V", "mqttv5", "-q", "1", "-t", "outbox/orders", "-F", "%j"])
            .stdout(std::fs::File::create(&output).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .expect("mosquitto_sub must be installed (mosquitto-clients)");
        let h = Broker {
            port,
            proxy: Proxy::start(&format!("127.0.0.1:{port}")).await,
            output,
            subscriber,
            _server: server,
        };
        // Subscribed before anything is relayed.
        h.through().await;
        h
    }

    fn table(&self) -> String {
        format!(
            "type = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{}\"\ntopic = \"outbox/{{topic}}\"\n",
            self.proxy.port
        )
    }

    async fn received(&self) -> Vec<Arrived> {
        self.through().await;
        let text = std::fs::read_to_string(&self.output).unwrap();
        text.lines()
            .filter_map(|line| {
                let json: serde_json::Value = serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("mosquitto_sub wrote {line:?}: {e}"));
                let properties = json["properties"]["user-properties"].as_object()?;
                let headers: BTreeMap<String, String> = properties
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                    .collect();
                Some(Arrived {
                    id: headers["outbox-id"].parse().unwrap(),
                    headers,
                })
            })
            .collect()
    }

    /// A topic with a wildcard, which MQTT forbids in a publish: refused before it is sent.
    /// (A topic Mosquitto's ACL denies is refused by the broker, but Mosquitto 2.0.11 then
    /// closes the connection, which makes the messages in flight beside it retryable; that
    /// case has a test of its own below.)
    async fn refused_message(&self, c: &Client) -> (Uuid, &'static str) {
        let id = crate::enqueue(
            c,
            "orders/+",
            None,
            serde_json::json!({ "secret": crate::REFUSED_PAYLOAD_MARK }),
        )
        .await;
        (id, "wildcard")
    }
}

impl UnsendableHeader for Broker {
    fn unsendable_header(&self) -> (String, String) {
        // An MQTT string is at most 65,535 bytes.
        ("x-oversized".into(), "v".repeat(70_000))
    }
}

impl KillConnections for Broker {
    async fn kill_connections(&mut self) {
        self.proxy.kill_connections();
    }
}

impl Outage for Broker {
    async fn stop(&mut self) {
        self.proxy.stop().await;
    }

    async fn restart(&mut self) {
        self.proxy.listen().await;
    }
}

impl Freeze for Broker {
    async fn freeze(&mut self) {
        self.proxy.freeze();
    }

    async fn thaw(&mut self) {
        self.proxy.thaw();
    }
}

impl InProcess for Broker {}

/// A publish the broker refuses (Mosquitto's ACL denies the topic: MQTT 5 PUBACK 0x87) is
/// dead-lettered with the broker's reason; the rest arrive. Mosquitto 2.0.11 closes the
/// connection after such a refusal, so the messages in flight beside it (and, when the close
/// is read before the PUBACK, the refused one) may take a second attempt on a new
/// connection.
#[tokio::test(flavor = "multi_thread")]
async fn a_publish_the_broker_denies_is_dead_lettered_with_its_reason() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = Broker::start(&db).await;
    let denied = crate::enqueue(&c, "forbidden", None, serde_json::json!({})).await;
    let ids: std::collections::HashSet<Uuid> = common::fill(&c, "orders", 50, None)
        .await
        .into_iter()
        .collect();
    let w = crate::start_relayer(&db, &h, "denied", 10_000);
    crate::drained(&c).await;
    crate::stop_relayer(w).await;
    let dead = common::dead_letters(&c).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, denied);
    assert!(dead[0].1.contains("NotAuthorized"), "{dead:?}");
    // The PUBACK and the close arrive together; the client may report the close first,
    // which makes that attempt retryable and the next one meets the same refusal.
    let history = &crate::histories(&c).await[&denied];
    assert!(
        history == "1:FAILED" || history == "1:RETRYABLE 2:FAILED",
        "refused for good by the broker: {history}"
    );
    let got: std::collections::HashSet<Uuid> = h.received().await.iter().map(|a| a.id).collect();
    assert_eq!(got, ids);
    db.finish().await;
}

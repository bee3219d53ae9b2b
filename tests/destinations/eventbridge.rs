//! Harness of the `eventbridge` destination: an event bus per test on a moto server of its
//! own (see `aws.rs`), with a rule sending every event to a CloudWatch Logs group, read back
//! from that group with boto3 (not through an SQS queue: moto's queues slow down as they
//! grow, see `aws.rs`). The event's `detail` is the message as one JSON object, whose
//! `headers`, `outbox_id`, `topic`, `key` and `attempt_no` are what arrived; `source` and
//! `detail-type` come from the table's templates. The refused message is one whose content
//! type says JSON and whose payload does not parse: an event's detail must be a JSON object
//! (EventBridge answers `MalformedDetail`; the destination refuses it before sending).
//!
//! Where moto differs from EventBridge: it delivers to the rule's target inside the
//! `PutEvents` call (EventBridge moments later, retrying by the target's policy), and it
//! does not check the 256 KiB limit of a call.

use tokio_postgres::Client;
use uuid::Uuid;

use crate::aws::{Moto, REGION, arrived_envelope};
use crate::common::{TestDb, eventually, pending};
use crate::{
    Arrived, Freeze, Harness, InProcess, KillConnections, MINUTE, Outage, start_relayer,
    stop_relayer,
};

/// Not [`crate::UnsendableHeader`]: the headers travel inside the event's detail.
pub struct Bus {
    moto: Moto,
}

const BUS: &str = "orders-bus";

impl Bus {
    fn events(&self) -> Vec<serde_json::Value> {
        self.moto
            .read::<serde_json::Value>(&["events-read", BUS])
            .into_iter()
            .map(|e| e["event"].clone())
            .collect()
    }
}

impl Harness for Bus {
    const DEDUPES: bool = false;

    async fn start(_db: &TestDb) -> Self {
        let moto = Moto::start().await;
        moto.run(&["events-create", BUS]);
        Bus { moto }
    }

    fn table(&self) -> String {
        format!(
            "type = \"eventbridge\"\nevent_bus = \"{BUS}\"\nsource = \"shop.{{topic}}\"\nregion = \"{REGION}\"\nendpoint_url = \"{}\"\n",
            self.moto.endpoint()
        )
    }

    async fn received(&self) -> Vec<Arrived> {
        self.events()
            .iter()
            .filter(|e| e["detail"]["topic"] == "orders")
            .map(|e| arrived_envelope(&e["detail"]))
            .collect()
    }

    async fn refused_message(&self, c: &Client) -> (Uuid, &'static str) {
        let payload = format!("{{\"secret\": \"{}\", ", crate::REFUSED_PAYLOAD_MARK).into_bytes();
        let id = c
            .query_one(
                "SELECT outbox.enqueue('orders', $1::bytea, p_content_type => 'application/json')",
                &[&payload],
            )
            .await
            .unwrap()
            .get(0);
        (id, "not valid JSON")
    }
}

impl KillConnections for Bus {
    async fn kill_connections(&mut self) {
        self.moto.proxy.kill_connections();
    }
}

impl Outage for Bus {
    async fn stop(&mut self) {
        self.moto.proxy.stop().await;
    }

    async fn restart(&mut self) {
        self.moto.proxy.listen().await;
    }
}

impl Freeze for Bus {
    async fn freeze(&mut self) {
        self.moto.proxy.freeze();
    }

    async fn thaw(&mut self) {
        self.moto.proxy.thaw();
    }
}

impl InProcess for Bus {}

/// The event's `source` and `detail-type` come from the templates, its `time` is the
/// enqueue time, and its detail carries the payload as JSON.
#[tokio::test(flavor = "multi_thread")]
async fn an_event_has_the_templates_source_and_detail_type_and_the_payload_in_its_detail() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let h = Bus::start(&db).await;
    let id = crate::enqueue(&c, "orders", Some("o-1"), serde_json::json!({})).await;
    let w = start_relayer(&db, &h, "event", 10_000);
    eventually(MINUTE, "the outbox to drain", || async {
        pending(&c).await == 0
    })
    .await;
    stop_relayer(w).await;
    let events = h.events();
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    assert_eq!(e["source"], "shop.orders");
    assert_eq!(e["detail-type"], "orders");
    assert_eq!(e["detail"]["outbox_id"], id.to_string());
    assert_eq!(e["detail"]["key"], "o-1");
    assert_eq!(
        e["detail"]["payload"],
        serde_json::json!({"hello": "world"})
    );
    db.finish().await;
}

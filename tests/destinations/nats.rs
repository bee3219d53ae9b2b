//! Harness of the `nats` destination: a nats-server with JetStream of the test's own (file
//! storage, so a restart keeps what it stored), a stream capturing `<prefix>.orders` with a
//! two-minute duplicate window, read back message by message with a plain client.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::time::Duration;

use tokio_postgres::Client;
use uuid::Uuid;

use crate::common::{self, TestDb};
use crate::server::Server;
use crate::{Arrived, Freeze, Harness, InProcess, KillConnections, Outage, UnsendableHeader};

pub struct JetStream {
    port: u16,
    prefix: String,
    server: Server,
}

impl JetStream {
    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Harness for JetStream {
    const DEDUPES: bool = true;

    async fn start(db: &TestDb) -> Self {
        let port = common::free_port();
        let args = ["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"]
            .map(OsString::from)
            .into_iter()
            .chain([db.scratch_dir().join("jetstream").into_os_string()])
            .collect();
        let h = JetStream {
            port,
            prefix: db.name.replace('_', "-"),
            server: Server::start("/usr/sbin/nats-server", args, port).await,
        };
        let js = async_nats::jetstream::new(async_nats::connect(h.url()).await.unwrap());
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "CONFORMANCE".into(),
            subjects: vec![format!("{}.orders", h.prefix)],
            duplicate_window: Duration::from_secs(120),
            storage: async_nats::jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await
        .unwrap();
        h
    }

    fn table(&self) -> String {
        format!(
            "type = \"nats\"\nurl = \"{}\"\nsubject = \"{}.{{topic}}\"\n",
            self.url(),
            self.prefix
        )
    }

    async fn received(&self) -> Vec<Arrived> {
        let js = async_nats::jetstream::new(async_nats::connect(self.url()).await.unwrap());
        let mut stream = js.get_stream("CONFORMANCE").await.unwrap();
        let last = stream.info().await.unwrap().state.last_sequence;
        let mut arrived = Vec::new();
        for seq in 1..=last {
            let m = stream.get_raw_message(seq).await.unwrap();
            let headers: BTreeMap<String, String> = m
                .headers
                .iter()
                .map(|(k, v)| (k.to_string(), v[0].to_string()))
                .collect();
            arrived.push(Arrived {
                id: headers["Nats-Msg-Id"].parse().unwrap(),
                headers,
            });
        }
        arrived
    }

    async fn refused_message(&self, c: &Client) -> (Uuid, &'static str) {
        let id = crate::enqueue(
            c,
            "nostream",
            None,
            serde_json::json!({ "secret": crate::REFUSED_PAYLOAD_MARK }),
        )
        .await;
        (id, "no JetStream stream captures subject")
    }
}

impl UnsendableHeader for JetStream {
    fn unsendable_header(&self) -> (String, String) {
        ("bad name".into(), "x".into())
    }
}

impl KillConnections for JetStream {
    async fn kill_connections(&mut self) {
        // A restart is the only way a plain nats-server hangs up on a client.
        self.server.kill();
        self.server.restart().await;
    }
}

impl Outage for JetStream {
    async fn stop(&mut self) {
        self.server.kill();
    }

    async fn restart(&mut self) {
        self.server.restart().await;
    }
}

impl Freeze for JetStream {
    async fn freeze(&mut self) {
        self.server.signal("-STOP");
    }

    async fn thaw(&mut self) {
        self.server.signal("-CONT");
    }
}

impl InProcess for JetStream {}

//! Harness of the `redis` destination: a redis-server of the test's own (append-only file
//! on, so a restart keeps the streams), read back with XRANGE.

use std::collections::BTreeMap;
use std::ffi::OsString;

use tokio_postgres::Client;
use uuid::Uuid;

use crate::common::{self, TestDb};
use crate::server::Server;
use crate::{Arrived, Freeze, Harness, InProcess, KillConnections, Outage};

/// Not [`crate::UnsendableHeader`]: a stream entry carries the headers as a JSON field, so any
/// header can be sent.
pub struct Streams {
    port: u16,
    server: Server,
}

impl Streams {
    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A plain connection, patient with a loaded machine (the client's default response
    /// timeout is 500 ms).
    async fn connection(&self) -> redis::aio::MultiplexedConnection {
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(std::time::Duration::from_secs(30)));
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .unwrap()
    }
}

impl Harness for Streams {
    const DEDUPES: bool = false;

    async fn start(db: &TestDb) -> Self {
        let dir = db.scratch_dir().join("redis");
        std::fs::create_dir_all(&dir).unwrap();
        let port = common::free_port();
        let args = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
        ]
        .map(OsString::from)
        .into_iter()
        .chain([dir.into_os_string()])
        .collect();
        Streams {
            port,
            server: Server::start("redis-server", args, port).await,
        }
    }

    fn table(&self) -> String {
        format!(
            "type = \"redis\"\nurl = \"{}\"\nstream = \"test:{{topic}}\"\n",
            self.url()
        )
    }

    async fn received(&self) -> Vec<Arrived> {
        let mut c = self.connection().await;
        let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg("test:orders")
            .arg("-")
            .arg("+")
            .query_async(&mut c)
            .await
            .unwrap();
        entries
            .ids
            .iter()
            .map(|e| {
                let field = |name: &str| e.get::<String>(name).unwrap();
                let own: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_str(&field("headers")).unwrap();
                let mut headers: BTreeMap<String, String> = own
                    .into_iter()
                    .map(|(k, v)| (k, v.as_str().map_or_else(|| v.to_string(), str::to_owned)))
                    .collect();
                headers.insert("outbox-id".into(), field("outbox_id"));
                headers.insert("outbox-topic".into(), field("topic"));
                headers.insert("outbox-attempt".into(), field("attempt"));
                headers.insert("outbox-key".into(), field("key"));
                if let Some(seq) = e.get::<String>("seq") {
                    headers.insert("outbox-seq".into(), seq);
                }
                Arrived {
                    id: field("outbox_id").parse().unwrap(),
                    headers,
                }
            })
            .collect()
    }

    async fn refused_message(&self, c: &Client) -> (Uuid, &'static str) {
        // The stream's key holds a string: Redis refuses that one XADD of the pipeline.
        let mut r = self.connection().await;
        let _: () = redis::cmd("SET")
            .arg("test:wrongtype")
            .arg("x")
            .query_async(&mut r)
            .await
            .unwrap();
        (
            crate::enqueue(
                c,
                "wrongtype",
                None,
                serde_json::json!({ "secret": crate::REFUSED_PAYLOAD_MARK }),
            )
            .await,
            "WRONGTYPE",
        )
    }
}

impl KillConnections for Streams {
    async fn kill_connections(&mut self) {
        let mut r = self.connection().await;
        let killed: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("SKIPME")
            .arg("yes")
            .query_async(&mut r)
            .await
            .unwrap();
        assert!(killed >= 1, "the relayer's connection was closed");
    }
}

impl Outage for Streams {
    async fn stop(&mut self) {
        self.server.kill();
    }

    async fn restart(&mut self) {
        self.server.restart().await;
    }
}

impl Freeze for Streams {
    async fn freeze(&mut self) {
        self.server.signal("-STOP");
    }

    async fn thaw(&mut self) {
        self.server.signal("-CONT");
    }
}

impl InProcess for Streams {}

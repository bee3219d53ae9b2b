//! Harness of the `redis` destination: a redis-server of the test's own (append-only file
//! on, so a restart keeps the streams), read back with XRANGE.

use std::collections::BTreeMap;

use tokio_postgres::Client;
use uuid::Uuid;

use crate::common::{self, TestDb, eventually};
use crate::{Arrived, Harness, MINUTE, Unsupported};

pub struct Streams {
    port: u16,
    dir: std::path::PathBuf,
    server: Option<std::process::Child>,
}

impl Streams {
    fn spawn(&mut self) {
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "yes", "--appendfsync", "always", "--dir"])
            .arg(&self.dir)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (Debian package redis-server) must be installed");
        self.server = Some(child);
    }

    async fn answering(&self) {
        eventually(MINUTE, "the test's redis-server to answer", || async {
            match self.client().get_multiplexed_async_connection().await {
                Ok(mut c) => redis::cmd("PING")
                    .query_async::<String>(&mut c)
                    .await
                    .is_ok(),
                Err(_) => false,
            }
        })
        .await;
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).unwrap()
    }

    fn signal(&self, name: &str) {
        let pid = self.server.as_ref().unwrap().id().to_string();
        std::process::Command::new("kill")
            .args([name, &pid])
            .status()
            .unwrap();
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.server.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Harness for Streams {
    const DEDUPES: bool = false;

    async fn start(db: &TestDb) -> Self {
        let dir = db.scratch_dir().join("redis");
        std::fs::create_dir_all(&dir).unwrap();
        let mut h = Streams {
            port: common::free_port(),
            dir,
            server: None,
        };
        h.spawn();
        h.answering().await;
        h
    }

    fn table(&self) -> String {
        format!(
            "type = \"redis\"\nurl = \"{}\"\nstream = \"test:{{topic}}\"\n",
            self.url()
        )
    }

    async fn received(&self) -> Vec<Arrived> {
        let mut c = self
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
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
                Arrived {
                    id: field("outbox_id").parse().unwrap(),
                    headers,
                }
            })
            .collect()
    }

    async fn refused_message(&self, c: &Client) -> Result<(Uuid, &'static str), Unsupported> {
        // The stream's key holds a string: Redis refuses that one XADD of the pipeline.
        let mut r = self
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let _: () = redis::cmd("SET")
            .arg("test:wrongtype")
            .arg("x")
            .query_async(&mut r)
            .await
            .unwrap();
        Ok((
            crate::enqueue(c, "wrongtype", None, serde_json::json!({})).await,
            "WRONGTYPE",
        ))
    }

    fn unsendable_header(&self) -> Result<(String, String), Unsupported> {
        Err("a stream entry carries the headers as a JSON field: any header can be sent")
    }

    async fn kill_connections(&mut self) -> Result<(), Unsupported> {
        let mut r = self
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let killed: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("SKIPME")
            .arg("yes")
            .query_async(&mut r)
            .await
            .unwrap();
        assert!(killed >= 1, "the relayer's connection was closed");
        Ok(())
    }

    async fn stop(&mut self) -> Result<(), Unsupported> {
        self.kill();
        Ok(())
    }

    async fn restart(&mut self) {
        self.spawn();
        self.answering().await;
    }

    async fn freeze(&mut self) -> Result<(), Unsupported> {
        self.signal("-STOP");
        Ok(())
    }

    async fn thaw(&mut self) {
        self.signal("-CONT");
    }
}

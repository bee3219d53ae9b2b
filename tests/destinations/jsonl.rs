//! Harnesses of the `file` and `stdout` destinations (JSON lines): the lines are read back
//! from the file, or from the file the relayer's standard output was sent to.

use std::collections::BTreeMap;
use std::path::PathBuf;

use tokio_postgres::Client;
use uuid::Uuid;

use crate::common::TestDb;
use crate::{Arrived, Harness, InProcess};

/// Every line of `path` with topic `orders`.
fn lines(path: &PathBuf) -> Vec<Arrived> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|l| l["topic"] == "orders")
        .map(|l| {
            let mut headers: BTreeMap<String, String> = l["headers"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        v.as_str().map_or_else(|| v.to_string(), str::to_owned),
                    )
                })
                .collect();
            headers.insert(
                "outbox-id".into(),
                l["outbox_id"].as_str().unwrap().to_owned(),
            );
            headers.insert(
                "outbox-topic".into(),
                l["topic"].as_str().unwrap().to_owned(),
            );
            headers.insert("outbox-attempt".into(), l["attempt_no"].to_string());
            if let Some(key) = l["key"].as_str() {
                headers.insert("outbox-key".into(), key.to_owned());
            }
            if let Some(seq) = l["seq"].as_i64() {
                headers.insert("outbox-seq".into(), seq.to_string());
            }
            Arrived {
                id: l["outbox_id"].as_str().unwrap().parse().unwrap(),
                headers,
            }
        })
        .collect()
}

/// A payload that says it is JSON and is not: refused for good.
async fn broken_json(c: &Client) -> (Uuid, &'static str) {
    let id = c
        .query_one(
            "SELECT outbox.enqueue('orders', convert_to('{not json', 'UTF8'), NULL, '{}', NULL, NULL, NULL, 'application/json')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    (id, "payload is not valid JSON")
}

/// The `file` destination, or (`STDOUT`) the `stdout` one. It implements none of the
/// optional capabilities, so the suite generates none of their scenarios for it:
/// - a header the protocol cannot carry: a JSON line carries the headers as a JSON object,
///   so any header can be written;
/// - the connection killed, the server down: there is no connection and no server, the
///   lines go to a local file or the process's standard output;
/// - a server that stops answering: a local write stalls only on a full or frozen
///   filesystem, which a test cannot cause safely.
///
/// The `file` destination is built in the test's process for the publish window's scenario
/// ([`InProcess`]); the `stdout` one is not, since it would write to the test's own standard
/// output (it is the same code with another target).
pub struct JsonLines<const STDOUT: bool> {
    path: PathBuf,
}

pub type File = JsonLines<false>;
pub type Stdout = JsonLines<true>;

impl<const STDOUT: bool> Harness for JsonLines<STDOUT> {
    const DEDUPES: bool = false;

    async fn start(db: &TestDb) -> Self {
        JsonLines {
            path: db.scratch_dir().join("out.jsonl"),
        }
    }

    fn table(&self) -> String {
        if STDOUT {
            "type = \"stdout\"\n".to_owned()
        } else {
            format!("type = \"file\"\npath = \"{}\"\n", self.path.display())
        }
    }

    fn stdout(&self) -> Option<PathBuf> {
        STDOUT.then(|| self.path.clone())
    }

    async fn received(&self) -> Vec<Arrived> {
        lines(&self.path)
    }

    async fn refused_message(&self, c: &Client) -> (Uuid, &'static str) {
        broken_json(c).await
    }
}

impl InProcess for File {}

//! What the AWS harnesses share: a moto server of the test's own (moto 5.2.5 from the
//! virtual environment `make test` makes at `target/venv`, started by `moto_server.py`
//! beside this file) behind a proxy of the test's own, which the relayer is pointed at
//! (`endpoint_url`) so that the test can cut, stop or freeze its connections. moto keeps
//! everything in memory, so the server itself is never stopped: stopping the proxy is the
//! outage. Queues, topics, streams and buses are made, and what arrived is read back, with
//! boto3 (`aws.py` beside this file), straight from the server.
//!
//! Where moto differs from AWS (each harness says what matters to it): it checks no
//! signature (any credentials do; the relayer's SDK still needs some, from
//! `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`, which `make test` sets); it refuses a
//! whole `SendMessageBatch` for one entry's invalid parameter where SQS refuses that entry
//! (the destination then sends each entry of the call alone, which covers both); and moto
//! 5.2.5 counts an SQS queue's messages on every message sent to it (straight, or through
//! an SNS subscription): `Queue.attributes`, which `send_message` reads for one setting,
//! computes the three `ApproximateNumberOfMessages*` counts, each a pass over the queue.
//! A `SendMessageBatch` of 10 took 0.6 s at 2,500 messages, so the 5,000-message scenario's
//! calls outlasted the relayer's dispatch deadline and it sent again what moto had kept.
//! `moto_server.py` works around that bug by counting only when a count is asked for
//! (GetQueueAttributes); the call then takes 4 ms whatever the queue holds. It also keeps
//! the JSONPath expressions moto compiles for every event an EventBridge rule sends to a
//! target (40 ms for a PutEvents of 10, 6 ms with them kept). The queue is not
//! drained while the relayer sends, as a consumer would: moto's `DeleteMessage` rebuilds the
//! queue's list of messages without a lock, and a message sent meanwhile is lost (20 of
//! 5,000 were, with a reader of 8 clients). The figures of `outbox-relay bench` against moto
//! measure moto more than the relayer.

use std::path::PathBuf;
use std::process::Command;

use crate::common;
use crate::proxy::Proxy;
use crate::server::Server;

/// The region the harnesses use (moto serves any).
pub const REGION: &str = "us-east-1";
pub const ACCOUNT: &str = "123456789012";

pub struct Moto {
    port: u16,
    pub proxy: Proxy,
    _server: Server,
}

/// The target directory (where `make test` puts the virtual environment).
fn target() -> PathBuf {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target directory")
        .to_owned()
}

fn venv(program: &str) -> PathBuf {
    let path = target().join("venv/bin").join(program);
    assert!(
        path.exists(),
        "{} is missing: moto[server] and boto3 go into target/venv (scripts/test-services.sh \
         installs them: python3 -m venv target/venv; target/venv/bin/pip install 'moto[server]==5.2.5' boto3)",
        path.display()
    );
    path
}

impl Moto {
    /// A moto server on a free port, and a proxy in front of it.
    pub async fn start() -> Moto {
        for name in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"] {
            assert!(
                std::env::var_os(name).is_some(),
                "{name} must be set for the relayer's AWS SDK (any value: moto checks no \
                 signature; `make test` sets it to `testing`)"
            );
        }
        let port = common::free_port();
        let launcher = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/destinations/moto_server.py");
        let server = Server::start_in(
            venv("python").into_os_string(),
            vec![
                launcher.into_os_string(),
                "-H".into(),
                "127.0.0.1".into(),
                "-p".into(),
                port.to_string().into(),
            ],
            port,
            None,
        )
        .await;
        Moto {
            port,
            proxy: Proxy::recording(&format!("127.0.0.1:{port}")).await,
            _server: server,
        }
    }

    /// The endpoint the relayer is given: the proxy.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.proxy.port)
    }

    /// `aws.py COMMAND ARGS` against the server itself; its standard output.
    pub fn run(&self, args: &[&str]) -> String {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/destinations/aws.py");
        let out = Command::new(venv("python"))
            .arg(script)
            .arg(format!("http://127.0.0.1:{}", self.port))
            .args(args)
            .output()
            .expect("run aws.py");
        assert!(
            out.status.success(),
            "aws.py {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// `aws.py COMMAND ARGS`, one JSON value per line of its output.
    pub fn read<T: serde::de::DeserializeOwned>(&self, args: &[&str]) -> Vec<T> {
        self.run(args)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
            .collect()
    }
}

/// A message read back from SQS (straight, or as an SNS notification).
#[derive(Debug, serde::Deserialize)]
pub struct QueueMessage {
    pub body: String,
    pub attributes: std::collections::BTreeMap<String, String>,
    pub group: Option<String>,
}

impl QueueMessage {
    /// The attributes, with the headers of `outbox-headers` (the ones that did not fit) as
    /// headers of their own.
    pub fn headers(&self) -> std::collections::BTreeMap<String, String> {
        let mut headers = self.attributes.clone();
        if let Some(rest) = headers.remove("outbox-headers") {
            let rest: std::collections::BTreeMap<String, String> =
                serde_json::from_str(&rest).unwrap();
            headers.extend(rest);
        }
        headers
    }

    pub fn arrived(&self) -> crate::Arrived {
        let headers = self.headers();
        crate::Arrived {
            id: headers["outbox-id"].parse().unwrap(),
            headers,
        }
    }
}

/// The message of an envelope (a Kinesis record's data, an event's detail) as it arrived.
pub fn arrived_envelope(envelope: &serde_json::Value) -> crate::Arrived {
    let text = |v: &serde_json::Value| v.as_str().map_or_else(|| v.to_string(), str::to_owned);
    let mut headers: std::collections::BTreeMap<String, String> = envelope["headers"]
        .as_object()
        .map(|o| o.iter().map(|(k, v)| (k.clone(), text(v))).collect())
        .unwrap_or_default();
    headers.insert("outbox-id".into(), text(&envelope["outbox_id"]));
    headers.insert("outbox-topic".into(), text(&envelope["topic"]));
    headers.insert("outbox-attempt".into(), text(&envelope["attempt_no"]));
    if let Some(key) = envelope["key"].as_str() {
        headers.insert("outbox-key".into(), key.to_owned());
    }
    // A keyed message's sequence: the envelope's `seq` (null for an unkeyed one).
    if let Some(seq) = envelope["seq"].as_i64() {
        headers.insert("outbox-seq".into(), seq.to_string());
    }
    crate::Arrived {
        id: envelope["outbox_id"].as_str().unwrap().parse().unwrap(),
        headers,
    }
}

//! Harness of the `amqp` destination: the shared RabbitMQ on 127.0.0.1:5672 behind a proxy
//! of the test's own (so the test can cut, stop or freeze its connection without touching
//! the broker other tests use), a queue per test on the default exchange, read back with a
//! plain client.

use std::collections::BTreeMap;

use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::AMQPValue;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::common::TestDb;
use crate::proxy::Proxy;
use crate::{Arrived, Freeze, Harness, InProcess, KillConnections, Outage, UnsendableHeader};

const BROKER: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

pub struct Rabbit {
    proxy: Proxy,
    prefix: String,
    _connection: lapin::Connection,
    channel: lapin::Channel,
}

impl Rabbit {
    fn queue(&self) -> String {
        format!("{}-orders", self.prefix)
    }
}

impl Harness for Rabbit {
    const DEDUPES: bool = false;

    async fn start(db: &TestDb) -> Self {
        let connection = lapin::Connection::connect(BROKER, Default::default())
            .await
            .expect("RabbitMQ on 127.0.0.1:5672 (start it with: rabbitmq-server -detached)");
        let channel = connection.create_channel().await.unwrap();
        let h = Rabbit {
            proxy: Proxy::start("127.0.0.1:5672").await,
            prefix: db.name.clone(),
            _connection: connection,
            channel,
        };
        h.channel
            .queue_declare(
                h.queue().as_str().into(),
                QueueDeclareOptions::default(),
                Default::default(),
            )
            .await
            .unwrap();
        h
    }

    fn table(&self) -> String {
        format!(
            "type = \"amqp\"\nurl = \"amqp://guest:guest@127.0.0.1:{}/%2f\"\nrouting_key = \"{}-{{topic}}\"\n",
            self.proxy.port, self.prefix
        )
    }

    async fn received(&self) -> Vec<Arrived> {
        let mut arrived = Vec::new();
        while let Some(m) = self
            .channel
            .basic_get(
                self.queue().as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
        {
            let p = &m.delivery.properties;
            assert_eq!(p.delivery_mode(), &Some(2), "persistent");
            let mut headers = BTreeMap::new();
            for (k, v) in p.headers().as_ref().unwrap() {
                let value = match v {
                    AMQPValue::LongString(s) => s.to_string(),
                    other => format!("{other:?}"),
                };
                headers.insert(k.to_string(), value);
            }
            arrived.push(Arrived {
                id: p
                    .message_id()
                    .as_ref()
                    .unwrap()
                    .to_string()
                    .parse()
                    .unwrap(),
                headers,
            });
        }
        arrived
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
            "unroutable",
        )
    }

    async fn clean_up(self) {
        self.channel
            .queue_delete(self.queue().as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
}

impl UnsendableHeader for Rabbit {
    fn unsendable_header(&self) -> (String, String) {
        // An AMQP field table key is a short string: at most 255 bytes.
        ("h".repeat(300), "x".into())
    }
}

impl KillConnections for Rabbit {
    async fn kill_connections(&mut self) {
        self.proxy.kill_connections();
    }
}

impl Outage for Rabbit {
    async fn stop(&mut self) {
        self.proxy.stop().await;
    }

    async fn restart(&mut self) {
        self.proxy.listen().await;
    }
}

impl Freeze for Rabbit {
    async fn freeze(&mut self) {
        self.proxy.freeze();
    }

    async fn thaw(&mut self) {
        self.proxy.thaw();
    }
}

impl InProcess for Rabbit {}

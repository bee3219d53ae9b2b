//! The scope of a key's order chosen with the `key-order` verb and honoured by a running
//! relayer: keys ordered per topic keep flowing on a topic whose destination is up while
//! their messages on a topic whose destination is down wait, each key in enqueue order.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::{Relayer, TestDb, eventually, text, verb};

const MINUTE: Duration = Duration::from_secs(60);

/// Item 2 of issue 55 with the remedy applied: `orders.*` ordered per topic with
/// `outbox-relay key-order set`, `orders.dead` routed to an HTTP destination that is down
/// and `orders.live` to a file, five keys each with a message on `orders.dead` before ten
/// on `orders.live`. Every `orders.live` message is delivered, each key's in enqueue
/// order, while the `orders.dead` ones wait; `key-order list` shows the rule and `unset`
/// removes it.
#[tokio::test(flavor = "multi_thread")]
async fn keys_ordered_per_topic_are_delivered_on_their_topic_while_another_topics_destination_is_down()
 {
    let db = TestDb::new().await;
    let c = db.client().await;
    let down = common::ClosedPort::new();
    let port = down.port;
    let live_out = db.scratch_dir().join("live.jsonl");
    let config = db.scratch_dir().join("scoped.toml");
    std::fs::write(
        &config,
        format!(
            "[destinations.down]\ntype = \"http\"\nurl = \"http://127.0.0.1:{port}/\"\n\
             [destinations.live]\ntype = \"file\"\npath = \"{}\"\n\
             [[routes]]\ntopic = \"orders.dead\"\ndestination = \"down\"\n\
             [[routes]]\ntopic = \"orders.live\"\ndestination = \"live\"\n",
            live_out.display()
        ),
    )
    .unwrap();

    let out = verb(&["key-order", "set", "orders.*", "topic"], &db.url);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text(&out.stdout).contains("orders.*: keys ordered per topic"),
        "{}",
        text(&out.stdout)
    );
    let out = verb(&["key-order", "set", "orders.*", "sideways"], &db.url);
    assert!(!out.status.success(), "an unknown scope is refused");
    let out = verb(&["key-order", "list"], &db.url);
    assert!(out.status.success(), "{out:?}");
    let listed = text(&out.stdout);
    let rule: Vec<&str> = listed
        .lines()
        .next()
        .unwrap_or_else(|| panic!("no rule listed: {listed:?}"))
        .split('\t')
        .collect();
    assert_eq!(rule[..2], ["orders.*", "topic"], "{listed}");

    for k in 0..5 {
        let key = format!("order-{k}");
        c.execute(
            // attempts enough for the whole test: the messages wait, and are not
            // dead-lettered by the circuit's probes
            "SELECT outbox.enqueue('orders.dead', '{}'::jsonb, $1, p_max_attempts => 1000)",
            &[&key],
        )
        .await
        .unwrap();
        c.execute(
            "SELECT outbox.enqueue('orders.live', jsonb_build_object('n', n), $1) \
               FROM generate_series(1, 10) AS n",
            &[&key],
        )
        .await
        .unwrap();
    }

    let config = config.display().to_string();
    let mut relayer = Relayer::start(
        &db,
        "relay-scoped",
        &[
            "--config",
            &config,
            "--poll-interval-ms",
            "50",
            "--circuit-failures",
            "1",
            "--circuit-cooldown-ms",
            "3000",
            "--retry-base-ms",
            "10",
        ],
    );
    eventually(MINUTE, "every orders.live message delivered", || async {
        common::count(
            &c,
            "SELECT count(*) FROM outbox.messages WHERE topic = 'orders.live'",
        )
        .await
            == 0
    })
    .await;
    let mut last: HashMap<String, i64> = HashMap::new();
    for line in std::fs::read_to_string(&live_out).unwrap().lines() {
        let m: serde_json::Value = serde_json::from_str(line).unwrap();
        let key = m["key"].as_str().expect("a keyed message").to_owned();
        let n = m["payload"]["n"].as_i64().unwrap();
        let before = last.insert(key.clone(), n).unwrap_or(0);
        assert_eq!(n, before + 1, "{key}: {n} after {before}");
    }
    assert_eq!(last.len(), 5, "{last:?}");
    assert!(last.values().all(|n| *n == 10), "{last:?}");
    assert_eq!(
        common::count(
            &c,
            "SELECT count(*) FROM outbox.messages WHERE topic = 'orders.dead'",
        )
        .await,
        5,
        "the orders.dead messages wait for their destination"
    );
    relayer.signal("TERM");
    assert_eq!(relayer.exit_code(MINUTE).await, Some(0));

    let out = verb(&["key-order", "unset", "orders.*"], &db.url);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text(&verb(&["key-order", "list"], &db.url).stdout)
            .trim()
            .is_empty(),
        "the rule is gone"
    );
    db.finish().await;
}

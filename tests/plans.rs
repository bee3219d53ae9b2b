//! The plans of the hot path's statements (inside claim, extend, release and complete),
//! read with auto_explain, at 0-row statistics over 20,000 rows (what autovacuum leaves
//! after the queue drained), 20,000 analyzed rows and 1,000,000: each is driven by an index,
//! never by a scan of outbox.messages that rescans the batch per row.

mod common;

use std::sync::{Arc, Mutex};

use common::TestDb;
use futures_util::StreamExt;
use tokio_postgres::{AsyncMessage, Client, NoTls};
use uuid::Uuid;

/// A connection whose statements, nested ones included, have their plans sent back as
/// notices (auto_explain), collected into the returned list.
async fn explaining(url: &str) -> (Client, Arc<Mutex<Vec<String>>>) {
    let (client, mut connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    let plans = Arc::new(Mutex::new(Vec::new()));
    let sink = plans.clone();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notice(notice) = message {
                sink.lock().unwrap().push(notice.message().to_owned());
            }
        }
    });
    client
        .batch_execute(
            "LOAD 'auto_explain';
             SET auto_explain.log_min_duration = 0;
             SET auto_explain.log_nested_statements = on;
             SET auto_explain.log_analyze = on;
             SET auto_explain.log_timing = off;
             SET auto_explain.log_level = notice;",
        )
        .await
        .unwrap();
    (client, plans)
}

/// Seven rounds (past plpgsql's five custom plans, into its generic one) of: claim 500,
/// extend them, release 100, complete the rest. Returns every plan auto_explain printed.
async fn hot_path_plans(url: &str) -> Vec<String> {
    let (c, plans) = explaining(url).await;
    for _ in 0..7 {
        let rows = c
            .query(
                "SELECT outbox_id, lease_token FROM outbox.claim_outbox_batch(500, 'w', 30)",
                &[],
            )
            .await
            .unwrap();
        let ids: Vec<Uuid> = rows.iter().map(|r| r.get(0)).collect();
        let tokens: Vec<Uuid> = rows.iter().map(|r| r.get(1)).collect();
        assert_eq!(ids.len(), 500);
        let extended = c
            .query(
                "SELECT * FROM outbox.extend_outbox_leases('w', $1, $2, 30)",
                &[&ids, &tokens],
            )
            .await
            .unwrap();
        assert_eq!(extended.len(), 500);
        let released: i32 = c
            .query_one(
                "SELECT outbox.release_outbox_leases('w', $1, $2)",
                &[&&ids[..100], &&tokens[..100]],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(released, 100);
        let done = c
            .query(
                "SELECT * FROM outbox.complete_outbox_batch('w', $1, $2, \
                 array_fill('DISPATCHED'::outbox.attempt_state, ARRAY[400]), NULL, NULL) \
                 WHERE NOT lease_lost",
                &[&&ids[100..], &&tokens[100..]],
            )
            .await
            .unwrap();
        assert_eq!(done.len(), 400);
    }
    let plans = plans.lock().unwrap().clone();
    assert!(
        plans.len() > 20,
        "auto_explain printed {} plans",
        plans.len()
    );
    plans
}

/// The figure after `label` on a plan line, e.g. "Rows Removed by Join Filter: 749500".
fn removed(plan: &str, label: &str) -> u64 {
    plan.lines()
        .filter_map(|l| l.split_once(label))
        .filter_map(|(_, n)| n.trim().parse::<u64>().ok())
        .max()
        .unwrap_or(0)
}

/// A plan with its long lines (arrays of ids) cut short, for a failure message.
fn short(plan: &str) -> String {
    plan.lines()
        .map(|l| l.chars().take(200).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n")
}

fn assert_index_driven(shape: &str, plans: &[String]) {
    let mut fences = 0;
    for full in plans {
        let plan = &short(full);
        // A join that compares every leased row with every listed one.
        assert!(
            removed(plan, "Rows Removed by Join Filter:") < 1_000,
            "{shape}: a join rescans the batch per row:\n{plan}"
        );
        assert!(
            !plan.contains("Seq Scan on messages"),
            "{shape}: a hot-path statement scans outbox.messages:\n{plan}"
        );
        if plan.contains("CROSS JOIN LATERAL") && plan.contains("FOR NO KEY UPDATE") {
            fences += 1;
            assert!(
                plan.contains("Index Cond: (outbox_id = u.id)"),
                "{shape}: the fence is not one primary-key probe per listed id:\n{plan}"
            );
        }
    }
    // complete, extend and release, seven rounds each.
    assert!(fences >= 21, "{shape}: {fences} fence plans seen");
}

async fn fill(c: &Client, n: i64) {
    c.execute(
        "INSERT INTO outbox.messages (topic, payload) \
         SELECT 'plans', convert_to(json_build_object('n', i)::text, 'UTF8') \
           FROM generate_series(1, $1::bigint) AS i",
        &[&n],
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn hot_path_plans_are_index_driven_at_any_backlog_and_any_statistics() {
    let db = TestDb::new().await;
    let c = db.client().await;

    // What autovacuum leaves behind once the queue drained: statistics of an empty table
    // that keeps its pages; then a burst arrives.
    fill(&c, 20_000).await;
    c.batch_execute("DELETE FROM outbox.messages")
        .await
        .unwrap();
    c.batch_execute("VACUUM (TRUNCATE false) outbox.messages")
        .await
        .unwrap();
    let reltuples: f32 = c
        .query_one(
            "SELECT reltuples FROM pg_class WHERE oid = 'outbox.messages'::regclass",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(reltuples < 1.0, "reltuples {reltuples}");
    fill(&c, 20_000).await;
    assert_index_driven(
        "0-row statistics, 20,000 rows",
        &hot_path_plans(&db.url).await,
    );

    c.batch_execute("ANALYZE outbox.messages").await.unwrap();
    assert_index_driven("20,000 rows analyzed", &hot_path_plans(&db.url).await);

    fill(&c, 1_000_000).await;
    c.batch_execute("ANALYZE outbox.messages").await.unwrap();
    assert_index_driven("1,000,000 rows analyzed", &hot_path_plans(&db.url).await);
    db.finish().await;
}

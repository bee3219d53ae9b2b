//! The views an operator reads: `status`, `in_flight`, `topic_lag`, `worker_activity`,
//! `recent_failures`, `attempt_rates`; the relayers' circuit reports (`report_circuits`,
//! the view `circuits`).

use super::*;

#[tokio::test]
async fn views_show_the_state_of_the_outbox() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "orders", None).await;
    enqueue(&c, "orders", None).await;
    enqueue(&c, "payments", None).await;
    c.execute(
        "SELECT outbox.enqueue('orders', '{}'::jsonb, p_available_at => now() + interval '1 hour')",
        &[],
    )
    .await
    .unwrap();
    let batch = claim(&c, 2, "w1", 30).await;
    complete(&c, &batch[0], "w1", "FAILED", Some("400 Bad Request"))
        .await
        .unwrap();

    let s = c.query_one("SELECT ready, delayed, in_flight, expired_leases, dead_letters, oldest_ready_age IS NOT NULL FROM outbox.status", &[]).await.unwrap();
    let got: (i64, i64, i64, i64, i64, bool) =
        (s.get(0), s.get(1), s.get(2), s.get(3), s.get(4), s.get(5));
    assert_eq!(got, (1, 1, 1, 0, 1, true));

    let in_flight = c
        .query_one(
            "SELECT outbox_id, claimed_by, expired FROM outbox.in_flight",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(in_flight.get::<_, Uuid>(0), batch[1].id);
    assert_eq!(in_flight.get::<_, String>(1), "w1");
    assert!(!in_flight.get::<_, bool>(2));

    let lag: Vec<(String, i64, i64, i64, i64)> = c
        .query("SELECT topic, ready, delayed, in_flight, dead_letters FROM outbox.topic_lag ORDER BY topic", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    let total_orders: i64 = lag
        .iter()
        .filter(|l| l.0 == "orders")
        .map(|l| l.1 + l.2 + l.3 + l.4)
        .sum();
    let total_payments: i64 = lag
        .iter()
        .filter(|l| l.0 == "payments")
        .map(|l| l.1 + l.2 + l.3 + l.4)
        .sum();
    assert_eq!((total_orders, total_payments), (3, 1), "{lag:?}");

    let activity = c
        .query_one(
            "SELECT worker_id, leases_held, failed_5m FROM outbox.worker_activity",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(activity.get::<_, String>(0), "w1");
    assert_eq!(activity.get::<_, i64>(1), 1);
    assert_eq!(activity.get::<_, i64>(2), 1);

    let failure = c
        .query_one(
            "SELECT outbox_id, error, now_in FROM outbox.recent_failures",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(failure.get::<_, Uuid>(0), batch[0].id);
    assert_eq!(failure.get::<_, String>(1), "400 Bad Request");
    assert_eq!(failure.get::<_, String>(2), "dead_letter");

    let rates: i64 = count(&c, "SELECT sum(attempts)::bigint FROM outbox.attempt_rates").await;
    assert_eq!(rates, 1);
    db.finish().await;
}

/// (worker, destination, state, stale) of every row of `outbox.circuits`, ordered.
async fn circuits(c: &tokio_postgres::Client) -> Vec<(String, String, String, bool)> {
    c.query(
        "SELECT worker_id, destination, state, stale FROM outbox.circuits \
         ORDER BY worker_id, destination",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

fn row(
    worker: &str,
    destination: &str,
    state: &str,
    stale: bool,
) -> (String, String, String, bool) {
    (worker.into(), destination.into(), state.into(), stale)
}

#[tokio::test]
async fn circuit_reports_replace_a_workers_earlier_ones_turn_stale_and_age_out() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let report = async |worker: &str, destinations: &[&str], states: &[&str]| {
        c.execute(
            "SELECT outbox.report_circuits($1, $2, $3, \
             array_fill(timestamptz '2026-01-01 00:00:00+00', ARRAY[cardinality($2::text[])]), \
             interval '1 minute')",
            &[&worker, &destinations, &states],
        )
        .await
        .unwrap();
    };
    report("w1", &["hooks", "bus"], &["open", "closed"]).await;
    report("w2", &["hooks"], &["half-open"]).await;
    assert_eq!(
        circuits(&c).await,
        [
            row("w1", "bus", "closed", false),
            row("w1", "hooks", "open", false),
            row("w2", "hooks", "half-open", false)
        ]
    );
    let (since, expires_in): (chrono::DateTime<chrono::Utc>, f64) = {
        let r = c
            .query_one(
                "SELECT since, extract(epoch FROM expires_at - reported_at)::float8 \
                 FROM outbox.circuits WHERE worker_id = 'w1' AND destination = 'hooks'",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(since.to_rfc3339(), "2026-01-01T00:00:00+00:00");
    assert!((expires_in - 60.0).abs() < 1e-6, "{expires_in}");

    // A worker's report is its whole set: a destination it no longer names is gone.
    report("w1", &["hooks"], &["closed"]).await;
    // A worker that stopped renewing: its report is stale once it expired…
    c.batch_execute(
        "UPDATE outbox.circuit_reports SET expires_at = now() - interval '1 second' \
         WHERE worker_id = 'w2'",
    )
    .await
    .unwrap();
    assert_eq!(
        circuits(&c).await,
        [
            row("w1", "hooks", "closed", false),
            row("w2", "hooks", "half-open", true)
        ]
    );
    // …and deleted by any worker's report an hour after that.
    c.batch_execute(
        "UPDATE outbox.circuit_reports SET expires_at = now() - interval '61 minutes' \
         WHERE worker_id = 'w2'",
    )
    .await
    .unwrap();
    report("w3", &["hooks"], &["open"]).await;
    assert_eq!(
        circuits(&c).await,
        [
            row("w1", "hooks", "closed", false),
            row("w3", "hooks", "open", false)
        ]
    );
    // A worker stopping reports no destination: its rows are gone.
    report("w1", &[], &[]).await;
    assert_eq!(circuits(&c).await, [row("w3", "hooks", "open", false)]);
    db.finish().await;
}

#[tokio::test]
async fn the_observation_gives_each_topic_its_next_due_time_and_none_for_parked_messages() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "SELECT outbox.enqueue('later', '{}'::jsonb, p_available_at => now() + interval '2 hours');
         SELECT outbox.enqueue('later', '{}'::jsonb, p_available_at => now() + interval '1 hour');
         SELECT outbox.enqueue('parked', '{}'::jsonb, p_available_at => 'infinity');
         SELECT outbox.enqueue('now', '{}'::jsonb);",
    )
    .await
    .unwrap();
    let due: Vec<(String, Option<f64>)> = c
        .query(
            "SELECT t ->> 'topic', \
                    extract(epoch FROM (t ->> 'next_due_at')::timestamptz - now())::float8 \
               FROM outbox.observe(10, interval '0') AS o, jsonb_array_elements(o.snapshot -> 'topics') AS t \
              ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(due.len(), 3, "{due:?}");
    let later = due[0].1.expect("later has a due time");
    assert!(
        (3590.0..=3600.0).contains(&later),
        "the earlier of the two: {due:?}"
    );
    assert_eq!(due[1], ("now".to_owned(), None), "nothing delayed");
    assert_eq!(due[2], ("parked".to_owned(), None), "parked is never due");
    db.finish().await;
}

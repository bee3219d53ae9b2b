//! The views an operator reads: `status`, `in_flight`, `topic_lag`, `worker_activity`,
//! `recent_failures`, `attempt_rates`.

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

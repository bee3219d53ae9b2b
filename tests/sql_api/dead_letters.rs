//! Dead letters and the attempt history: retries dead-letter at max_attempts, FAILED at
//! once, replay (by id or topic) with a fresh budget, and `prune_attempts` keeping the
//! history of pending and dead messages and deleting the oldest finished first.

use super::*;

#[tokio::test]
async fn retries_dead_letter_at_max_attempts_and_replay_gives_a_fresh_budget() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = enqueue_with(&c, Some("k"), 2).await;
    let behind = enqueue_with(&c, Some("k"), 2).await;

    let m = claim(&c, 1, "w1", 30).await.pop().unwrap();
    let first_life_seq = m.seq.unwrap();
    complete(&c, &m, "w1", "RETRYABLE", Some("timeout 1"))
        .await
        .unwrap();
    let m = claim(&c, 1, "w1", 30).await.pop().unwrap();
    assert_eq!((m.id, m.attempt_no), (id, 2));
    assert_eq!(
        m.seq,
        Some(first_life_seq),
        "a retry keeps the message's seq"
    );
    complete(&c, &m, "w1", "RETRYABLE", Some("timeout 2"))
        .await
        .unwrap();

    let dead = c
        .query_one(
            "SELECT topic, message_key, payload, headers::text, attempt_count, last_error \
             FROM outbox.dead_letters WHERE outbox_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(dead.get::<_, String>(0), "t");
    assert_eq!(dead.get::<_, Option<String>>(1).as_deref(), Some("k"));
    assert_eq!(dead.get::<_, Vec<u8>>(2), b"{}");
    assert_eq!(dead.get::<_, i32>(4), 2);
    assert_eq!(dead.get::<_, String>(5), "timeout 2");
    assert_eq!(history(&c, id).await, ["1:RETRYABLE", "2:RETRYABLE"]);

    // The dead head no longer blocks its key.
    let next = claim(&c, 10, "w1", 30).await;
    assert_eq!(next.iter().map(|m| m.id).collect::<Vec<_>>(), [behind]);
    complete(&c, &next[0], "w1", "DISPATCHED", None)
        .await
        .unwrap();

    let replayed: i32 = c
        .query_one("SELECT outbox.replay_dead_letters(ARRAY[$1::uuid])", &[&id])
        .await
        .unwrap()
        .get(0);
    assert_eq!(replayed, 1);
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.dead_letters").await,
        0
    );
    // A fresh budget of 2: attempt 3 may fail and 4 still happens.
    let m = claim(&c, 1, "w1", 30).await.pop().unwrap();
    assert_eq!((m.id, m.attempt_no), (id, 3));
    assert!(
        m.seq > next[0].seq && next[0].seq > Some(first_life_seq),
        "a replay is numbered after the key's messages delivered before it ({:?} after {:?})",
        m.seq,
        next[0].seq
    );
    complete(&c, &m, "w1", "RETRYABLE", Some("timeout 3"))
        .await
        .unwrap();
    let m = claim(&c, 1, "w1", 30).await.pop().unwrap();
    assert_eq!(m.attempt_no, 4);
    complete(&c, &m, "w1", "DISPATCHED", None).await.unwrap();
    assert_eq!(
        history(&c, id).await,
        ["1:RETRYABLE", "2:RETRYABLE", "3:RETRYABLE", "4:DISPATCHED"]
    );
    db.finish().await;
}

#[tokio::test]
async fn failed_dead_letters_at_once_and_replay_by_topic() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "payments", None).await;
    enqueue(&c, "orders", None).await;
    for m in claim(&c, 10, "w1", 30).await {
        complete(&c, &m, "w1", "FAILED", Some("400 Bad Request"))
            .await
            .unwrap();
    }
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.dead_letters").await,
        2
    );
    let n: i32 = c
        .query_one(
            "SELECT outbox.replay_dead_letters(p_topic => 'orders')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    let topics: Vec<String> = c
        .query("SELECT topic FROM outbox.messages", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(topics, ["orders"]);
    db.finish().await;
}

#[tokio::test]
async fn prune_keeps_the_history_of_pending_and_dead_messages() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let done = enqueue(&c, "t", None).await;
    let pending = enqueue(&c, "t", None).await;
    let dead = enqueue(&c, "t", None).await;
    for m in claim(&c, 10, "w1", 30).await {
        let state = if m.id == done {
            "DISPATCHED"
        } else if m.id == pending {
            "RETRYABLE"
        } else {
            "FAILED"
        };
        complete(&c, &m, "w1", state, None).await.unwrap();
    }
    let pruned: i64 = c
        .query_one("SELECT outbox.prune_attempts(interval '0')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(pruned, 1);
    assert!(history(&c, done).await.is_empty());
    assert_eq!(history(&c, pending).await, ["1:RETRYABLE"]);
    assert_eq!(history(&c, dead).await, ["1:FAILED"]);
    db.finish().await;
}

#[tokio::test]
async fn a_limited_prune_deletes_the_oldest_finished_histories_first() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let mut finished = Vec::new();
    for _ in 0..5 {
        let id = enqueue(&c, "t", None).await;
        let m = claim(&c, 1, "w1", 30).await.remove(0);
        assert_eq!(m.id, id);
        complete(&c, &m, "w1", "DISPATCHED", None).await.unwrap();
        finished.push(id);
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let prune = |limit: i64| {
        let c = &c;
        async move {
            c.query_one("SELECT outbox.prune_attempts(interval '0', $1)", &[&limit])
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    assert_eq!(prune(2).await, 2);
    for (i, id) in finished.iter().enumerate() {
        assert_eq!(history(&c, *id).await.is_empty(), i < 2, "message {i}");
    }
    assert_eq!(prune(2).await, 2);
    assert_eq!(
        prune(2).await,
        1,
        "fewer than the limit: nothing older is left"
    );
    assert_eq!(prune(2).await, 0);
    db.finish().await;
}

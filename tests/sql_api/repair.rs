//! `outbox.repair_expired_leases`: expired leases requeued (or dead-lettered when they keep
//! killing their worker), live ones and rows a completion holds left alone, one pass at a
//! time, and the stale worker fenced after repair and reclaim.

use super::*;

#[tokio::test]
async fn stale_worker_is_fenced_after_repair_and_reclaim() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = enqueue(&c, "t", None).await;
    let stale = claim(&c, 1, "w1", 30).await.pop().unwrap();

    expire_leases(&c).await;
    assert_eq!(repair(&c).await, (1, 0));
    assert_eq!(history(&c, id).await, ["1:ZOMBIE_REQUEUE"]);
    let zombie = c
        .query_one(
            "SELECT worker_id, lease_token, error FROM outbox.attempts WHERE outbox_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(zombie.get::<_, String>(0), "w1");
    assert_eq!(zombie.get::<_, Uuid>(1), stale.token);
    assert!(zombie.get::<_, String>(2).contains("lease expired"));

    let fresh = claim(&c, 1, "w2", 30).await.pop().unwrap();
    assert_eq!((fresh.id, fresh.attempt_no), (id, 2));

    // The revived worker reports its (old) outcome: refused, whatever it claims.
    let (code, _) = sqlstate(complete(&c, &stale, "w1", "DISPATCHED", None).await);
    assert_eq!(code, "P7002");
    let (code, _) = sqlstate(complete(&c, &stale, "w1", "FAILED", Some("x")).await);
    assert_eq!(code, "P7002");
    let old_token_new_owner = Claimed {
        token: stale.token,
        ..fresh.clone()
    };
    let (code, _) = sqlstate(complete(&c, &old_token_new_owner, "w2", "DISPATCHED", None).await);
    assert_eq!(
        code, "P7002",
        "the old token is refused even from the new owner"
    );

    assert_eq!(
        complete(&c, &fresh, "w2", "DISPATCHED", None)
            .await
            .unwrap(),
        2
    );
    assert_eq!(history(&c, id).await, ["1:ZOMBIE_REQUEUE", "2:DISPATCHED"]);
    db.finish().await;
}

#[tokio::test]
async fn repair_dead_letters_a_message_that_keeps_killing_its_worker() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = enqueue_with(&c, None, 2).await;
    for round in 1..=2 {
        let m = claim(&c, 1, "w1", 30).await.pop().unwrap();
        assert_eq!(m.attempt_no, round);
        expire_leases(&c).await;
        let expected = if round == 2 { (0, 1) } else { (1, 0) };
        assert_eq!(repair(&c).await, expected);
    }
    assert_eq!(
        history(&c, id).await,
        ["1:ZOMBIE_REQUEUE", "2:ZOMBIE_REQUEUE"]
    );
    let err: String = c
        .query_one(
            "SELECT last_error FROM outbox.dead_letters WHERE outbox_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert!(err.contains("lease expired"), "{err}");
    db.finish().await;
}

#[tokio::test]
async fn repair_leaves_live_leases_alone() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "t", None).await;
    let m = claim(&c, 1, "w1", 30).await.pop().unwrap();
    assert_eq!(repair(&c).await, (0, 0));
    assert_eq!(complete(&c, &m, "w1", "DISPATCHED", None).await.unwrap(), 1);
    db.finish().await;
}

#[tokio::test]
async fn repair_waits_its_turn_while_another_pass_holds_the_lock() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "t", None).await;
    claim(&c, 1, "w1", 30).await;
    expire_leases(&c).await;
    let other = db.client().await;
    other.batch_execute("BEGIN").await.unwrap();
    assert_eq!(repair(&other).await, (1, 0));
    assert_eq!(
        repair(&c).await,
        (0, 0),
        "another pass is running (uncommitted)"
    );
    other.batch_execute("COMMIT").await.unwrap();
    claim(&c, 1, "w1", 30).await;
    expire_leases(&c).await;
    assert_eq!(repair(&c).await, (1, 0));
    db.finish().await;
}

#[tokio::test]
async fn a_completion_holding_the_row_is_never_overwritten_by_repair() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = enqueue(&c, "t", None).await;
    let m = claim(&c, 1, "w1", 1).await.pop().unwrap();
    let worker = db.client().await;
    worker.batch_execute("BEGIN").await.unwrap();
    complete(&worker, &m, "w1", "DISPATCHED", None)
        .await
        .unwrap();
    // The sleep is the behaviour: the lease runs out while the completion is uncommitted.
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    assert_eq!(
        repair(&c).await,
        (0, 0),
        "repair skips the row the completion holds"
    );
    worker.batch_execute("COMMIT").await.unwrap();
    assert_eq!(repair(&c).await, (0, 0));
    assert_eq!(history(&c, id).await, ["1:DISPATCHED"]);
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.messages").await, 0);
    db.finish().await;
}

#[tokio::test]
async fn a_completion_waiting_on_repair_is_refused_after_repair_commits() {
    // The worker's transaction began while its lease was live (so its now() still sees
    // the lease valid); repair, started after the expiry, locks and requeues the row first.
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = enqueue(&c, "t", None).await;
    let m = claim(&c, 1, "w1", 1).await.pop().unwrap();
    let worker = db.client().await;
    worker.batch_execute("BEGIN").await.unwrap();
    // The sleep is the behaviour: the lease runs out.
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    let janitor = db.client().await;
    janitor.batch_execute("BEGIN").await.unwrap();
    assert_eq!(repair(&janitor).await, (1, 0));

    let completing = backend_pid(&worker).await;
    let pending = tokio::spawn(async move {
        let r = complete(&worker, &m, "w1", "DISPATCHED", None).await;
        sqlstate(r).0
    });
    until_waiting_for_a_lock(&c, completing, "the completion to wait for a lock").await;
    assert!(
        !pending.is_finished(),
        "the completion waits for repair's row lock"
    );
    janitor.batch_execute("COMMIT").await.unwrap();
    assert_eq!(pending.await.unwrap(), "P7002");
    assert_eq!(history(&c, id).await, ["1:ZOMBIE_REQUEUE"]);
    db.finish().await;
}

/// One pass handles at most its limit of expired leases, the rest in the next pass, and in
/// the same pass moves up a message left below its shard's claim floor; a live lease is
/// left alone.
#[tokio::test]
async fn one_pass_requeues_up_to_its_limit_and_lifts_what_lies_below_a_floor() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for _ in 0..5 {
        enqueue(&c, "t", None).await;
    }
    let claimed = claim(&c, 5, "w1", 30).await;
    assert_eq!(claimed.len(), 5);
    expire_leases(&c).await;
    // One of them is live again (as if extended before it ran out).
    let renewed = &claimed[0];
    c.execute(
        "UPDATE outbox.messages SET lease_expires_at = now() + interval '30 seconds' \
         WHERE outbox_id = $1",
        &[&renewed.id],
    )
    .await
    .unwrap();
    // A message stranded below its floor (the floors raised past it by hand).
    let stranded: Uuid = c
        .query_one(
            "INSERT INTO outbox.messages (topic, payload, available_at) \
             VALUES ('t', '\\x00', now() - interval '1 hour') RETURNING outbox_id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    c.batch_execute(
        "SELECT setval(format('outbox.claim_floor_%s', s)::regclass, \
                       (extract(epoch FROM now() - interval '1 minute') * 1000000)::bigint) \
           FROM generate_series(0, 15) AS s",
    )
    .await
    .unwrap();
    let pass = |limit: i32| {
        let c = &c;
        async move {
            let r = c
                .query_one("SELECT * FROM outbox.repair_expired_leases($1)", &[&limit])
                .await
                .unwrap();
            (r.get::<_, i32>(0), r.get::<_, i32>(1))
        }
    };
    assert_eq!(pass(3).await, (3, 0), "the first pass stops at its limit");
    let below: bool = c
        .query_one(
            "SELECT available_at < now() - interval '30 minutes' FROM outbox.messages \
             WHERE outbox_id = $1",
            &[&stranded],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        !below,
        "the stranded message was not moved up in the same pass"
    );
    assert_eq!(pass(3).await, (1, 0), "the second pass takes the one left");
    assert_eq!(pass(3).await, (0, 0));
    for m in &claimed[1..] {
        assert_eq!(history(&c, m.id).await, ["1:ZOMBIE_REQUEUE"]);
    }
    assert!(
        history(&c, renewed.id).await.is_empty(),
        "a renewed lease was requeued"
    );
    db.finish().await;
}

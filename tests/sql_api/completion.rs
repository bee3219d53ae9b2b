//! Completion and the other lease fences (`complete_outbox_attempt`, `complete_outbox_batch`,
//! `extend_outbox_leases`, `release_outbox_leases`): a wrong worker, token or expired lease
//! is refused and writes nothing, a batch reports its lost leases row by row, retries wait
//! their time, attempts are written in the order given, and a row with a reused id fails
//! nothing for the others.

use super::*;

#[tokio::test]
async fn wrong_worker_wrong_token_and_expired_lease_are_fenced_and_write_nothing() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "t", None).await;
    let m = claim(&c, 1, "w1", 30).await.pop().unwrap();

    let (code, msg) = sqlstate(complete(&c, &m, "w2", "DISPATCHED", None).await);
    assert_eq!(code, "P7002", "{msg}");
    assert!(msg.contains("LEASE_LOST"), "{msg}");

    let wrong_token = Claimed {
        token: Uuid::new_v4(),
        ..m.clone()
    };
    let (code, _) = sqlstate(complete(&c, &wrong_token, "w1", "DISPATCHED", None).await);
    assert_eq!(code, "P7002");

    c.execute(
        "UPDATE outbox.messages SET lease_expires_at = now() - interval '1 second'",
        &[],
    )
    .await
    .unwrap();
    let (code, _) = sqlstate(complete(&c, &m, "w1", "DISPATCHED", None).await);
    assert_eq!(code, "P7002", "an expired lease cannot be completed");

    assert_eq!(count(&c, "SELECT count(*) FROM outbox.attempts").await, 0);
    let still: (String, Uuid) = c
        .query_one("SELECT claimed_by, lease_token FROM outbox.messages", &[])
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(
        still,
        ("w1".to_owned(), m.token),
        "the fenced calls changed nothing"
    );
    db.finish().await;
}

#[tokio::test]
async fn a_retry_in_the_future_is_not_claimable_early() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = enqueue(&c, "t", None).await;
    let m = claim(&c, 1, "w1", 30).await.pop().unwrap();
    assert_eq!(retry_at(&c, &m, "w1", 3600.0).await, 1);

    assert!(
        claim(&c, 10, "w1", 30).await.is_empty(),
        "retry is an hour away"
    );
    let row = c
        .query_one(
            "SELECT lease_token IS NULL, attempt_count, last_error, available_at > now() \
             FROM outbox.messages",
            &[],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0));
    assert_eq!(row.get::<_, i32>(1), 1);
    assert_eq!(
        row.get::<_, Option<String>>(2).as_deref(),
        Some("try later")
    );
    assert!(row.get::<_, bool>(3));

    c.execute("UPDATE outbox.messages SET available_at = now()", &[])
        .await
        .unwrap();
    let again = claim(&c, 10, "w2", 30).await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].attempt_no, 2);
    complete(&c, &again[0], "w2", "DISPATCHED", None)
        .await
        .unwrap();
    assert_eq!(history(&c, id).await, ["1:RETRYABLE", "2:DISPATCHED"]);
    db.finish().await;
}

#[tokio::test]
async fn batch_completion_reports_a_lost_lease_and_applies_the_others() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for _ in 0..3 {
        enqueue(&c, "t", None).await;
    }
    let batch = claim(&c, 3, "w1", 30).await;
    let ids: Vec<Uuid> = batch.iter().map(|m| m.id).collect();
    let mut tokens: Vec<Uuid> = batch.iter().map(|m| m.token).collect();
    tokens[1] = Uuid::new_v4(); // a stale token for the middle message

    let rows = c
        .query(
            "SELECT outbox_id, attempt_no, lease_lost FROM outbox.complete_outbox_batch(\
             'w1', $1, $2, ARRAY['DISPATCHED', 'DISPATCHED', 'FAILED']::outbox.attempt_state[], \
             ARRAY[NULL, NULL, 'rejected: bad payload'], NULL)",
            &[&ids, &tokens],
        )
        .await
        .unwrap();
    let got: Vec<(Uuid, Option<i32>, bool)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        got,
        vec![
            (ids[0], Some(1), false),
            (ids[1], None, true),
            (ids[2], Some(1), false)
        ],
        "one row per input, in input order"
    );
    assert_eq!(history(&c, ids[0]).await, ["1:DISPATCHED"]);
    assert!(
        history(&c, ids[1]).await.is_empty(),
        "lost lease: nothing written"
    );
    assert_eq!(history(&c, ids[2]).await, ["1:FAILED"]);
    let remaining: Vec<Uuid> = c
        .query("SELECT outbox_id FROM outbox.messages", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        remaining,
        vec![ids[1]],
        "the fenced message is still leased, untouched"
    );
    let dead: String = c
        .query_one("SELECT last_error FROM outbox.dead_letters", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(dead, "rejected: bad payload");
    db.finish().await;
}

/// A completion that reports every message delivered deletes them with its fence (V18):
/// the same per-row checks as the fence of any other completion (token, worker, unexpired
/// lease), results in the call's order, and every attempt written, a reused id's under the
/// next free number.
#[tokio::test]
async fn a_delivered_batch_is_fenced_row_by_row_by_its_deletion() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // An id whose attempt 1 was written in an earlier life, pending again (as rows written
    // before enqueue refused reused ids are).
    let reused = Uuid::new_v4();
    enqueue_id(&c, reused, None).await.unwrap();
    let first = claim(&c, 1, "w", 30).await;
    complete(&c, &first[0], "w", "DISPATCHED", None)
        .await
        .unwrap();
    c.batch_execute(&format!(
        "INSERT INTO outbox.messages (outbox_id, topic, payload) VALUES ('{reused}', 't', '\\x00')"
    ))
    .await
    .unwrap();
    for _ in 0..4 {
        enqueue(&c, "t", None).await;
    }
    let batch = claim(&c, 10, "w", 30).await;
    assert_eq!(batch.len(), 5);
    let ids: Vec<Uuid> = batch.iter().map(|m| m.id).collect();
    let mut tokens: Vec<Uuid> = batch.iter().map(|m| m.token).collect();
    let stale = ids.iter().position(|id| *id != reused).unwrap();
    tokens[stale] = Uuid::new_v4();
    let expired = (0..5).find(|&i| i != stale && ids[i] != reused).unwrap();
    c.execute(
        "UPDATE outbox.messages SET lease_expires_at = now() - interval '1 second' \
         WHERE outbox_id = $1",
        &[&ids[expired]],
    )
    .await
    .unwrap();
    let taken = (0..5)
        .find(|&i| i != stale && i != expired && ids[i] != reused)
        .unwrap();
    c.execute(
        "UPDATE outbox.messages SET claimed_by = 'someone-else' WHERE outbox_id = $1",
        &[&ids[taken]],
    )
    .await
    .unwrap();

    let delivered = "SELECT outbox_id, lease_lost, dead_lettered FROM outbox.complete_outbox_batch(\
                     'w', $1, $2, array_fill('DISPATCHED'::outbox.attempt_state, ARRAY[5]), NULL, NULL)";
    // Tokens listed with each other's ids: a caller's mix-up, refused, nothing deleted.
    let fenced = |i: usize| [stale, expired, taken].contains(&i);
    let live: Vec<usize> = (0..5).filter(|&i| !fenced(i)).collect();
    let mut mixed = tokens.clone();
    mixed.swap(live[0], live[1]);
    let (code, message) = sqlstate(c.query(delivered, &[&ids, &mixed]).await);
    assert_eq!(code, "P7001", "{message}");
    assert!(message.contains("p_lease_tokens"), "{message}");
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.messages").await, 5);

    let rows = c.query(delivered, &[&ids, &tokens]).await.unwrap();
    let got: Vec<(Uuid, bool, bool)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let want: Vec<(Uuid, bool, bool)> = (0..5).map(|i| (ids[i], fenced(i), false)).collect();
    assert_eq!(got, want, "one row per input, in input order");

    assert_eq!(history(&c, reused).await, ["1:DISPATCHED", "2:DISPATCHED"]);
    for (i, id) in ids.iter().enumerate() {
        let pending = count(
            &c,
            &format!("SELECT count(*) FROM outbox.messages WHERE outbox_id = '{id}'"),
        )
        .await;
        if fenced(i) {
            assert!(history(&c, *id).await.is_empty(), "fenced: nothing written");
            assert_eq!(pending, 1, "fenced: still pending, untouched");
        } else {
            assert_eq!(pending, 0, "delivered: deleted");
            if *id != reused {
                assert_eq!(history(&c, *id).await, ["1:DISPATCHED"]);
            }
        }
    }
    db.finish().await;
}

#[tokio::test]
async fn a_row_with_a_reused_id_fails_no_completion_repair_or_replay_for_the_others() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // Rows as an id reused before enqueue refused it leaves them: a pending message whose
    // id already has attempt 1, and another whose id is also a dead letter.
    let (reused, twice_dead, normal) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    for id in [reused, twice_dead, normal] {
        enqueue_id(&c, id, None).await.unwrap();
    }
    let first = claim(&c, 3, "w", 30).await;
    for m in &first {
        let state = if m.id == twice_dead {
            "FAILED"
        } else {
            "DISPATCHED"
        };
        complete(&c, m, "w", state, None).await.unwrap();
    }
    c.batch_execute(&format!(
        "INSERT INTO outbox.messages (outbox_id, topic, payload) VALUES \
         ('{reused}', 't', '\\x00'), ('{twice_dead}', 't', '\\x00');"
    ))
    .await
    .unwrap();
    let others: Vec<Uuid> = [enqueue(&c, "t", None).await, enqueue(&c, "t", None).await].into();

    // A batch completion with the reused id in it applies every row.
    let batch = claim(&c, 10, "w", 30).await;
    assert_eq!(batch.len(), 4);
    let states: Vec<&str> = batch
        .iter()
        .map(|m| {
            if m.id == twice_dead {
                "FAILED"
            } else {
                "RETRYABLE"
            }
        })
        .collect();
    let ids: Vec<Uuid> = batch.iter().map(|m| m.id).collect();
    let tokens: Vec<Uuid> = batch.iter().map(|m| m.token).collect();
    let lost: Vec<bool> = c
        .query(
            "SELECT lease_lost FROM outbox.complete_outbox_batch('w', $1, $2, $3::text[]::outbox.attempt_state[], NULL, NULL)",
            &[&ids, &tokens, &states],
        )
        .await
        .expect("the batch completes")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(lost, [false; 4]);
    assert_eq!(history(&c, reused).await, ["1:DISPATCHED", "2:RETRYABLE"]);
    for id in &others {
        assert_eq!(history(&c, *id).await, ["1:RETRYABLE"]);
    }
    // The second life of twice_dead is parked in messages, not lost, not dead-lettered over
    // the first.
    let parked: String = c
        .query_one(
            "SELECT last_error FROM outbox.messages WHERE outbox_id = $1 AND available_at = 'infinity'",
            &[&twice_dead],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        parked.contains("a dead letter with this id exists"),
        "{parked}"
    );

    // Repair with the reused id among the expired leases requeues them all.
    c.batch_execute(
        "UPDATE outbox.messages SET available_at = now() WHERE available_at <> 'infinity'",
    )
    .await
    .unwrap();
    assert_eq!(claim(&c, 10, "w", 30).await.len(), 3);
    expire_leases(&c).await;
    assert_eq!(repair(&c).await, (3, 0));
    assert_eq!(
        history(&c, reused).await,
        ["1:DISPATCHED", "2:RETRYABLE", "3:ZOMBIE_REQUEUE"]
    );

    // Replay with a dead letter whose id is pending replays the others and keeps that one.
    let dead_other = others[0];
    let m = claim(&c, 10, "w", 30)
        .await
        .into_iter()
        .find(|m| m.id == dead_other)
        .unwrap();
    complete(&c, &m, "w", "FAILED", Some("bad")).await.unwrap();
    let replayed: i32 = c
        .query_one("SELECT outbox.replay_dead_letters()", &[])
        .await
        .expect("replay succeeds")
        .get(0);
    assert_eq!(replayed, 1, "the other dead letter is replayed");
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.dead_letters").await,
        1,
        "the clashing dead letter stays"
    );
    db.finish().await;
}

#[tokio::test]
async fn a_completion_writes_its_attempts_in_the_order_it_was_given() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // A key's messages enqueued with ids that sort the other way round.
    let mut ids: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    ids.sort();
    ids.reverse();
    for id in &ids {
        enqueue_id(&c, *id, Some("k")).await.unwrap();
    }
    let run = claim_texts(&c, 10).await;
    assert_eq!(
        run.iter().map(|m| m.2).collect::<Vec<_>>(),
        ids,
        "the run comes in enqueue order"
    );
    complete_all(&c, &run, &["DISPATCHED"; 5]).await;
    let written: Vec<Uuid> = c
        .query(
            "SELECT outbox_id FROM outbox.attempts ORDER BY created_at",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        written, ids,
        "attempts are written in the order the completion listed them, not in id order"
    );
    db.finish().await;
}

#[tokio::test]
async fn extend_keeps_a_lease_alive_past_its_first_expiry() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = enqueue(&c, "t", None).await;
    let m = claim(&c, 1, "w1", 1).await.pop().unwrap();
    let extended = c
        .query(
            "SELECT outbox_id, lease_expires_at > now() + interval '20 seconds' \
             FROM outbox.extend_outbox_leases('w1', ARRAY[$1::uuid], ARRAY[$2::uuid], 30)",
            &[&m.id, &m.token],
        )
        .await
        .unwrap();
    assert_eq!(extended.len(), 1);
    assert!(extended[0].get::<_, bool>(1));

    // The sleep is the behaviour: the original one-second lease runs out.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert_eq!(
        repair(&c).await,
        (0, 0),
        "the extended lease is not expired"
    );
    assert_eq!(complete(&c, &m, "w1", "DISPATCHED", None).await.unwrap(), 1);
    assert_eq!(history(&c, id).await, ["1:DISPATCHED"]);

    // Extending a lease that is not held returns nothing.
    let none = c
        .query(
            "SELECT * FROM outbox.extend_outbox_leases('w1', ARRAY[$1::uuid], ARRAY[$2::uuid], 30)",
            &[&m.id, &m.token],
        )
        .await
        .unwrap();
    assert!(none.is_empty());
    db.finish().await;
}

#[tokio::test]
async fn release_gives_messages_back_without_counting_an_attempt() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "t", None).await;
    enqueue(&c, "t", None).await;
    let batch = claim(&c, 2, "w1", 30).await;
    let ids: Vec<Uuid> = batch.iter().map(|m| m.id).collect();
    let tokens: Vec<Uuid> = batch.iter().map(|m| m.token).collect();

    let by_other: i32 = c
        .query_one(
            "SELECT outbox.release_outbox_leases('w2', $1, $2)",
            &[&ids, &tokens],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(by_other, 0, "another worker cannot release w1's leases");
    let released: i32 = c
        .query_one(
            "SELECT outbox.release_outbox_leases('w1', $1, $2)",
            &[&ids, &tokens],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(released, 2);
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.attempts").await, 0);

    let again = claim(&c, 10, "w2", 30).await;
    assert_eq!(again.len(), 2);
    assert!(
        again.iter().all(|m| m.attempt_no == 1),
        "no attempt was counted"
    );
    let (code, _) = sqlstate(complete(&c, &batch[0], "w1", "DISPATCHED", None).await);
    assert_eq!(code, "P7002", "the released token is dead");
    db.finish().await;
}

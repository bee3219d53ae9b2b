//! The SQL contract of DESIGN §3, exercised the way any language would: plain SQL calls to
//! the `outbox.*` functions on a real Postgres.

mod common;

use std::collections::HashSet;

use common::{TestDb, sqlstate};
use tokio_postgres::Client;
use uuid::Uuid;

#[derive(Clone)]
struct Claimed {
    id: Uuid,
    token: Uuid,
    attempt_no: i32,
    key: Option<String>,
}

async fn enqueue(c: &Client, topic: &str, key: Option<&str>) -> Uuid {
    c.query_one(
        "SELECT outbox.enqueue($1, '{\"n\": 1}'::jsonb, $2)",
        &[&topic, &key],
    )
    .await
    .unwrap()
    .get(0)
}

async fn enqueue_with(c: &Client, key: Option<&str>, max_attempts: i32) -> Uuid {
    c.query_one(
        "SELECT outbox.enqueue('t', '{}'::jsonb, $1, p_max_attempts => $2)",
        &[&key, &max_attempts],
    )
    .await
    .unwrap()
    .get(0)
}

async fn claim(c: &Client, n: i32, worker: &str, lease_secs: i32) -> Vec<Claimed> {
    c.query(
        "SELECT outbox_id, lease_token, attempt_no, message_key \
         FROM outbox.claim_outbox_batch($1, $2, $3)",
        &[&n, &worker, &lease_secs],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| Claimed {
        id: r.get(0),
        token: r.get(1),
        attempt_no: r.get(2),
        key: r.get(3),
    })
    .collect()
}

async fn complete(
    c: &Client,
    m: &Claimed,
    worker: &str,
    state: &str,
    error: Option<&str>,
) -> Result<i32, tokio_postgres::Error> {
    c.query_one(
        "SELECT outbox.complete_outbox_attempt($1, $2, $3, $4::text::outbox.attempt_state, $5)",
        &[&m.id, &m.token, &worker, &state, &error],
    )
    .await
    .map(|r| r.get(0))
}

async fn retry_at(c: &Client, m: &Claimed, worker: &str, delay_secs: f64) -> i32 {
    c.query_one(
        "SELECT outbox.complete_outbox_attempt($1, $2, $3, 'RETRYABLE', 'try later', \
         now() + make_interval(secs => $4))",
        &[&m.id, &m.token, &worker, &delay_secs],
    )
    .await
    .unwrap()
    .get(0)
}

/// "attempt_no:STATE" of every attempt of `id`, in order.
async fn history(c: &Client, id: Uuid) -> Vec<String> {
    c.query(
        "SELECT attempt_no, state::text FROM outbox.attempts WHERE outbox_id = $1 ORDER BY attempt_no",
        &[&id],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| format!("{}:{}", r.get::<_, i32>(0), r.get::<_, String>(1)))
    .collect()
}

async fn count(c: &Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).await.unwrap().get(0)
}

async fn expire_leases(c: &Client) {
    c.execute(
        "UPDATE outbox.messages SET lease_expires_at = now() - interval '1 minute' \
         WHERE lease_token IS NOT NULL",
        &[],
    )
    .await
    .unwrap();
}

async fn repair(c: &Client) -> (i32, i32) {
    let r = c
        .query_one("SELECT * FROM outbox.repair_expired_leases()", &[])
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

#[tokio::test]
async fn happy_path_claims_completes_and_records_one_attempt() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = enqueue(&c, "orders", Some("customer-1")).await;

    let row = c
        .query_one("SELECT * FROM outbox.claim_outbox_batch(10, 'w1', 30)", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, Uuid>("outbox_id"), id);
    assert_eq!(row.get::<_, String>("topic"), "orders");
    assert_eq!(
        row.get::<_, Option<String>>("message_key").as_deref(),
        Some("customer-1")
    );
    assert_eq!(row.get::<_, Vec<u8>>("payload"), br#"{"n": 1}"#);
    assert_eq!(row.get::<_, String>("content_type"), "application/json");
    assert_eq!(row.get::<_, i32>("attempt_no"), 1);
    let leased = c
        .query_one(
            "SELECT claimed_by, lease_token, lease_expires_at > now() + interval '25 seconds' \
             FROM outbox.messages WHERE outbox_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(leased.get::<_, String>(0), "w1");
    assert_eq!(leased.get::<_, Uuid>(1), row.get::<_, Uuid>("lease_token"));
    assert!(
        leased.get::<_, bool>(2),
        "lease must run for the requested 30 s"
    );

    let m = Claimed {
        id,
        token: row.get("lease_token"),
        attempt_no: 1,
        key: None,
    };
    assert_eq!(complete(&c, &m, "w1", "DISPATCHED", None).await.unwrap(), 1);
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.messages").await, 0);
    assert_eq!(history(&c, id).await, ["1:DISPATCHED"]);
    let attempt = c
        .query_one("SELECT worker_id, lease_token FROM outbox.attempts", &[])
        .await
        .unwrap();
    assert_eq!(attempt.get::<_, String>(0), "w1");
    assert_eq!(attempt.get::<_, Uuid>(1), m.token);
    db.finish().await;
}

#[tokio::test]
async fn claim_gives_each_message_a_fresh_token_and_skips_leased_and_delayed_ones() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for _ in 0..3 {
        enqueue(&c, "t", None).await;
    }
    c.execute(
        "SELECT outbox.enqueue('t', '{}'::jsonb, p_available_at => now() + interval '1 hour')",
        &[],
    )
    .await
    .unwrap();
    let first = claim(&c, 2, "w1", 30).await;
    assert_eq!(first.len(), 2);
    assert_ne!(first[0].token, first[1].token);
    let second = claim(&c, 10, "w2", 30).await;
    assert_eq!(
        second.len(),
        1,
        "one ready message left; the delayed one is not claimable"
    );
    assert!(claim(&c, 10, "w3", 30).await.is_empty());
    db.finish().await;
}

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

#[tokio::test]
async fn per_key_order_holds_through_a_retry_of_the_head() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // a2 and a3 on another topic than a1, so that no run follows a1 (a run stays on its
    // head's topic; runs: see a_claim_returns_a_run_of_a_key_in_order_in_the_room_the_heads_leave).
    let a1 = enqueue(&c, "t", Some("a")).await;
    let a2 = enqueue(&c, "u", Some("a")).await;
    let a3 = enqueue(&c, "u", Some("a")).await;
    let b1 = enqueue(&c, "t", Some("b")).await;
    let free = enqueue(&c, "t", None).await;

    let batch = claim(&c, 100, "w1", 30).await;
    let got: HashSet<Uuid> = batch.iter().map(|m| m.id).collect();
    assert_eq!(
        got,
        HashSet::from([a1, b1, free]),
        "the heads first: of each key, and unkeyed messages"
    );
    assert!(
        claim(&c, 100, "w2", 30).await.is_empty(),
        "a2 waits while a1 is leased"
    );

    // The head of `a` fails and is scheduled for later: a2 must still wait for it.
    let head = batch.iter().find(|m| m.id == a1).unwrap();
    retry_at(&c, head, "w1", 3600.0).await;
    assert!(
        claim(&c, 100, "w2", 30).await.is_empty(),
        "a2 waits for a1's retry"
    );

    c.execute(
        "UPDATE outbox.messages SET available_at = now() WHERE outbox_id = $1",
        &[&a1],
    )
    .await
    .unwrap();
    let retried = claim(&c, 1, "w2", 30).await;
    assert_eq!(retried.iter().map(|m| m.id).collect::<Vec<_>>(), [a1]);
    assert_eq!(retried[0].key.as_deref(), Some("a"));
    complete(&c, &retried[0], "w2", "DISPATCHED", None)
        .await
        .unwrap();

    let next = claim(&c, 1, "w2", 30).await;
    assert_eq!(next.iter().map(|m| m.id).collect::<Vec<_>>(), [a2]);
    complete(&c, &next[0], "w2", "DISPATCHED", None)
        .await
        .unwrap();
    let last = claim(&c, 1, "w2", 30).await;
    assert_eq!(last.iter().map(|m| m.id).collect::<Vec<_>>(), [a3]);
    db.finish().await;
}

#[tokio::test]
async fn a_delayed_head_blocks_its_key_but_not_other_keys() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.execute(
        "SELECT outbox.enqueue('t', '{}'::jsonb, 'a', p_available_at => now() + interval '1 hour')",
        &[],
    )
    .await
    .unwrap();
    enqueue(&c, "t", Some("a")).await;
    let b = enqueue(&c, "t", Some("b")).await;
    let got: Vec<Uuid> = claim(&c, 10, "w1", 30).await.iter().map(|m| m.id).collect();
    assert_eq!(got, [b]);
    db.finish().await;
}

#[tokio::test]
async fn retries_dead_letter_at_max_attempts_and_replay_gives_a_fresh_budget() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = enqueue_with(&c, Some("k"), 2).await;
    let behind = enqueue_with(&c, Some("k"), 2).await;

    let m = claim(&c, 1, "w1", 30).await.pop().unwrap();
    complete(&c, &m, "w1", "RETRYABLE", Some("timeout 1"))
        .await
        .unwrap();
    let m = claim(&c, 1, "w1", 30).await.pop().unwrap();
    assert_eq!((m.id, m.attempt_no), (id, 2));
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
async fn no_login_without_the_owner_rights_can_hold_up_a_claim_or_a_repair() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute("SET statement_timeout = '5s'")
        .await
        .unwrap();
    for (suffix, role) in [
        ("reader", Some("outbox_reader")),
        ("producer", Some("outbox_producer")),
        ("nobody", None),
    ] {
        let hostile = common::connect(&db.login(suffix, role).await)
            .await
            .unwrap();
        for sql in [
            "LOCK TABLE outbox.turns IN ACCESS EXCLUSIVE MODE",
            "SELECT * FROM outbox.turns FOR UPDATE",
            "SELECT * FROM outbox.turns FOR KEY SHARE",
            "LOCK TABLE outbox.messages IN ACCESS SHARE MODE",
        ] {
            let (code, _) = sqlstate(hostile.batch_execute(&format!("BEGIN; {sql}")).await);
            assert_eq!(code, "42501", "{suffix} must not run {sql}");
            hostile.batch_execute("ROLLBACK").await.unwrap();
        }
        // What stopped delivery before: holding the advisory keys claims and repair used.
        hostile
            .batch_execute(
                "BEGIN; SELECT pg_advisory_xact_lock(hashtext('outbox.claim_outbox_batch')), \
                 pg_advisory_xact_lock(hashtext('outbox.repair_expired_leases'))",
            )
            .await
            .unwrap();
        enqueue(&c, "t", None).await;
        let m = claim(&c, 1, "w1", 30).await;
        assert_eq!(m.len(), 1, "{suffix} held up a claim");
        expire_leases(&c).await;
        assert_eq!(repair(&c).await, (1, 0), "{suffix} held up a repair");
        let m = claim(&c, 1, "w1", 30).await.pop().unwrap();
        complete(&c, &m, "w1", "DISPATCHED", None).await.unwrap();
        drop(hostile);
        db.drop_login(suffix).await;
    }
    db.finish().await;
}

#[tokio::test]
async fn a_claim_that_holds_its_shards_does_not_hold_up_claims_of_the_others() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for _ in 0..200 {
        enqueue(&c, "t", None).await;
    }
    // A claim that has not ended (as a slow one would not have): it holds the turns of the
    // shards it took its messages from.
    let slow = db.client().await;
    slow.batch_execute("BEGIN").await.unwrap();
    let held: HashSet<Uuid> = claim(&slow, 20, "slow", 30)
        .await
        .iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(held.len(), 20);

    // Another claim is not held up, and takes the messages of the other shards (those left
    // in the slow claim's shards wait for its end).
    c.batch_execute("SET statement_timeout = '5s'")
        .await
        .unwrap();
    let other = claim(&c, 200, "fast", 30).await;
    assert!(other.len() >= 100, "{} claimed", other.len());
    assert!(other.iter().all(|m| !held.contains(&m.id)));
    slow.batch_execute("COMMIT").await.unwrap();
    let rest = claim(&c, 200, "fast", 30).await;
    assert_eq!(held.len() + other.len() + rest.len(), 200);

    // With every shard's turn taken, a claim waits for one: the turns still keep claims
    // from walking a shard together.
    for _ in 0..10 {
        enqueue(&c, "t", None).await;
    }
    let owner = db.client().await;
    owner
        .batch_execute("BEGIN; SELECT * FROM outbox.turns WHERE name LIKE 'claim:%' FOR UPDATE")
        .await
        .unwrap();
    c.batch_execute("SET statement_timeout = '500ms'")
        .await
        .unwrap();
    let (code, _) = sqlstate(
        c.query("SELECT * FROM outbox.claim_outbox_batch(10, 'w', 30)", &[])
            .await,
    );
    assert_eq!(
        code, "57014",
        "the claim waited for a turn until the timeout"
    );
    owner.batch_execute("COMMIT").await.unwrap();
    assert_eq!(claim(&c, 10, "w", 30).await.len(), 10);
    db.finish().await;
}

#[tokio::test]
async fn no_shard_waits_behind_the_backlog_of_the_others() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // The oldest message, in the last shard, then 10,000 newer ones spread over all 16: a
    // claim of 10 fills from the first shard it visits, so claims that visited the shards
    // in a fixed order would take the other 15 shards' 9,400 or so first (the 400 claims
    // allowed below take 4,000).
    let key: String = c
        .query_one(
            "SELECT k FROM generate_series(1, 1000) AS i, LATERAL (SELECT 'old-' || i AS k) AS x \
             WHERE (hashtext(k) & 15) = 15 ORDER BY i LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let old = enqueue(&c, "t", Some(&key)).await;
    c.batch_execute("SELECT outbox.enqueue('t', '{}'::jsonb) FROM generate_series(1, 10000)")
        .await
        .unwrap();
    // A claim starts at a random shard, so the old message's shard is the first visited by
    // one claim in 16: missing it 400 times in a row has a chance of about 1 in 10^11.
    let mut claims = 0;
    loop {
        let batch = claim(&c, 10, "w", 300).await;
        assert_eq!(batch.len(), 10);
        claims += 1;
        if batch.iter().any(|m| m.id == old) {
            break;
        }
        assert!(
            claims < 400,
            "the oldest message was not claimed in {claims} claims"
        );
    }
    db.finish().await;
}

#[tokio::test]
async fn a_claim_passes_a_held_shard_without_reading_its_leased_messages() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // 3,000 messages in shard 0 (each the only one of its key, so each is a head), all
    // leased, and one ready message in shard 7.
    let in_shard = |shard: i32, n: i64| {
        format!(
            "SELECT outbox.enqueue('t', '{{}}'::jsonb, k) \
               FROM (SELECT 'k' || i AS k FROM generate_series(1, 1000000) AS i \
                      WHERE (hashtext('k' || i) & 15) = {shard} LIMIT {n}) AS x"
        )
    };
    c.batch_execute(&in_shard(0, 3000)).await.unwrap();
    assert_eq!(claim(&c, 5000, "first", 300).await.len(), 3000);
    c.batch_execute(&in_shard(7, 1)).await.unwrap();

    // Another claim holds shard 0's turn. A claim of 10 has room after shard 7, so it
    // reaches shard 0 wherever it starts, and must pass it at the cost of one index entry
    // instead of reading its 3,000 leased messages.
    let owner = db.client().await;
    owner
        .batch_execute("BEGIN; SELECT * FROM outbox.turns WHERE name = 'claim:0' FOR UPDATE")
        .await
        .unwrap();
    // The index's counts since this session last reported them: report them now, then
    // read what the claim alone adds.
    c.batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    c.batch_execute("BEGIN").await.unwrap();
    let got = claim(&c, 10, "second", 300).await;
    let read: i64 = c
        .query_one(
            "SELECT pg_stat_get_xact_tuples_returned('outbox.messages_shard_heads_idx'::regclass)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    c.batch_execute("COMMIT").await.unwrap();
    owner.batch_execute("COMMIT").await.unwrap();
    assert_eq!(got.len(), 1, "the message of shard 7");
    assert!(
        read < 100,
        "the claim read {read} entries of the shards' index"
    );
    db.finish().await;
}

async fn enqueue_id(
    c: &Client,
    id: Uuid,
    key: Option<&str>,
) -> Result<Uuid, tokio_postgres::Error> {
    c.query_one(
        "SELECT outbox.enqueue('t', '{}'::jsonb, $2, p_outbox_id => $1)",
        &[&id, &key],
    )
    .await
    .map(|r| r.get(0))
}

#[tokio::test]
async fn enqueue_refuses_an_id_that_was_delivered_or_dead_lettered_naming_it() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let (delivered, dead) = (Uuid::new_v4(), Uuid::new_v4());
    enqueue_id(&c, delivered, None).await.unwrap();
    enqueue_id(&c, dead, None).await.unwrap();
    let batch = claim(&c, 2, "w", 30).await;
    let by_id = |id| batch.iter().find(|m| m.id == id).unwrap();
    complete(&c, by_id(delivered), "w", "DISPATCHED", None)
        .await
        .unwrap();
    complete(&c, by_id(dead), "w", "FAILED", Some("bad"))
        .await
        .unwrap();

    let (code, message) = sqlstate(enqueue_id(&c, delivered, None).await);
    assert_eq!(code, "23505");
    assert!(
        message.contains(&delivered.to_string()) && message.contains("already delivered"),
        "{message}"
    );
    let (code, message) = sqlstate(enqueue_id(&c, dead, None).await);
    assert_eq!(code, "23505");
    assert!(
        message.contains(&dead.to_string()) && message.contains("dead-lettered"),
        "{message}"
    );
    let pending = enqueue(&c, "t", None).await;
    let (code, message) = sqlstate(enqueue_id(&c, pending, None).await);
    assert_eq!(code, "23505");
    assert!(message.contains("pending"), "{message}");
    assert_eq!(history(&c, delivered).await, ["1:DISPATCHED"]);
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
async fn a_claim_keeps_to_its_byte_budget_and_withholds_oversized_payloads() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // Ids of one claim shard, so that the claim meets the messages in enqueue order.
    let ids: Vec<Uuid> = c
        .query(
            "SELECT id FROM (SELECT gen_random_uuid() AS id FROM generate_series(1, 500)) AS g \
              WHERE hashtext(id::text) & 15 = 0 LIMIT 5",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for (size, id) in [600, 600, 600, 5000, 10].into_iter().zip(&ids) {
        c.execute(
            "SELECT outbox.enqueue('t', decode(repeat('ab', $1), 'hex'), p_outbox_id => $2)",
            &[&size, id],
        )
        .await
        .unwrap();
    }
    let sizes = |rows: Vec<tokio_postgres::Row>| -> Vec<(i64, bool)> {
        let mut sizes: Vec<(i64, bool)> = rows
            .iter()
            .map(|r| (r.get(0), r.get::<_, Option<Vec<u8>>>(1).is_none()))
            .collect();
        sizes.sort_unstable();
        sizes
    };
    let claim_sized = "SELECT payload_bytes, payload FROM outbox.claim_outbox_batch(10, 'w', 30, \
                       p_max_bytes => $1, p_max_message_bytes => $2)";
    // 600 + 600 is within 1000 before the second is added; the third would start past it.
    let first = sizes(c.query(claim_sized, &[&1000_i64, &2000_i64]).await.unwrap());
    assert_eq!(first, [(600, false), (600, false)]);
    // The oversized one comes back without its payload and does not use the budget.
    let second = sizes(c.query(claim_sized, &[&700_i64, &2000_i64]).await.unwrap());
    assert_eq!(second, [(10, false), (600, false), (5000, true)]);
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

    let pending = tokio::spawn(async move {
        let r = complete(&worker, &m, "w1", "DISPATCHED", None).await;
        sqlstate(r).0
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !pending.is_finished(),
        "the completion waits for repair's row lock"
    );
    janitor.batch_execute("COMMIT").await.unwrap();
    assert_eq!(pending.await.unwrap(), "P7002");
    assert_eq!(history(&c, id).await, ["1:ZOMBIE_REQUEUE"]);
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

#[tokio::test]
async fn eight_concurrent_claimers_never_receive_the_same_message_twice() {
    const MESSAGES: i64 = 20_000;
    let db = TestDb::new().await;
    let c = db.client().await;
    c.execute(
        "INSERT INTO outbox.messages (topic, message_key, payload) \
         SELECT 't', CASE WHEN i % 10 = 0 THEN 'k' || (i % 50) END, '\\x7b7d' \
         FROM generate_series(1, $1::bigint) AS i",
        &[&MESSAGES],
    )
    .await
    .unwrap();

    let mut workers = Vec::new();
    for w in 0..8 {
        let client = db.client().await;
        workers.push(tokio::spawn(async move {
            let worker = format!("w{w}");
            let mut seen = Vec::new();
            loop {
                let batch = claim(&client, 100, &worker, 30).await;
                if batch.is_empty() {
                    let left: i64 = count(&client, "SELECT count(*) FROM outbox.messages").await;
                    if left == 0 {
                        return seen;
                    }
                    tokio::task::yield_now().await;
                    continue;
                }
                let ids: Vec<Uuid> = batch.iter().map(|m| m.id).collect();
                let tokens: Vec<Uuid> = batch.iter().map(|m| m.token).collect();
                let lost: i64 = client
                    .query_one(
                        "SELECT count(*) FILTER (WHERE lease_lost) FROM outbox.complete_outbox_batch(\
                         $1, $2, $3, array_fill('DISPATCHED'::outbox.attempt_state, \
                         ARRAY[cardinality($2::uuid[])]), NULL, NULL)",
                        &[&worker, &ids, &tokens],
                    )
                    .await
                    .unwrap()
                    .get(0);
                assert_eq!(lost, 0);
                seen.extend(ids);
            }
        }));
    }
    let mut all = Vec::new();
    let mut per_worker = Vec::new();
    for w in workers {
        let seen = w.await.unwrap();
        per_worker.push(seen.len());
        all.extend(seen);
    }
    let distinct: HashSet<Uuid> = all.iter().copied().collect();
    assert_eq!(
        i64::try_from(all.len()).unwrap(),
        MESSAGES,
        "claims per worker: {per_worker:?}"
    );
    assert_eq!(
        i64::try_from(distinct.len()).unwrap(),
        MESSAGES,
        "a message was claimed twice"
    );
    assert!(
        per_worker.iter().filter(|&&n| n > 0).count() > 1,
        "work was shared: {per_worker:?}"
    );
    assert_eq!(
        count(
            &c,
            "SELECT count(*) FROM outbox.attempts WHERE attempt_no = 1 AND state = 'DISPATCHED'"
        )
        .await,
        MESSAGES
    );
    db.finish().await;
}

#[tokio::test]
async fn invalid_arguments_raise_p7001_naming_the_argument() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = Uuid::new_v4();
    let cases: &[(&str, &str)] = &[
        (
            "SELECT * FROM outbox.claim_outbox_batch(0, 'w1', 30)",
            "p_batch_size",
        ),
        (
            "SELECT * FROM outbox.claim_outbox_batch(-5, 'w1', 30)",
            "p_batch_size",
        ),
        (
            "SELECT * FROM outbox.claim_outbox_batch(10, '', 30)",
            "p_worker_id",
        ),
        (
            "SELECT * FROM outbox.claim_outbox_batch(10, NULL, 30)",
            "p_worker_id",
        ),
        (
            "SELECT * FROM outbox.claim_outbox_batch(10, 'w1', -1)",
            "p_lease_seconds",
        ),
        (
            "SELECT * FROM outbox.claim_outbox_batch(10, 'w1', 0)",
            "p_lease_seconds",
        ),
        (
            "SELECT * FROM outbox.complete_outbox_batch('w1', ARRAY[gen_random_uuid()], \
             ARRAY[gen_random_uuid(), gen_random_uuid()], ARRAY['DISPATCHED']::outbox.attempt_state[], NULL, NULL)",
            "p_lease_tokens",
        ),
        (
            "SELECT * FROM outbox.complete_outbox_batch('w1', ARRAY[gen_random_uuid()], \
             ARRAY[gen_random_uuid()], ARRAY['DISPATCHED', 'FAILED']::outbox.attempt_state[], NULL, NULL)",
            "p_states",
        ),
        (
            "SELECT * FROM outbox.complete_outbox_batch('w1', ARRAY[gen_random_uuid()], \
             ARRAY[gen_random_uuid()], ARRAY['DISPATCHED']::outbox.attempt_state[], ARRAY['a', 'b'], NULL)",
            "p_errors",
        ),
        (
            "SELECT * FROM outbox.complete_outbox_batch('w1', ARRAY[gen_random_uuid()], \
             ARRAY[gen_random_uuid()], ARRAY['ZOMBIE_REQUEUE']::outbox.attempt_state[], NULL, NULL)",
            "p_states",
        ),
        (
            "SELECT * FROM outbox.complete_outbox_batch(' ', ARRAY[gen_random_uuid()], \
             ARRAY[gen_random_uuid()], ARRAY['DISPATCHED']::outbox.attempt_state[], NULL, NULL)",
            "p_worker_id",
        ),
        (
            "SELECT * FROM outbox.complete_outbox_batch('w1', ARRAY[gen_random_uuid()], \
             ARRAY[gen_random_uuid()], ARRAY['DISPATCHED']::outbox.attempt_state[], NULL, ARRAY[now()])",
            "p_retry_ats",
        ),
        (
            "SELECT outbox.complete_outbox_attempt(gen_random_uuid(), gen_random_uuid(), 'w1', 'ZOMBIE_REQUEUE')",
            "p_state",
        ),
        (
            "SELECT outbox.complete_outbox_attempt(gen_random_uuid(), gen_random_uuid(), 'w1', 'FAILED', 'x', now())",
            "p_retry_at",
        ),
        (
            "SELECT outbox.complete_outbox_attempt(gen_random_uuid(), gen_random_uuid(), '', 'DISPATCHED')",
            "p_worker_id",
        ),
        (
            "SELECT * FROM outbox.extend_outbox_leases('w1', ARRAY[gen_random_uuid()], ARRAY[gen_random_uuid()], -1)",
            "p_lease_seconds",
        ),
        (
            "SELECT * FROM outbox.extend_outbox_leases('w1', ARRAY[gen_random_uuid()], ARRAY[]::uuid[], 30)",
            "p_lease_tokens",
        ),
        (
            "SELECT outbox.release_outbox_leases('', ARRAY[gen_random_uuid()], ARRAY[gen_random_uuid()])",
            "p_worker_id",
        ),
        (
            "SELECT outbox.release_outbox_leases('w1', ARRAY[gen_random_uuid()], ARRAY[gen_random_uuid(), gen_random_uuid()])",
            "p_lease_tokens",
        ),
        ("SELECT * FROM outbox.repair_expired_leases(0)", "p_limit"),
        ("SELECT outbox.enqueue('', '{}'::jsonb)", "p_topic"),
        (
            "SELECT outbox.enqueue('t', '{}'::jsonb, p_max_attempts => 0)",
            "p_max_attempts",
        ),
        (
            "SELECT outbox.enqueue('t', '{}'::jsonb, p_headers => '[1]')",
            "p_headers",
        ),
        (
            "SELECT outbox.prune_attempts(interval '-1 day')",
            "p_older_than",
        ),
        (
            "SELECT outbox.prune_attempts(interval '1 day', 0)",
            "p_limit",
        ),
    ];
    for (sql, argument) in cases {
        let (code, message) = sqlstate(c.query(*sql, &[]).await.map(|rows| rows.len()));
        assert_eq!(code, "P7001", "{sql} → {message}");
        assert!(
            message.contains(argument),
            "{sql}: message {message:?} must name {argument}"
        );
    }
    // The same id twice in one call.
    let (code, message) = sqlstate(
        c.query(
            "SELECT * FROM outbox.extend_outbox_leases('w1', ARRAY[$1::uuid, $1::uuid], \
             ARRAY[gen_random_uuid(), gen_random_uuid()], 30)",
            &[&id],
        )
        .await
        .map(|rows| rows.len()),
    );
    assert_eq!(code, "P7001");
    assert!(message.contains("p_outbox_ids"), "{message}");
    db.finish().await;
}

/// The jsonb form costs the producer no second function call: it is inlined into the
/// caller's statement, which then calls the bytea form (with its content type) directly.
#[tokio::test]
async fn the_jsonb_enqueue_is_inlined_into_the_callers_statement() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let plan: Vec<String> = c
        .query(
            "EXPLAIN (VERBOSE, COSTS OFF) SELECT outbox.enqueue('t', '{\"n\": 1}'::jsonb, 'k')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let plan = plan.join("\n");
    assert!(
        plan.contains("outbox.enqueue('t'::text, ") && plan.contains("'application/json'::text)"),
        "the caller's statement calls enqueue(bytea) itself: {plan}"
    );
    let id: Uuid = c
        .query_one("SELECT outbox.enqueue('t', '{\"n\": 1}'::jsonb, 'k')", &[])
        .await
        .unwrap()
        .get(0);
    let row = c
        .query_one(
            "SELECT convert_from(payload, 'UTF8'), content_type, message_key FROM outbox.messages \
              WHERE outbox_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "{\"n\": 1}");
    assert_eq!(row.get::<_, String>(1), "application/json");
    assert_eq!(row.get::<_, String>(2), "k");
    db.finish().await;
}

#[tokio::test]
async fn roles_can_do_their_job_and_nothing_more() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "t", None).await;

    // outbox_producer: enqueue only.
    c.batch_execute("SET ROLE outbox_producer").await.unwrap();
    c.execute("SELECT outbox.enqueue('t', '{}'::jsonb)", &[])
        .await
        .expect("producer can enqueue");
    c.execute("SELECT outbox.enqueue('t', '\\x00'::bytea)", &[])
        .await
        .expect("producer can enqueue bytes");
    for sql in [
        "SELECT * FROM outbox.claim_outbox_batch(1, 'p', 30)",
        "SELECT * FROM outbox.messages",
        "INSERT INTO outbox.messages (topic, payload) VALUES ('t', '\\x00')",
        "SELECT * FROM outbox.status",
        "SELECT * FROM outbox.repair_expired_leases()",
    ] {
        let (code, _) = sqlstate(c.execute(sql, &[]).await);
        assert_eq!(code, "42501", "producer must not run {sql}");
    }
    c.batch_execute("RESET ROLE").await.unwrap();

    // outbox_relay: the worker functions, no direct writes.
    c.batch_execute("SET ROLE outbox_relay").await.unwrap();
    let m = claim(&c, 1, "relay", 30)
        .await
        .pop()
        .expect("relay can claim");
    complete(&c, &m, "relay", "DISPATCHED", None)
        .await
        .expect("relay can complete");
    c.query("SELECT * FROM outbox.repair_expired_leases()", &[])
        .await
        .expect("relay can repair");
    c.query("SELECT * FROM outbox.status", &[])
        .await
        .expect("relay can read status");
    for sql in [
        "DELETE FROM outbox.messages",
        "UPDATE outbox.messages SET lease_token = NULL",
        "INSERT INTO outbox.attempts VALUES (gen_random_uuid(), 1, 'DISPATCHED', 'x', gen_random_uuid())",
        "DELETE FROM outbox.dead_letters",
        "UPDATE outbox.attempts SET state = 'FAILED'",
        "SELECT outbox.apply_outcomes(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
    ] {
        let (code, _) = sqlstate(c.execute(sql, &[]).await);
        assert_eq!(code, "42501", "relay must not run {sql}");
    }
    c.batch_execute("RESET ROLE").await.unwrap();

    // outbox_reader: the views only.
    c.batch_execute("SET ROLE outbox_reader").await.unwrap();
    for view in [
        "status",
        "in_flight",
        "topic_lag",
        "worker_activity",
        "recent_failures",
        "attempt_rates",
    ] {
        c.query(&format!("SELECT * FROM outbox.{view}"), &[])
            .await
            .unwrap_or_else(|e| panic!("reader cannot read outbox.{view}: {e}"));
    }
    for sql in [
        "SELECT * FROM outbox.messages",
        "SELECT outbox.enqueue('t', '{}'::jsonb)",
        "SELECT * FROM outbox.claim_outbox_batch(1, 'r', 30)",
    ] {
        let (code, _) = sqlstate(c.execute(sql, &[]).await);
        assert_eq!(code, "42501", "reader must not run {sql}");
    }
    c.batch_execute("RESET ROLE").await.unwrap();
    db.finish().await;
}

/// Holds, in a session of its own, the keys of the next `windows` 2 ms wake-up windows
/// (the advisory keys `outbox.enqueue` tries), as transactions that won them would.
async fn hold_wake_windows(db: &TestDb, windows: i64) -> tokio_postgres::Client {
    let holder = db.client().await;
    holder
        .execute(
            "SELECT pg_advisory_lock(hashtext('outbox.wake_relayers'), \
                    ((extract(epoch FROM clock_timestamp()) * 500)::bigint % 2147483647 + w)::integer) \
               FROM generate_series(0, $1::bigint) AS w",
            &[&windows],
        )
        .await
        .unwrap();
    holder
}

#[tokio::test]
async fn enqueue_wakes_listeners_once_per_transaction_and_once_per_window() {
    let db = TestDb::new().await;
    let (listener, mut connection) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut stream = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        use futures_util::StreamExt;
        while let Some(Ok(msg)) = stream.next().await {
            if let tokio_postgres::AsyncMessage::Notification(n) = msg {
                let _ = tx.send((n.channel().to_owned(), n.payload().to_owned()));
            }
        }
    });
    listener.batch_execute("LISTEN outbox_new").await.unwrap();
    let quiet = std::time::Duration::from_millis(200);

    // At commit, once, however many messages the transaction enqueued.
    let c = db.client().await;
    c.batch_execute("BEGIN").await.unwrap();
    for _ in 0..3 {
        enqueue(&c, "orders", None).await;
    }
    assert!(
        tokio::time::timeout(quiet, rx.recv()).await.is_err(),
        "no notification before commit"
    );
    c.batch_execute("COMMIT").await.unwrap();
    let got = tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv())
        .await
        .expect("notification after commit")
        .unwrap();
    assert_eq!(got, ("outbox_new".to_owned(), String::new()));
    assert!(
        tokio::time::timeout(quiet, rx.recv()).await.is_err(),
        "one notification per transaction"
    );

    // Another transaction of the same window notifies: this one commits without the
    // notification queue's lock.
    let holder = hold_wake_windows(&db, 1000).await;
    enqueue(&c, "orders", None).await;
    assert!(
        tokio::time::timeout(quiet, rx.recv()).await.is_err(),
        "the window's winner notifies, not every producer"
    );
    holder
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .unwrap();
    enqueue(&c, "orders", None).await;
    tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv())
        .await
        .expect("a lone enqueue notifies")
        .unwrap();
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.messages").await, 5);
    db.finish().await;
}

#[tokio::test]
async fn producer_supplied_ids_headers_and_bytes_are_kept() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = Uuid::new_v4();
    let got: Uuid = c
        .query_one(
            "SELECT outbox.enqueue('t', '\\xdeadbeef'::bytea, 'k', '{\"trace\": \"abc\"}', NULL, $1, 3, 'application/octet-stream')",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(got, id);
    let (code, _) = sqlstate(
        c.execute(
            "SELECT outbox.enqueue('t', '{}'::jsonb, p_outbox_id => $1)",
            &[&id],
        )
        .await,
    );
    assert_eq!(code, "23505", "a duplicate producer id is refused");
    let row = c
        .query_one(
            "SELECT c.payload, c.content_type, c.headers->>'trace', m.max_attempts \
             FROM outbox.claim_outbox_batch(1, 'w', 30) AS c JOIN outbox.messages AS m USING (outbox_id)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Vec<u8>>(0), [0xde, 0xad, 0xbe, 0xef]);
    assert_eq!(row.get::<_, String>(1), "application/octet-stream");
    assert_eq!(row.get::<_, String>(2), "abc");
    assert_eq!(row.get::<_, i32>(3), 3);
    db.finish().await;
}

#[tokio::test]
async fn generated_ids_are_time_ordered_uuid_v7() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let a = enqueue(&c, "t", None).await;
    tokio::time::sleep(std::time::Duration::from_millis(3)).await;
    let b = enqueue(&c, "t", None).await;
    assert_eq!(a.get_version_num(), 7);
    assert!(a < b, "{a} sorts before {b}");
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

/// Claims `n` with the payloads read as text: (key, payload) in the order returned.
async fn claim_texts(c: &Client, n: i32) -> Vec<(Option<String>, String, Uuid, Uuid)> {
    c.query(
        "SELECT message_key, convert_from(payload, 'UTF8'), outbox_id, lease_token \
         FROM outbox.claim_outbox_batch($1, 'w', 30)",
        &[&n],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

/// Reports one state per claimed message, in one completion.
async fn complete_all(
    c: &Client,
    claimed: &[(Option<String>, String, Uuid, Uuid)],
    states: &[&str],
) {
    let ids: Vec<Uuid> = claimed.iter().map(|m| m.2).collect();
    let tokens: Vec<Uuid> = claimed.iter().map(|m| m.3).collect();
    let states: Vec<String> = states.iter().map(|s| (*s).to_owned()).collect();
    c.query(
        "SELECT * FROM outbox.complete_outbox_batch('w', $1, $2, $3::text[]::outbox.attempt_state[], NULL, \
         (SELECT array_agg(CASE WHEN s = 'RETRYABLE' THEN now() + interval '1 hour' END) FROM unnest($3::text[]) AS s))",
        &[&ids, &tokens, &states],
    )
    .await
    .unwrap();
}

/// The payloads of `key` in a claim, as numbers, in the order returned.
fn run_of(claimed: &[(Option<String>, String, Uuid, Uuid)], key: &str) -> Vec<i32> {
    claimed
        .iter()
        .filter(|m| m.0.as_deref() == Some(key))
        .map(|m| m.1.parse().unwrap())
        .collect()
}

#[tokio::test]
async fn a_claim_returns_a_run_of_a_key_in_order_in_the_room_the_heads_leave() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox.messages (topic, message_key, payload) \
           SELECT 't', 'hot', convert_to(g::text, 'UTF8') FROM generate_series(1, 1000) AS g; \
         INSERT INTO outbox.messages (topic, payload) \
           SELECT 't', convert_to('free', 'UTF8') FROM generate_series(1, 50); \
         UPDATE outbox.messages SET available_at = now() + interval '1 hour' \
          WHERE message_key = 'hot' AND convert_from(payload, 'UTF8') = '201'",
    )
    .await
    .unwrap();
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.messages WHERE behind").await,
        999,
        "every message after the key's head waits behind it, out of the claim's walk"
    );

    // Heads (50 unkeyed, the hot key's first), then the hot key's run in the room left. A
    // claim visits the shards in a random order and the run follows the heads of its own
    // shard, so the run has at least the room all 50 unkeyed heads would leave.
    let first = claim_texts(&c, 100).await;
    assert_eq!(first.len(), 100);
    let k = i32::try_from(run_of(&first, "hot").len()).unwrap();
    assert!(k >= 50, "a run of {k}");
    assert_eq!(run_of(&first, "hot"), (1..=k).collect::<Vec<_>>());
    let more = claim_texts(&c, 100).await;
    assert!(
        more.iter().all(|m| m.0.is_none()),
        "nothing of a key whose head is leased"
    );
    assert_eq!(
        more.len(),
        usize::try_from(k - 50).unwrap(),
        "the other heads"
    );
    complete_all(&c, &first, &["DISPATCHED"; 100]).await;
    complete_all(&c, &more, &vec!["DISPATCHED"; more.len()]).await;

    // The next message became the head; its run stops before the delayed message 201.
    let second = claim_texts(&c, 500).await;
    assert_eq!(run_of(&second, "hot"), (k + 1..=200).collect::<Vec<_>>());
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.messages WHERE NOT behind").await,
        1,
        "the leased run's head is the only head: the rest of the key is off the claim's walk"
    );
    db.finish().await;
}

#[tokio::test]
async fn a_retryable_failure_in_a_run_gives_back_the_rest_and_the_key_waits_for_it() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox.messages (topic, message_key, payload) \
           SELECT 't', 'k', convert_to(g::text, 'UTF8') FROM generate_series(1, 10) AS g",
    )
    .await
    .unwrap();
    let run = claim_texts(&c, 10).await;
    assert_eq!(run_of(&run, "k"), (1..=10).collect::<Vec<_>>());
    // What the relayer reports when message 4 fails: the rest given back, then 1–3
    // delivered and 4 retryable (an hour from now).
    let rest: Vec<_> = run[4..].to_vec();
    let released: i32 = c
        .query_one(
            "SELECT outbox.release_outbox_leases('w', $1, $2)",
            &[
                &rest.iter().map(|m| m.2).collect::<Vec<_>>(),
                &rest.iter().map(|m| m.3).collect::<Vec<_>>(),
            ],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(released, 6);
    complete_all(
        &c,
        &run[..4],
        &["DISPATCHED", "DISPATCHED", "DISPATCHED", "RETRYABLE"],
    )
    .await;
    assert!(
        claim_texts(&c, 10).await.is_empty(),
        "5–10 wait for 4's retry"
    );
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.attempts WHERE outbox_id = ANY (SELECT outbox_id FROM outbox.messages WHERE behind)").await,
        0,
        "the given-back messages were not attempted"
    );
    c.execute("UPDATE outbox.messages SET available_at = now()", &[])
        .await
        .unwrap();
    let again = claim_texts(&c, 10).await;
    assert_eq!(run_of(&again, "k"), (4..=10).collect::<Vec<_>>());
    db.finish().await;
}

/// A producer that enqueued a message of `key` in an open transaction and ran its
/// commit-time check (SET CONSTRAINTS ALL IMMEDIATE), which holds the message before it
/// FOR KEY SHARE until the transaction ends; with the new message's id.
async fn producer_committing_behind(db: &TestDb, key: &str) -> (Client, Uuid) {
    let p = db.client().await;
    p.batch_execute("BEGIN").await.unwrap();
    let id = enqueue(&p, "t", Some(key)).await;
    p.batch_execute("SET CONSTRAINTS ALL IMMEDIATE")
        .await
        .unwrap();
    (p, id)
}

#[tokio::test]
async fn a_producer_committing_behind_a_head_being_completed_becomes_the_next_head() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "t", Some("k")).await;
    let head = claim(&c, 1, "w", 30).await.remove(0);

    // The producer's commit-time check keeps the head from being deleted until the
    // producer commits.
    let (p, mine) = producer_committing_behind(&db, "k").await;
    let c2 = db.client().await;
    let completion = tokio::spawn(async move {
        complete(&c2, &head, "w", "DISPATCHED", None).await.unwrap();
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !completion.is_finished(),
        "the head's deletion waits for the producer queued behind it"
    );
    p.batch_execute("COMMIT").await.unwrap();
    completion.await.unwrap();
    let next: Vec<Uuid> = claim(&c, 10, "w", 30).await.iter().map(|m| m.id).collect();
    assert_eq!(
        next,
        [mine],
        "the completion made the producer's message the head"
    );

    // The head already gone when the producer commits, in either isolation level: the
    // producer's message marks itself as the head.
    for (n, isolation) in ["READ COMMITTED", "REPEATABLE READ"].iter().enumerate() {
        let key = format!("late-{n}");
        c.execute("SELECT outbox.enqueue('t', '{}'::jsonb, $1)", &[&key])
            .await
            .unwrap();
        let p = db.client().await;
        p.batch_execute(&format!("BEGIN ISOLATION LEVEL {isolation}"))
            .await
            .unwrap();
        let mine: Uuid = p
            .query_one("SELECT outbox.enqueue('t', '{}'::jsonb, $1)", &[&key])
            .await
            .unwrap()
            .get(0);
        let head = claim(&c, 10, "w", 30).await;
        assert_eq!(head.len(), 1, "{isolation}: the first message only");
        complete(&c, &head[0], "w", "DISPATCHED", None)
            .await
            .unwrap();
        p.batch_execute("COMMIT").await.unwrap();
        let next = claim(&c, 10, "w", 30).await;
        assert_eq!(
            next.iter().map(|m| m.id).collect::<Vec<_>>(),
            [mine],
            "{isolation}"
        );
        complete(&c, &next[0], "w", "DISPATCHED", None)
            .await
            .unwrap();
    }
    db.finish().await;
}

#[tokio::test]
async fn a_producer_behind_messages_being_completed_commits_without_waiting_or_deadlocking() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "t", Some("a")).await;
    enqueue(&c, "t", Some("b")).await;
    let heads = claim(&c, 10, "w", 30).await;
    assert_eq!(heads.len(), 2, "the heads of a and b");

    // One producer transaction enqueues behind both heads.
    let p = db.client().await;
    p.batch_execute("BEGIN").await.unwrap();
    let behind_a = enqueue(&p, "t", Some("a")).await;
    let behind_b = enqueue(&p, "t", Some("b")).await;
    // A completion has deleted b's head and not committed yet when the producer commits;
    // then it deletes a's head. Were the producer to wait for b's head while holding a's,
    // the two would deadlock and Postgres would fail one of them.
    let done = db.client().await;
    done.batch_execute("BEGIN").await.unwrap();
    complete(&done, &heads[1], "w", "DISPATCHED", None)
        .await
        .unwrap();
    let producer = tokio::spawn(async move { p.batch_execute("COMMIT").await });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        producer.is_finished(),
        "the producer's commit does not wait for a completion"
    );
    producer.await.unwrap().expect("the producer commits");
    complete(&done, &heads[0], "w", "DISPATCHED", None)
        .await
        .expect("the completion is not failed either");
    done.batch_execute("COMMIT").await.unwrap();

    let next: HashSet<Uuid> = claim(&c, 10, "w", 30).await.iter().map(|m| m.id).collect();
    assert_eq!(
        next,
        HashSet::from([behind_a, behind_b]),
        "both are the heads of their keys now"
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
async fn no_lease_fence_waits_for_a_producer_committing_behind_the_message() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "t", Some("k")).await;
    let head = claim(&c, 1, "w", 30).await.remove(0);

    // A producer enqueued behind the head and is committing: its commit-time check holds
    // the head FOR KEY SHARE.
    let (p, _) = producer_committing_behind(&db, "k").await;

    // A heartbeat and a retry take the head's fence and change only lease columns: neither
    // waits for the producer (while a fence waited, the producer could wait for it in turn).
    let quick = std::time::Duration::from_secs(5);
    let extended = tokio::time::timeout(
        quick,
        c.query(
            "SELECT * FROM outbox.extend_outbox_leases('w', ARRAY[$1::uuid], ARRAY[$2::uuid], 60)",
            &[&head.id, &head.token],
        ),
    )
    .await
    .expect("the heartbeat does not wait for the producer")
    .unwrap();
    assert_eq!(extended.len(), 1);
    let attempt = tokio::time::timeout(quick, retry_at(&c, &head, "w", 3600.0))
        .await
        .expect("the retry's completion does not wait for the producer");
    assert_eq!(attempt, 1);
    p.batch_execute("COMMIT").await.unwrap();
    db.finish().await;
}

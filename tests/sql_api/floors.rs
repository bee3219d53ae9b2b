//! The claim floors (`04_claim.sql`): claims walk each shard from its floor, so the dead
//! entries a held MVCC horizon keeps cost them nothing; a floor never passes a message that
//! is pending or still being written, and a message put below its floor anyway is moved up
//! by repair.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use super::*;
use crate::common::{eventually, fill, pending};

/// The bound every floor is capped by, as a timestamp (microseconds since the epoch).
async fn bound(c: &Client) -> i64 {
    count(c, "SELECT last_value FROM outbox.claim_floor_bound").await
}

/// Claims of a topic no message has, one every 50 ms for `for_`: they lease nothing, and
/// move the bound and raise the floors as every claim does.
async fn idle_claims(c: &Client, for_: Duration) {
    let until = Instant::now() + for_;
    while Instant::now() < until {
        let leased = count(
            c,
            "SELECT count(*) FROM outbox.claim_outbox_batch_seq(10, 'idle', 30, ARRAY['no such topic'])",
        )
        .await;
        assert_eq!(leased, 0);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Empty claims until the bound passes `micros` (since the epoch). It waits for every
/// transaction of the server that holds an id, those of other tests' databases too.
async fn bound_passes(c: &Client, micros: i64) {
    let what = format!("the bound to pass {micros}");
    eventually(Duration::from_secs(60), &what, || async move {
        if bound(c).await > micros {
            return true;
        }
        idle_claims(c, Duration::from_millis(200)).await;
        false
    })
    .await;
}

/// The clock, in microseconds since the epoch.
async fn clock(c: &Client) -> i64 {
    count(
        c,
        "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
    )
    .await
}

/// Entries of messages_shard_heads_idx (over the slots) that scans have returned so far, as
/// the statistics count them after `c` flushed its own.
async fn heads_entries_read(c: &Client) -> i64 {
    c.batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    c.batch_execute("SELECT pg_stat_clear_snapshot()")
        .await
        .unwrap();
    count(
        c,
        "SELECT sum(s.idx_tup_read)::bigint FROM pg_stat_user_indexes AS s \
         WHERE s.indexrelid IN (SELECT p.relid \
                                  FROM pg_partition_tree('outbox.messages_shard_heads_idx') AS p \
                                 WHERE p.isleaf)",
    )
    .await
}

#[tokio::test]
async fn claims_walk_from_the_floors_past_what_a_held_snapshot_keeps() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // A reader holding its snapshot: nothing deleted from now on can be vacuumed.
    let holder = db.client().await;
    holder
        .batch_execute(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM outbox.attempts",
        )
        .await
        .unwrap();

    let delivered = 4_000;
    fill(&c, "t", delivered, None).await;
    loop {
        let batch = claim(&c, 500, "w", 30).await;
        if batch.is_empty() {
            break;
        }
        let states = vec!["DISPATCHED"; batch.len()];
        complete_batch(&c, "w", &batch, &states).await;
    }
    assert_eq!(pending(&c).await, 0);

    // The floors pass the dead entries once the bound (200 ms behind the clock) has. The
    // bound waits for every transaction of the server holding an id, those of other
    // tests' databases too.
    let drained = clock(&c).await;
    bound_passes(&c, drained).await;
    let before = heads_entries_read(&c).await;
    for _ in 0..10 {
        assert!(claim(&c, 10, "w", 30).await.is_empty());
    }
    let read = heads_entries_read(&c).await - before;
    assert!(
        read < 100,
        "10 claims of an empty outbox read {read} entries of messages_shard_heads_idx; the \
         {delivered} dead entries the held snapshot keeps should be below every floor"
    );

    // Work that arrives is claimed as before, the snapshot still held.
    let id = enqueue(&c, "t", None).await;
    let got = claim(&c, 10, "w", 30).await;
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), [id]);
    holder.batch_execute("ROLLBACK").await.unwrap();
    db.finish().await;
}

#[tokio::test]
async fn a_transaction_holding_an_id_keeps_the_floors_below_what_it_writes() {
    let db = TestDb::new().await;
    let c = db.client().await;
    idle_claims(&c, Duration::from_millis(300)).await;

    // A producer writes its message, then keeps its transaction open while claims run.
    let producer = db.client().await;
    producer.batch_execute("BEGIN").await.unwrap();
    let written = clock(&producer).await;
    let id: Uuid = producer
        .query_one("SELECT outbox.enqueue('t', '{}'::jsonb)", &[])
        .await
        .unwrap()
        .get(0);
    idle_claims(&c, Duration::from_millis(2_500)).await;
    assert!(
        bound(&c).await < written,
        "the bound passed a message whose transaction is still open"
    );
    let floors = count(
        &c,
        "SELECT max((extract(epoch FROM f) * 1000000)::bigint) FROM unnest(outbox.claim_floors()) AS f",
    )
    .await;
    assert!(
        floors < written,
        "a floor passed a message still being written"
    );

    // Committed, it is claimed at once, not after a repair pass.
    producer.batch_execute("COMMIT").await.unwrap();
    let got = claim(&c, 10, "w", 30).await;
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), [id]);

    // With the transaction gone the bound moves on past it.
    bound_passes(&c, written).await;
    db.finish().await;
}

#[tokio::test]
async fn a_message_enqueued_in_the_past_keeps_its_time_and_is_claimed_at_once() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let start = clock(&c).await;
    bound_passes(&c, start).await;
    let id: Uuid = c
        .query_one(
            "SELECT outbox.enqueue('t', '{}'::jsonb, p_available_at => now() - interval '1 day')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let age = count(
        &c,
        "SELECT extract(epoch FROM now() - available_at)::bigint FROM outbox.messages",
    )
    .await;
    assert!(
        age >= 86_000,
        "available_at is stored as given ({age} s ago)"
    );
    let got = claim(&c, 10, "w", 30).await;
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), [id]);
    db.finish().await;
}

#[tokio::test]
async fn the_owners_own_old_writes_lower_the_floor_and_repair_catches_what_a_race_leaves() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let start = clock(&c).await;
    bound_passes(&c, start).await;

    // The schema owner's own INSERT with an old time lowers its shard's floor.
    let inserted: Uuid = c
        .query_one(
            "INSERT INTO outbox.messages (topic, payload, available_at) \
             VALUES ('t', '\\x00', now() - interval '1 hour') RETURNING outbox_id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let got = claim(&c, 10, "w", 30).await;
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), [inserted]);
    complete_batch(&c, "w", &got, &["DISPATCHED"]).await;

    // So does an UPDATE that makes a delayed message due an hour ago.
    let delayed: Uuid = c
        .query_one(
            "SELECT outbox.enqueue('t', '{}'::jsonb, p_available_at => now() + interval '1 hour')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let now = clock(&c).await;
    bound_passes(&c, now).await;
    c.execute(
        "UPDATE outbox.messages SET available_at = now() - interval '1 hour' WHERE outbox_id = $1",
        &[&delayed],
    )
    .await
    .unwrap();
    let got = claim(&c, 10, "w", 30).await;
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), [delayed]);

    // A message left below its floor (here: the floors raised past it by hand, as a claim
    // racing the owner's write could) is moved up by the next repair pass.
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
    assert!(
        claim(&c, 10, "w", 30).await.is_empty(),
        "below its floor, no claim finds it"
    );
    assert_eq!(
        repair(&c).await,
        (0, 0),
        "moving a message up is not a requeue"
    );
    let got = claim(&c, 10, "w", 30).await;
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), [stranded]);
    db.finish().await;
}

/// Everything written through the API while claims raise the floors is claimed without a
/// repair pass: producers holding their transactions open for a while (some keyed, so
/// completions promote heads, some delayed), and a third of first attempts failing with a
/// retry at once, on separate connections at the same time.
#[tokio::test]
async fn no_message_written_through_the_api_is_left_below_a_floor() {
    let db = TestDb::new().await;
    let producers: u32 = 6;
    let per_producer: u32 = 30;
    let mut tasks = Vec::new();
    for p in 0..producers {
        let mut c = db.client().await;
        tasks.push(tokio::spawn(async move {
            for i in 0..per_producer {
                let key = i.is_multiple_of(3).then(|| format!("k{}", i % 7));
                let delay = if i.is_multiple_of(10) { 0.3 } else { 0.0 };
                let tx = c.transaction().await.unwrap();
                tx.execute(
                    "SELECT outbox.enqueue('t', '{}'::jsonb, $1, \
                            p_available_at => CASE WHEN $2::float8 > 0 \
                                              THEN clock_timestamp() + make_interval(secs => $2) END)",
                    &[&key, &delay],
                )
                .await
                .unwrap();
                // A transaction that holds its id while claims go on, for up to twice the
                // bound's margin.
                tokio::time::sleep(Duration::from_millis(u64::from((p * 7 + i * 13) % 400))).await;
                tx.commit().await.unwrap();
            }
        }));
    }
    let total = i64::from(producers * per_producer);
    let claimer = db.client().await;
    let until = Instant::now() + Duration::from_secs(60);
    let mut delivered = 0_i64;
    let mut round = 0_u64;
    while delivered < total {
        assert!(
            Instant::now() < until,
            "{delivered} of {total} delivered in 60 s without a repair pass: a message is below its floor"
        );
        let batch = claim(&claimer, 50, "w", 30).await;
        for m in &batch {
            round += 1;
            if m.attempt_no == 1 && round.is_multiple_of(3) {
                retry_at(&claimer, m, "w", 0.0).await;
            } else {
                complete(&claimer, m, "w", "DISPATCHED", None)
                    .await
                    .unwrap();
                delivered += 1;
            }
        }
        if batch.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(pending(&claimer).await, 0);
    assert!(bound(&claimer).await > 0, "the floors moved during the run");
    db.finish().await;
}

/// A key's head retried while a message of its run is dead-lettered in the same call, after
/// the floors rose past the messages waiting behind the head: the message after them is
/// not made a head at the dead-lettered message's old time (below the floor), and is
/// claimed after the head without a repair pass.
#[tokio::test]
async fn a_run_message_dead_lettered_beside_its_retried_head_promotes_nothing_below_a_floor() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let mut ids = Vec::new();
    for max_attempts in [10, 1, 10] {
        ids.push(enqueue_with(&c, Some("k"), max_attempts).await);
    }
    // The head alone, retried a second later: the floors rise to it (the two behind it
    // have no entry for them to stop at).
    let head = claim(&c, 1, "w", 30).await;
    assert_eq!(head[0].id, ids[0]);
    retry_at(&c, &head[0], "w", 1.0).await;
    let now = clock(&c).await;
    bound_passes(&c, now + 1_000_000).await;

    // The head and its run again; the head retried, the run's message out of attempts.
    let batch = claim_when(&c, 2, 2).await;
    assert_eq!(batch.iter().map(|m| m.id).collect::<Vec<_>>(), ids[..2]);
    c.query(
        "SELECT * FROM outbox.complete_outbox_batch('w', $1, $2, \
                ARRAY['RETRYABLE', 'FAILED']::outbox.attempt_state[], ARRAY['again', 'refused'], \
                ARRAY[clock_timestamp() + interval '1 second', NULL])",
        &[
            &batch.iter().map(|m| m.id).collect::<Vec<_>>(),
            &batch.iter().map(|m| m.token).collect::<Vec<_>>(),
        ],
    )
    .await
    .unwrap();
    let now = clock(&c).await;
    bound_passes(&c, now + 1_000_000).await;

    let head = claim_when(&c, 1, 1).await;
    assert_eq!(head[0].id, ids[0]);
    complete(&c, &head[0], "w", "DISPATCHED", None)
        .await
        .unwrap();
    let next = claim(&c, 1, "w", 30).await;
    assert_eq!(next.iter().map(|m| m.id).collect::<Vec<_>>(), [ids[2]]);
    db.finish().await;
}

/// Claims `n` until it gets `at_least` messages, at most 10 s.
async fn claim_when(c: &Client, n: i32, at_least: usize) -> Vec<Claimed> {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let got = claim(c, n, "w", 30).await;
        if got.len() >= at_least {
            return got;
        }
        assert!(got.is_empty(), "a claim took {} of {at_least}", got.len());
        assert!(Instant::now() < until, "nothing due in 10 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A message dated before the Unix epoch (a zero time from a producer's language) keeps its
/// shard walked from its start, and claims of that shard go on.
#[tokio::test]
async fn a_message_dated_before_the_epoch_is_claimed_and_breaks_no_claim() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let start = clock(&c).await;
    bound_passes(&c, start).await;
    let id: Uuid = c
        .query_one(
            "SELECT outbox.enqueue('t', '{}'::jsonb, p_available_at => '0001-01-01')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let got = claim(&c, 10, "w", 30).await;
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), [id]);
    complete(&c, &got[0], "w", "DISPATCHED", None)
        .await
        .unwrap();
    let later = enqueue(&c, "t", None).await;
    idle_claims_until(&c, later).await;
    db.finish().await;
}

/// Claims until `id` is claimed (and delivered), at most 10 s.
async fn idle_claims_until(c: &Client, id: Uuid) {
    let what = format!("{id} to be claimed");
    eventually(Duration::from_secs(10), &what, || async move {
        let got = claim(c, 10, "w", 30).await;
        for m in &got {
            complete(c, m, "w", "DISPATCHED", None).await.unwrap();
        }
        got.iter().any(|m| m.id == id)
    })
    .await;
}

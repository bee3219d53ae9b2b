//! `outbox.rotate_messages` and the slots of `outbox.messages`: producers move on to the next
//! empty slot once the current one's period is over; a slot is truncated once nothing in it
//! is pending, even while a snapshot holds the MVCC horizon back; a slot that holds a
//! pending message, or that another transaction has open, is kept.

use super::*;
use common::{eventually, fill, pending};
use tokio_postgres::Client;

/// `rotate_messages()` with its default period: (current_slot, truncated_slot, busy_slot).
async fn rotate(c: &Client) -> (i32, Option<i32>, Option<i32>) {
    let r = c
        .query_one("SELECT * FROM outbox.rotate_messages()", &[])
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

/// Ends the current slot's period, as if it had been current for an hour.
async fn end_period(c: &Client) {
    c.batch_execute(
        "UPDATE outbox.message_slots SET opened_at = opened_at - interval '1 hour' \
          WHERE slot = outbox.message_slot()",
    )
    .await
    .unwrap();
}

async fn slot_of(c: &Client, id: Uuid) -> i16 {
    c.query_one(
        "SELECT slot FROM outbox.messages WHERE outbox_id = $1",
        &[&id],
    )
    .await
    .unwrap()
    .get(0)
}

async fn pages(c: &Client, slot: i32) -> i64 {
    count(
        c,
        &format!("SELECT pg_relation_size('outbox.messages_{slot}') / 8192"),
    )
    .await
}

/// A session holding its snapshot (REPEATABLE READ, one read, idle in transaction) until
/// it commits; it reads no outbox table, so it keeps no slot open.
pub(crate) async fn snapshot_holder(db: &TestDb) -> Client {
    let holder = db.client().await;
    holder
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .await
        .unwrap();
    holder
}

/// Claims and delivers every ready message; returns how many.
async fn deliver_all(c: &Client) -> usize {
    let mut delivered = 0;
    loop {
        let batch = claim(c, 500, "w", 60).await;
        if batch.is_empty() {
            return delivered;
        }
        let states = vec!["DISPATCHED"; batch.len()];
        complete_batch(c, "w", &batch, &states).await;
        delivered += batch.len();
    }
}

#[tokio::test]
async fn producers_move_to_the_next_empty_slot_once_the_period_is_over() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let first = enqueue(&c, "t", None).await;
    assert_eq!(slot_of(&c, first).await, 0);
    assert_eq!(rotate(&c).await, (0, None, None), "the period is not over");

    end_period(&c).await;
    assert_eq!(rotate(&c).await, (1, None, None));
    let second = enqueue(&c, "t", Some("k")).await;
    let third = enqueue(&c, "t", Some("k")).await;
    assert_eq!(slot_of(&c, second).await, 1);
    assert_eq!(slot_of(&c, third).await, 1);
    assert_eq!(slot_of(&c, first).await, 0, "a message stays in its slot");

    // A key's order holds across slots: its head and its run, which ends with the head's
    // slot; the key's message in the next slot is its head once the run is delivered.
    end_period(&c).await;
    assert_eq!(rotate(&c).await.0, 2);
    let fourth = enqueue(&c, "t", Some("k")).await;
    assert_eq!(slot_of(&c, fourth).await, 2);
    let batch = claim(&c, 10, "w", 60).await;
    let ids: Vec<Uuid> = batch.iter().map(|m| m.id).collect();
    assert_eq!(ids, [first, second, third]);
    complete_batch(&c, "w", &batch, &["DISPATCHED"; 3]).await;
    let ids: Vec<Uuid> = claim(&c, 10, "w", 60).await.iter().map(|m| m.id).collect();
    assert_eq!(ids, [fourth]);
    db.finish().await;
}

#[tokio::test]
async fn a_slot_is_truncated_once_nothing_in_it_is_pending_while_a_snapshot_is_held() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // A reader holding its snapshot: vacuum may remove nothing deleted from now on.
    let holder = snapshot_holder(&db).await;

    let ids = fill(&c, "t", 2_000, Some(10)).await;
    end_period(&c).await;
    assert_eq!(rotate(&c).await, (1, None, None));
    let later = enqueue(&c, "t", None).await;
    assert_eq!(
        rotate(&c).await,
        (1, None, None),
        "slot 0 has messages pending"
    );

    assert_eq!(deliver_all(&c).await, 2_001);
    let delivered: i64 = count(
        &c,
        "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCHED'",
    )
    .await;
    assert_eq!(delivered, 2_001);
    assert!(
        pages(&c, 0).await > 0,
        "delivered rows are still on its pages"
    );
    let again = enqueue(&c, "t", None).await;

    assert_eq!(rotate(&c).await, (1, Some(0), None));
    assert_eq!(pages(&c, 0).await, 0, "slot 0 gave its pages back");
    assert_eq!(
        pending(&c).await,
        1,
        "the message pending in slot 1 is still there"
    );
    assert_eq!(slot_of(&c, again).await, 1);
    let history_kept: i64 = count(
        &c,
        &format!(
            "SELECT count(*) FROM outbox.attempts WHERE outbox_id IN ('{}', '{}', '{later}')",
            ids[0], ids[1_999]
        ),
    )
    .await;
    assert_eq!(history_kept, 3, "the attempt log keeps every outcome");
    holder.batch_execute("COMMIT").await.unwrap();
    db.finish().await;
}

#[tokio::test]
async fn a_slot_with_a_message_pending_is_kept_and_producers_pass_over_it() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let delayed: Uuid = c
        .query_one(
            "SELECT outbox.enqueue('t', '{}'::jsonb, p_available_at => now() + interval '1 hour')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let mut current = Vec::new();
    for _ in 0..4 {
        end_period(&c).await;
        let (slot, truncated, busy) = rotate(&c).await;
        assert_eq!((truncated, busy), (None, None));
        current.push(slot);
    }
    let pinned: i32 = c
        .query_one("SELECT pinned_slots FROM outbox.rotate_messages()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        pinned, 1,
        "slot 0 is reported pinned by its delayed message"
    );
    assert_eq!(
        current,
        [1, 2, 3, 1],
        "producers go round the slots with no page, passing over slot 0"
    );
    assert_eq!(slot_of(&c, delayed).await, 0);
    assert_eq!(pending(&c).await, 1);
    db.finish().await;
}

#[tokio::test]
async fn a_slot_another_transaction_has_open_is_left_for_the_next_call() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // A producer that wrote to slot 0 and has not committed yet.
    let producer = db.client().await;
    producer.batch_execute("BEGIN").await.unwrap();
    let late = enqueue(&producer, "t", None).await;
    end_period(&c).await;
    assert_eq!(
        rotate(&c).await,
        (1, None, Some(0)),
        "producers move on; slot 0 shows no row, but the producer holds it"
    );
    assert_eq!(rotate(&c).await, (1, None, Some(0)), "and still does");
    producer.batch_execute("COMMIT").await.unwrap();
    assert_eq!(rotate(&c).await, (1, None, None), "its message is pending");
    let got = claim(&c, 10, "w", 60).await;
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), [late]);

    // A reader of the views has every slot open until its transaction ends.
    complete_batch(&c, "w", &got, &["DISPATCHED"]).await;
    let reader = db.client().await;
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT * FROM outbox.status")
        .await
        .unwrap();
    assert_eq!(rotate(&c).await, (1, None, Some(0)));
    reader.batch_execute("COMMIT").await.unwrap();
    assert_eq!(rotate(&c).await, (1, Some(0), None));
    db.finish().await;
}

#[tokio::test]
async fn rotation_under_an_older_snapshot_truncates_nothing() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "t", None).await;
    end_period(&c).await;
    assert_eq!(rotate(&c).await.0, 1);
    assert_eq!(deliver_all(&c).await, 1);
    c.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .unwrap();
    assert_eq!(rotate(&c).await, (1, None, None));
    c.batch_execute("COMMIT").await.unwrap();
    assert!(pages(&c, 0).await > 0);
    assert_eq!(rotate(&c).await, (1, Some(0), None));

    let (code, message) = sqlstate(
        c.query_one("SELECT * FROM outbox.rotate_messages(interval '0')", &[])
            .await,
    );
    assert_eq!(code, "P7001");
    assert!(message.contains("p_period"), "{message}");
    db.finish().await;
}

#[tokio::test]
async fn one_given_id_enqueued_on_either_side_of_a_rotation_is_refused_the_second_time() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = Uuid::now_v7();
    let enqueue_id = "SELECT outbox.enqueue('t', '{}'::jsonb, p_outbox_id => $1)";
    // The first producer writes the id to slot 0 and has not committed yet.
    let first = db.client().await;
    first.batch_execute("BEGIN").await.unwrap();
    first.query_one(enqueue_id, &[&id]).await.unwrap();
    end_period(&c).await;
    assert_eq!(rotate(&c).await.0, 1, "producers now write to slot 1");
    // The second waits for the first (it would insert into slot 1, where the key of
    // outbox.messages does not see slot 0's row).
    let second = db.client().await;
    let pid: i32 = second
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let waiting = tokio::spawn(async move {
        let result = second.query_one(enqueue_id, &[&id]).await;
        (second, result)
    });
    eventually(
        std::time::Duration::from_secs(60),
        "the second enqueue waits for the first",
        || async {
            count(
                &c,
                &format!(
                    "SELECT count(*) FROM pg_locks WHERE pid = {pid} AND locktype = 'advisory' \
                 AND NOT granted"
                ),
            )
            .await
                == 1
        },
    )
    .await;
    first.batch_execute("COMMIT").await.unwrap();
    let (_second, result) = waiting.await.unwrap();
    let (code, message) = sqlstate(result);
    assert_eq!(code, "23505", "{message}");
    assert!(message.contains("pending"), "{message}");
    assert_eq!(
        count(
            &c,
            &format!("SELECT count(*) FROM outbox.messages WHERE outbox_id = '{id}'")
        )
        .await,
        1
    );
    db.finish().await;
}

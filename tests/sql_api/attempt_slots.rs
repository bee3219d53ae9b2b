//! The slots of `outbox.attempts`, kept by `prune_attempts` (through `rotate_attempts`):
//! the log moves on to the next slot once the current one has been current for half the
//! retention; a slot whose attempts are all older than the retention is truncated, even
//! while a snapshot holds the MVCC horizon back, after the histories of messages pending or
//! dead-lettered are copied to slot 4; a slot another transaction has open is kept.

use super::slots::snapshot_holder;
use super::*;
use tokio_postgres::Client;

/// `prune_attempts(p_older_than)` without a limit: the attempts it removed.
async fn prune(c: &Client, older_than: &str) -> i64 {
    c.query_one(
        &format!("SELECT outbox.prune_attempts(interval '{older_than}')"),
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

async fn current_slot(c: &Client) -> i16 {
    c.query_one("SELECT outbox.attempt_slot()", &[])
        .await
        .unwrap()
        .get(0)
}

/// Ends the current slot's half retention, as if it had been current for a day.
async fn end_period(c: &Client) {
    c.batch_execute(
        "UPDATE outbox.attempt_slots SET opened_at = opened_at - interval '1 day' \
          WHERE slot = outbox.attempt_slot()",
    )
    .await
    .unwrap();
}

/// Dates every attempt in `table` (a slot) two hours back.
async fn age(c: &Client, table: &str) {
    c.batch_execute(&format!(
        "UPDATE outbox.{table} SET created_at = created_at - interval '2 hours'"
    ))
    .await
    .unwrap();
}

async fn pages(c: &Client, table: &str) -> i64 {
    count(
        c,
        &format!("SELECT pg_relation_size('outbox.{table}') / 8192"),
    )
    .await
}

/// (slot, attempt_no, state, created_at as text) of every attempt of `id`.
async fn rows_of(c: &Client, id: Uuid) -> Vec<(i16, i32, String, String)> {
    c.query(
        "SELECT slot, attempt_no, state::text, created_at::text FROM outbox.attempts \
          WHERE outbox_id = $1 ORDER BY attempt_no",
        &[&id],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

/// [`rows_of`] each id, in turn.
async fn rows_of_all(
    c: &Client,
    ids: impl Iterator<Item = &Uuid>,
) -> Vec<(i16, i32, String, String)> {
    let mut rows = Vec::new();
    for id in ids {
        rows.extend(rows_of(c, *id).await);
    }
    rows
}

/// 300 messages claimed and reported: 200 delivered, 50 retried in an hour (pending), 50
/// failed (dead-lettered); returns the ids of the retried and of the failed.
async fn outcomes(c: &Client) -> (Vec<Uuid>, Vec<Uuid>) {
    for _ in 0..300 {
        enqueue(c, "t", None).await;
    }
    let batch = claim(c, 300, "w", 60).await;
    assert_eq!(batch.len(), 300);
    let states: Vec<&str> = (0..300)
        .map(|i| match i {
            0..200 => "DISPATCHED",
            200..250 => "RETRYABLE",
            _ => "FAILED",
        })
        .collect();
    assert_eq!(complete_batch(c, "w", &batch, &states).await, 0);
    let retried = batch[200..250].iter().map(|m| m.id).collect();
    let failed = batch[250..].iter().map(|m| m.id).collect();
    (retried, failed)
}

#[tokio::test]
async fn a_slot_older_than_the_retention_is_truncated_while_a_snapshot_is_held() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // A reader holding its snapshot: vacuum may remove nothing deleted from now on.
    let holder = snapshot_holder(&db).await;

    let (retried, failed) = outcomes(&c).await;
    assert_eq!(
        prune(&c, "1 hour").await,
        0,
        "nothing is older than an hour"
    );
    assert_eq!(
        current_slot(&c).await,
        0,
        "slot 0 is current for half an hour"
    );
    end_period(&c).await;
    assert_eq!(prune(&c, "1 hour").await, 0);
    assert_eq!(current_slot(&c).await, 1, "the log moved on to slot 1");
    let new_enough = enqueue(&c, "t", None).await;
    let got = claim(&c, 10, "w", 60).await;
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), [new_enough]);
    complete_batch(&c, "w", &got, &["DISPATCHED"]).await;
    assert_eq!(rows_of(&c, new_enough).await[0].0, 1, "appended to slot 1");

    age(&c, "attempts_0").await;
    let kept_before = rows_of_all(&c, retried.iter().chain(&failed)).await;
    assert_eq!(kept_before.len(), 100);
    assert_eq!(
        prune(&c, "1 hour").await,
        200,
        "the delivered messages' attempts are deleted, row by row"
    );
    assert_eq!(
        pages(&c, "attempts_0").await,
        0,
        "slot 0 gave its pages back, dead rows and all, though a snapshot is held"
    );
    let kept_after = rows_of_all(&c, retried.iter().chain(&failed)).await;
    assert_eq!(
        kept_after
            .iter()
            .map(|r| (4, r.1, r.2.clone(), r.3.clone()))
            .collect::<Vec<_>>(),
        kept_before
            .iter()
            .map(|r| (4, r.1, r.2.clone(), r.3.clone()))
            .collect::<Vec<_>>(),
    );
    assert!(
        kept_after.iter().all(|r| r.0 == 4),
        "the histories of pending and dead-lettered messages are in slot 4, as they were"
    );
    assert_eq!(
        rows_of(&c, new_enough).await.len(),
        1,
        "slot 1 is untouched"
    );
    assert_eq!(
        history(&c, failed[0]).await,
        ["1:FAILED"],
        "a dead letter keeps its history"
    );

    // A retried message delivered later: its history spans slot 4 and the current slot,
    // numbered on; once it is old, it goes row by row like any other.
    c.execute(
        "UPDATE outbox.messages SET available_at = now() WHERE outbox_id = $1",
        &[&retried[0]],
    )
    .await
    .unwrap();
    let got = claim(&c, 10, "w", 60).await;
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), [retried[0]]);
    complete_batch(&c, "w", &got, &["DISPATCHED"]).await;
    assert_eq!(
        history(&c, retried[0]).await,
        ["1:RETRYABLE", "2:DISPATCHED"]
    );
    age(&c, "attempts").await;
    assert_eq!(
        prune(&c, "1 hour").await,
        3,
        "its two attempts and the other delivered message's"
    );
    assert!(history(&c, retried[0]).await.is_empty());
    assert_eq!(history(&c, retried[1]).await, ["1:RETRYABLE"]);
    assert_eq!(history(&c, failed[1]).await, ["1:FAILED"]);
    holder.batch_execute("COMMIT").await.unwrap();
    db.finish().await;
}

#[tokio::test]
async fn a_slot_of_the_log_another_transaction_has_open_is_left_for_the_next_call() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for _ in 0..3 {
        enqueue(&c, "t", None).await;
    }
    let batch = claim(&c, 3, "w", 60).await;
    complete_batch(&c, "w", &batch, &["DISPATCHED", "RETRYABLE", "DISPATCHED"]).await;
    end_period(&c).await;
    assert_eq!(prune(&c, "1 hour").await, 0);
    assert_eq!(current_slot(&c).await, 1);
    age(&c, "attempts_0").await;

    // A reader of the views has every slot of the log open until its transaction ends.
    let reader = db.client().await;
    reader
        .batch_execute("BEGIN; SELECT * FROM outbox.attempt_rates")
        .await
        .unwrap();
    assert_eq!(
        prune(&c, "1 hour").await,
        2,
        "the delivered attempts go row by row; the slot is kept, not waited for"
    );
    assert!(pages(&c, "attempts_0").await > 0);
    reader.batch_execute("COMMIT").await.unwrap();

    // A caller whose snapshot is older than what committed since it began truncates nothing.
    c.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .unwrap();
    assert_eq!(prune(&c, "1 hour").await, 0);
    c.batch_execute("COMMIT").await.unwrap();
    assert!(pages(&c, "attempts_0").await > 0);

    assert_eq!(
        prune(&c, "1 hour").await,
        0,
        "the retried message's attempt is kept"
    );
    assert_eq!(pages(&c, "attempts_0").await, 0);
    assert_eq!(history(&c, batch[1].id).await, ["1:RETRYABLE"]);
    db.finish().await;
}

#[tokio::test]
async fn the_log_moves_on_only_to_a_slot_without_pages() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // Four rounds of: an attempt, then the period ends; the fourth cannot move on to slot
    // 0, whose attempt is not older than the retention, until it is.
    for want in [1, 2, 3, 3] {
        enqueue(&c, "t", None).await;
        let got = claim(&c, 1, "w", 60).await;
        complete_batch(&c, "w", &got, &["DISPATCHED"]).await;
        end_period(&c).await;
        prune(&c, "1 hour").await;
        assert_eq!(current_slot(&c).await, want);
    }
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.attempts").await, 4);
    age(&c, "attempts_0").await;
    assert_eq!(prune(&c, "1 hour").await, 1, "slot 0's delivered attempt");
    assert_eq!(pages(&c, "attempts_0").await, 0, "slot 0 was truncated");
    assert_eq!(
        current_slot(&c).await,
        3,
        "but not in time for this call to move on"
    );
    prune(&c, "1 hour").await;
    assert_eq!(current_slot(&c).await, 0, "the next one moves on to it");
    let (code, message) = sqlstate(c.query_one("SELECT outbox.prune_attempts(NULL)", &[]).await);
    assert_eq!(code, "P7001");
    assert!(message.contains("p_older_than"), "{message}");
    db.finish().await;
}

#[tokio::test]
async fn a_kept_history_repeating_a_number_keeps_its_slot_and_retention_goes_on() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // A message retried (attempt 1 in slot 0), whose history is kept in slot 4 once slot 0
    // is truncated.
    let id = enqueue(&c, "t", None).await;
    let got = claim(&c, 1, "w", 60).await;
    complete_batch(&c, "w", &got, &["RETRYABLE"]).await;
    end_period(&c).await;
    prune(&c, "1 hour").await;
    age(&c, "attempts_0").await;
    assert_eq!(prune(&c, "1 hour").await, 0);
    assert_eq!(pages(&c, "attempts_0").await, 0);
    assert_eq!(rows_of(&c, id).await[0].0, 4);

    // An attempt 1 of the same id in slot 1, as an earlier life's history written around
    // enqueue would be, and a delivered message beside it.
    c.execute(
        "INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token) \
         VALUES ($1, 1, 'DISPATCHED', 'elsewhere', gen_random_uuid())",
        &[&id],
    )
    .await
    .unwrap();
    enqueue(&c, "t", None).await;
    let got = claim(&c, 1, "w", 60).await;
    complete_batch(&c, "w", &got, &["DISPATCHED"]).await;
    end_period(&c).await;
    prune(&c, "1 hour").await;
    assert_eq!(current_slot(&c).await, 2);
    age(&c, "attempts_1").await;
    assert_eq!(
        prune(&c, "1 hour").await,
        1,
        "the delivered message's attempt goes row by row; the copy fails on the repeated \
         number, and slot 1 is kept instead of failing the call"
    );
    assert!(pages(&c, "attempts_1").await > 0);
    let mut kept = history(&c, id).await;
    kept.sort();
    assert_eq!(kept, ["1:DISPATCHED", "1:RETRYABLE"], "both rows are kept");
    db.finish().await;
}

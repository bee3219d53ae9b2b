//! `outbox.enqueue`: ids kept or generated (time-ordered), headers, bytes and content
//! type kept, a reused id refused naming it, the jsonb form inlined into the caller's
//! statement, and one wake-up of the listeners per transaction and per window.

use super::*;

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
        plan.contains("outbox.enqueue('t'::text, ")
            && plan.contains("'application/json'::text, NULL::text, NULL::text)"),
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
             FROM outbox.claim_outbox_batch_seq(1, 'w', 30) AS c JOIN outbox.messages AS m USING (outbox_id)",
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

/// The current 2 ms wake-up window, as `outbox.enqueue` numbers it.
const WAKE_WINDOW: &str = "((extract(epoch FROM clock_timestamp()) * 500)::bigint % 2147483647)";

/// Holds, in a session of its own, the keys of the next `windows` 2 ms wake-up windows
/// (the advisory keys `outbox.enqueue` tries), as transactions that won them would.
/// Returns the session and the last window it holds. The first window is read once: read
/// per row, a clock that moved on between two locks would leave a window between them
/// unheld.
async fn hold_wake_windows(db: &TestDb, windows: i64) -> (tokio_postgres::Client, i64) {
    let holder = db.client().await;
    let last: i64 = holder
        .query_one(
            &format!(
                "WITH start AS MATERIALIZED (SELECT {WAKE_WINDOW} AS base)
                 SELECT max(l.held) FROM (
                     SELECT h.held,
                            pg_advisory_lock(hashtext('outbox.wake_relayers'), h.held::integer)
                       FROM (SELECT start.base + w AS held
                               FROM start, generate_series(0, $1::bigint) AS w) AS h) AS l"
            ),
            &[&windows],
        )
        .await
        .unwrap()
        .get(0);
    (holder, last)
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
    // The hold covers 2 s of windows; on a loaded machine the enqueue can come later than
    // that, and then it rightly notifies: such a round is tried again.
    let mut enqueued = 3;
    let mut checked = false;
    for _ in 0..10 {
        let (holder, last_held) = hold_wake_windows(&db, 1000).await;
        enqueue(&c, "orders", None).await;
        enqueued += 1;
        let after: i64 = c
            .query_one(&format!("SELECT {WAKE_WINDOW}"), &[])
            .await
            .unwrap()
            .get(0);
        let woken = tokio::time::timeout(quiet, rx.recv()).await.is_ok();
        holder
            .batch_execute("SELECT pg_advisory_unlock_all()")
            .await
            .unwrap();
        if after <= last_held {
            assert!(!woken, "the window's winner notifies, not every producer");
            checked = true;
            break;
        }
        while tokio::time::timeout(quiet, rx.recv()).await.is_ok() {}
    }
    assert!(
        checked,
        "no enqueue fell within the held windows in 10 rounds"
    );
    enqueue(&c, "orders", None).await;
    tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv())
        .await
        .expect("a lone enqueue notifies")
        .unwrap();
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.messages").await,
        enqueued + 1
    );
    db.finish().await;
}

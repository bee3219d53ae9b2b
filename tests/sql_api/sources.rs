//! The slots through which a fleet shares many outboxes: `serve_source`, `leave_source` and
//! the `source_holders` view.

use super::*;

type Turn = (Option<i32>, Option<i64>, i32, Vec<String>);

async fn serve(c: &tokio_postgres::Client, worker: &str, slots: i32, want: bool, ttl: f64) -> Turn {
    let r = c
        .query_one(
            "SELECT slot, token, members, holders \
             FROM outbox.serve_source($1, $2, $3, make_interval(secs => $4), \
                                      make_interval(secs => $4))",
            &[&worker, &slots, &want, &ttl],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

#[tokio::test]
async fn a_slot_is_held_by_one_worker_until_it_lapses_and_a_takeover_changes_its_token() {
    let db = TestDb::new().await;
    let c = db.client().await;

    let a = serve(&c, "a", 1, true, 60.0).await;
    assert_eq!((a.0, a.1, a.2), (Some(0), Some(1), 1));
    let b = serve(&c, "b", 1, true, 60.0).await;
    assert_eq!((b.0, b.1), (None, None), "the one slot is a's");
    assert_eq!((b.2, b.3), (2, vec!["a".to_owned()]));
    // Renewed: the same slot and token.
    assert_eq!(serve(&c, "a", 1, true, 60.0).await.1, Some(1));

    // a's lease lapses: b takes the slot with the next token; a renewing does not get it back.
    c.batch_execute("UPDATE outbox.source_leases SET expires_at = now() - interval '1 s'")
        .await
        .unwrap();
    let b = serve(&c, "b", 1, true, 60.0).await;
    assert_eq!((b.0, b.1), (Some(0), Some(2)));
    let a = serve(&c, "a", 1, true, 60.0).await;
    assert_eq!((a.0, a.1), (None, None));
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.source_holders").await,
        1
    );

    // b gives it back; a takes it; a leaves.
    assert_eq!(serve(&c, "b", 1, false, 60.0).await.0, None);
    assert_eq!(serve(&c, "a", 1, true, 60.0).await.1, Some(3));
    c.execute("SELECT outbox.leave_source('a')", &[])
        .await
        .unwrap();
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.source_holders").await,
        0
    );
    assert_eq!(
        count(
            &c,
            "SELECT count(*) FROM outbox.source_members WHERE worker_id = 'a'"
        )
        .await,
        0
    );

    // Slots beyond the count asked for are not given out; a worker holds one slot.
    let x = serve(&c, "x", 2, true, 60.0).await;
    let y = serve(&c, "y", 2, true, 60.0).await;
    let z = serve(&c, "z", 2, true, 60.0).await;
    assert_eq!((x.0.is_some(), y.0.is_some(), z.0), (true, true, None));
    assert_eq!(x.0.unwrap() + y.0.unwrap(), 1, "slots 0 and 1");
    assert_eq!(
        serve(&c, "x", 2, true, 60.0).await.0,
        x.0,
        "x keeps its slot"
    );
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.source_leases").await,
        2,
        "a slot row is made when first taken, not for every slot that may be"
    );
    db.finish().await;
}

#[tokio::test]
async fn two_workers_taking_each_others_expired_slots_at_once_never_wait_for_each_other() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // Slot 0 is x's; slot 1 was b's and slot 3 a's, both expired.
    c.batch_execute(
        "INSERT INTO outbox.source_leases (slot, worker_id, token, acquired_at, expires_at) \
         VALUES (0, 'x', 1, now(), now() + interval '1 hour'), \
                (1, 'b', 1, now() - interval '1 hour', now() - interval '1 s'), \
                (3, 'a', 1, now() - interval '1 hour', now() - interval '1 s')",
    )
    .await
    .unwrap();
    // a takes slot 1 and lets slot 3 go, in a transaction left open.
    let a = db.client().await;
    a.batch_execute("BEGIN").await.unwrap();
    let ta = serve(&a, "a", 4, true, 60.0).await;
    assert_eq!(ta.0, Some(1));
    // b, meanwhile, must neither wait for a's rows nor take one of them.
    let b = db.client().await;
    b.batch_execute("SET statement_timeout = '2s'")
        .await
        .unwrap();
    let tb = serve(&b, "b", 4, true, 60.0).await;
    assert_eq!(
        tb.0,
        Some(2),
        "b takes the first slot nobody holds or locks"
    );
    a.batch_execute("COMMIT").await.unwrap();
    let holders: Vec<(i32, String)> = c
        .query(
            "SELECT slot, worker_id FROM outbox.source_holders ORDER BY slot",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        holders,
        vec![
            (0, "x".to_owned()),
            (1, "a".to_owned()),
            (2, "b".to_owned())
        ]
    );
    db.finish().await;
}

#[tokio::test]
async fn two_workers_asking_at_once_never_both_get_the_one_slot() {
    let db = TestDb::new().await;
    for round in 0..20 {
        let (c1, c2) = (db.client().await, db.client().await);
        let (w1, w2) = (format!("p{round}"), format!("q{round}"));
        let (t1, t2) = tokio::join!(
            serve(&c1, &w1, 1, true, 60.0),
            serve(&c2, &w2, 1, true, 60.0)
        );
        assert!(
            t1.0.is_some() != t2.0.is_some() || (t1.0.is_none() && t2.0.is_none()),
            "round {round}: both got the slot: {t1:?} {t2:?}"
        );
        c1.execute(
            "UPDATE outbox.source_leases SET worker_id = NULL, expires_at = NULL",
            &[],
        )
        .await
        .unwrap();
    }
    db.finish().await;
}

#[tokio::test]
async fn serve_source_names_each_bad_argument() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for (sql, argument) in [
        (
            "SELECT * FROM outbox.serve_source(' ', 1, true, '1 s', '1 s')",
            "p_worker_id",
        ),
        (
            "SELECT * FROM outbox.serve_source('w', 0, true, '1 s', '1 s')",
            "p_slots",
        ),
        (
            "SELECT * FROM outbox.serve_source('w', 1025, true, '1 s', '1 s')",
            "p_slots",
        ),
        (
            "SELECT * FROM outbox.serve_source('w', 1, NULL, '1 s', '1 s')",
            "p_want",
        ),
        (
            "SELECT * FROM outbox.serve_source('w', 1, true, '0 s', '1 s')",
            "p_ttl",
        ),
        (
            "SELECT * FROM outbox.serve_source('w', 1, true, '1 s', NULL)",
            "p_member_ttl",
        ),
        ("SELECT outbox.leave_source(NULL)", "p_worker_id"),
    ] {
        let (code, message) = sqlstate(c.batch_execute(sql).await);
        assert_eq!(code, "P7001", "{sql}: {message}");
        assert!(message.contains(argument), "{sql}: {message}");
    }
    db.finish().await;
}

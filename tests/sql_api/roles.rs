//! The roles: `outbox_producer`, `outbox_relay` and `outbox_reader` can do their job and
//! nothing more, and no login without the owner's rights can hold up a claim or a repair.

use super::*;

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
        "SELECT * FROM outbox.claim_outbox_batch_seq(1, 'p', 30)",
        "SELECT * FROM outbox.claim_outbox_batch(1, 'p', 30)",
        "SELECT * FROM outbox.messages",
        "INSERT INTO outbox.messages (topic, payload) VALUES ('t', '\\x00')",
        "SELECT * FROM outbox.status",
        "SELECT * FROM outbox.repair_expired_leases()",
        "SELECT * FROM outbox.circuits",
        "SELECT outbox.report_circuits('p', '{d}', '{open}', ARRAY[now()], interval '1 minute')",
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
    enqueue(&c, "t", None).await;
    let m = claim_kept(&c, 1, "relay", 30)
        .await
        .pop()
        .expect("relay can claim with the claim kept for the previous release");
    complete(&c, &m, "relay", "DISPATCHED", None)
        .await
        .expect("relay can complete what the kept claim leased");
    c.query("SELECT * FROM outbox.repair_expired_leases()", &[])
        .await
        .expect("relay can repair");
    c.query("SELECT * FROM outbox.status", &[])
        .await
        .expect("relay can read status");
    c.query(
        "SELECT outbox.report_circuits('relay', '{d}', '{open}', ARRAY[now()], interval '1 minute')",
        &[],
    )
    .await
    .expect("relay can report its circuits");
    c.query("SELECT * FROM outbox.circuits", &[])
        .await
        .expect("relay can read the circuits");
    for sql in [
        "DELETE FROM outbox.messages",
        "UPDATE outbox.messages SET lease_token = NULL",
        "INSERT INTO outbox.attempts VALUES (gen_random_uuid(), 1, 'DISPATCHED', 'x', gen_random_uuid())",
        "DELETE FROM outbox.dead_letters",
        "UPDATE outbox.attempts SET state = 'FAILED'",
        "DELETE FROM outbox.circuit_reports",
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
        "circuits",
    ] {
        c.query(&format!("SELECT * FROM outbox.{view}"), &[])
            .await
            .unwrap_or_else(|e| panic!("reader cannot read outbox.{view}: {e}"));
    }
    for sql in [
        "SELECT * FROM outbox.messages",
        "SELECT outbox.enqueue('t', '{}'::jsonb)",
        "SELECT * FROM outbox.claim_outbox_batch_seq(1, 'r', 30)",
        "SELECT * FROM outbox.claim_outbox_batch(1, 'r', 30)",
        "SELECT * FROM outbox.circuit_reports",
        "SELECT outbox.report_circuits('r', '{d}', '{open}', ARRAY[now()], interval '1 minute')",
    ] {
        let (code, _) = sqlstate(c.execute(sql, &[]).await);
        assert_eq!(code, "42501", "reader must not run {sql}");
    }
    c.batch_execute("RESET ROLE").await.unwrap();
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

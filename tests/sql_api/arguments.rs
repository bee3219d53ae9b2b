//! Argument checks: every function raises P7001 naming the argument it refuses.

use super::*;

#[tokio::test]
async fn invalid_arguments_raise_p7001_naming_the_argument() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = Uuid::new_v4();
    let cases: &[(&str, &str)] = &[
        (
            "SELECT * FROM outbox.claim_outbox_batch_seq(0, 'w1', 30)",
            "p_batch_size",
        ),
        (
            "SELECT * FROM outbox.claim_outbox_batch_seq(-5, 'w1', 30)",
            "p_batch_size",
        ),
        (
            "SELECT * FROM outbox.claim_outbox_batch_seq(10, '', 30)",
            "p_worker_id",
        ),
        (
            "SELECT * FROM outbox.claim_outbox_batch_seq(10, NULL, 30)",
            "p_worker_id",
        ),
        (
            "SELECT * FROM outbox.claim_outbox_batch_seq(10, 'w1', -1)",
            "p_lease_seconds",
        ),
        (
            "SELECT * FROM outbox.claim_outbox_batch_seq(10, 'w1', 0)",
            "p_lease_seconds",
        ),
        (
            "SELECT * FROM outbox.claim_outbox_batch(0, 'w1', 30)",
            "p_batch_size",
        ),
        (
            "SELECT * FROM outbox.claim_outbox_batch(10, '', 30)",
            "p_worker_id",
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
        (
            "SELECT outbox.report_circuits(' ', '{d}', '{open}', ARRAY[now()], interval '1 minute')",
            "p_worker_id",
        ),
        (
            "SELECT outbox.report_circuits('w1', '{d,d}', '{open,open}', ARRAY[now(), now()], \
             interval '1 minute')",
            "p_destinations",
        ),
        (
            "SELECT outbox.report_circuits('w1', '{\"\"}', '{open}', ARRAY[now()], interval '1 minute')",
            "p_destinations",
        ),
        (
            "SELECT outbox.report_circuits('w1', '{d}', '{ajar}', ARRAY[now()], interval '1 minute')",
            "p_states",
        ),
        (
            "SELECT outbox.report_circuits('w1', '{d,e}', '{open}', ARRAY[now(), now()], \
             interval '1 minute')",
            "p_states",
        ),
        (
            "SELECT outbox.report_circuits('w1', '{d}', '{open}', ARRAY[NULL::timestamptz], \
             interval '1 minute')",
            "p_since",
        ),
        (
            "SELECT outbox.report_circuits('w1', '{d}', '{open}', ARRAY[now()], interval '0')",
            "p_ttl",
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

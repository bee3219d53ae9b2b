//! The claim's topic filters: `p_include_topics` (LIKE patterns of the topics a relayer
//! covers) alone, with `\` escaping `_` and `%`, combined with `p_exclude_topics` and
//! `p_topics`; and what key order does to a covered message behind an uncovered one.

use super::*;

use tokio_postgres::Client;
use tokio_postgres::types::ToSql;

/// The topics `claim_outbox_batch_seq` leases to a fresh worker with these filters, sorted.
async fn claimed_topics(
    c: &Client,
    include: Option<&[&str]>,
    exclude: Option<&[&str]>,
    topics: Option<&[&str]>,
) -> Vec<String> {
    let worker = format!("w-{}", Uuid::new_v4());
    let mut got: Vec<String> = c
        .query(
            "SELECT topic FROM outbox.claim_outbox_batch_seq(100, $1, 30, $2, $3, NULL, NULL, $4)",
            &[&worker as &(dyn ToSql + Sync), &topics, &exclude, &include],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    got.sort();
    got
}

#[tokio::test]
async fn include_patterns_claim_exact_and_prefixed_topics_with_wildcards_escaped() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for topic in [
        "u.created",
        "u.deleted",
        "ux",
        "slow.topic",
        "a_b",
        "axb",
        "50%",
        "500",
    ] {
        enqueue(&c, topic, None).await;
    }
    // Each case claims in a transaction rolled back after it, so that all start from the
    // same eight ready messages.
    async fn savepoint(c: &Client) {
        c.batch_execute("BEGIN").await.unwrap();
    }
    async fn rollback(c: &Client) {
        c.batch_execute("ROLLBACK").await.unwrap();
    }

    // A prefix route (`u.*`) is `u.%`: `ux` is not under it.
    savepoint(&c).await;
    assert_eq!(
        claimed_topics(&c, Some(&["u.%"]), None, None).await,
        ["u.created", "u.deleted"]
    );
    rollback(&c).await;
    // An exact topic with `_` and `%` in it matches itself only, escaped as the relayer
    // writes it (`a\_b`, `50\%`): not `axb`, not `500`.
    savepoint(&c).await;
    assert_eq!(
        claimed_topics(&c, Some(&["a\\_b", "50\\%"]), None, None).await,
        ["50%", "a_b"]
    );
    rollback(&c).await;
    // Unescaped, they are wildcards: the relayer never sends them so.
    savepoint(&c).await;
    assert_eq!(
        claimed_topics(&c, Some(&["a_b", "50%"]), None, None).await,
        ["50%", "500", "a_b", "axb"]
    );
    rollback(&c).await;
    // Combined with exclusions (a destination whose circuit is open) and exact topics:
    // a topic is claimed only when all three admit it.
    savepoint(&c).await;
    assert_eq!(
        claimed_topics(&c, Some(&["u.%", "slow.topic"]), Some(&["u.del%"]), None).await,
        ["slow.topic", "u.created"]
    );
    rollback(&c).await;
    savepoint(&c).await;
    assert_eq!(
        claimed_topics(&c, Some(&["u.%"]), None, Some(&["u.deleted", "slow.topic"])).await,
        ["u.deleted"]
    );
    rollback(&c).await;
    // An empty list covers nothing; NULL covers everything.
    savepoint(&c).await;
    assert!(claimed_topics(&c, Some(&[]), None, None).await.is_empty());
    rollback(&c).await;
    assert_eq!(claimed_topics(&c, None, None, None).await.len(), 8);
    db.finish().await;
}

#[tokio::test]
async fn a_narrow_claim_leaves_uncovered_topics_unleased_and_unattempted() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for _ in 0..5 {
        enqueue(&c, "slow.topic", None).await;
    }
    let covered = enqueue(&c, "u.created", None).await;
    let rows = c
        .query(
            "SELECT outbox_id FROM outbox.claim_outbox_batch_seq(100, 'narrow', 30, \
             NULL, NULL, NULL, NULL, ARRAY['u.%'])",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        rows.iter().map(|r| r.get::<_, Uuid>(0)).collect::<Vec<_>>(),
        [covered]
    );
    assert_eq!(
        count(
            &c,
            "SELECT count(*) FROM outbox.messages \
              WHERE topic = 'slow.topic' AND lease_token IS NULL AND attempt_count = 0"
        )
        .await,
        5
    );
    // Another claim covering them takes them.
    let rows = c
        .query(
            "SELECT topic FROM outbox.claim_outbox_batch_seq(100, 'wide', 30, \
             NULL, NULL, NULL, NULL, ARRAY['slow.topic'])",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 5);
    db.finish().await;
}

/// Key order spans topics: a covered message whose key has an earlier message pending on
/// an uncovered topic is not claimed (it is behind that head) until the head is gone,
/// while the covered topic's other messages, unkeyed or of other keys, are claimed as
/// usual.
#[tokio::test]
async fn a_covered_message_waits_behind_its_keys_head_on_an_uncovered_topic_and_nothing_else_does()
{
    let db = TestDb::new().await;
    let c = db.client().await;
    let blocker = enqueue(&c, "slow.topic", Some("k1")).await;
    let held = enqueue(&c, "u.created", Some("k1")).await;
    let other_key = enqueue(&c, "u.created", Some("k2")).await;
    let unkeyed = enqueue(&c, "u.created", None).await;
    async fn narrow(c: &Client) -> Vec<Uuid> {
        let mut ids: Vec<Uuid> = c
            .query(
                "SELECT outbox_id FROM outbox.claim_outbox_batch_seq(100, 'narrow', 30, \
                 NULL, NULL, NULL, NULL, ARRAY['u.%'])",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        ids.sort();
        ids
    }
    let mut expected = vec![other_key, unkeyed];
    expected.sort();
    assert_eq!(narrow(&c).await, expected, "k1's u.created message is held");

    // The head on the uncovered topic is delivered by a relayer covering it: k1's next
    // message becomes its head and the narrow claim takes it.
    let head = c
        .query_one(
            "SELECT outbox_id, lease_token FROM outbox.claim_outbox_batch_seq(100, 'wide', 30, \
             NULL, NULL, NULL, NULL, ARRAY['slow.%'])",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(head.get::<_, Uuid>(0), blocker);
    c.query(
        "SELECT * FROM outbox.complete_outbox_batch('wide', ARRAY[$1::uuid], ARRAY[$2::uuid], \
         ARRAY['DISPATCHED']::outbox.attempt_state[], ARRAY[NULL::text], ARRAY[NULL::timestamptz])",
        &[&blocker, &head.get::<_, Uuid>(1)],
    )
    .await
    .unwrap();
    assert_eq!(narrow(&c).await, [held]);
    db.finish().await;
}

/// `outbox.uncovered_topics` names the topics whose messages have been ready for the bound
/// and that no unexpired `report_coverage` covers, with the keys they hold on other topics;
/// a withdrawn or expired report covers nothing.
#[tokio::test]
async fn uncovered_topics_are_those_no_live_coverage_report_claims_with_the_keys_they_hold() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "slow.topic", Some("k1")).await;
    enqueue(&c, "slow.topic", Some("k2")).await;
    enqueue(&c, "u.created", Some("k1")).await;
    enqueue(&c, "u.created", Some("k2")).await;
    enqueue(&c, "u.deleted", Some("k2")).await;
    enqueue(&c, "u.created", None).await;
    enqueue(&c, "a_b", None).await;
    async fn uncovered(c: &Client, older_than: &str) -> Vec<(String, i64, i64, Vec<String>)> {
        c.query(
            "SELECT topic, ready, held_keys, held_topics \
               FROM outbox.uncovered_topics($1::text::interval) ORDER BY topic",
            &[&older_than],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
    }
    let u = |t: &str, n: i64, keys: i64, held: &[&str]| {
        (
            t.to_owned(),
            n,
            keys,
            held.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>(),
        )
    };
    // No relayer reports: every topic with ready messages is uncovered.
    assert_eq!(
        uncovered(&c, "0").await,
        [
            u("a_b", 1, 0, &[]),
            u("slow.topic", 2, 2, &["u.created", "u.deleted"]),
            u("u.created", 3, 1, &["u.deleted"]),
            u("u.deleted", 1, 0, &[]),
        ]
    );
    // Not ready for an hour yet: nothing is named.
    assert!(uncovered(&c, "1 hour").await.is_empty());

    // A relayer covering u.* (escaped as the relayer writes patterns), another limited to
    // the exact topic a_b (its routes cover every topic).
    c.execute(
        "SELECT outbox.report_coverage('narrow', ARRAY['u.%'], NULL, '90 seconds')",
        &[],
    )
    .await
    .unwrap();
    c.execute(
        "SELECT outbox.report_coverage('exact', NULL, ARRAY['a_b'], '90 seconds')",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(
        uncovered(&c, "0").await,
        [u("slow.topic", 2, 2, &["u.created", "u.deleted"])]
    );
    // Withdrawn (a clean stop) or expired (a killed relayer): no longer covered.
    c.execute(
        "SELECT outbox.report_coverage('exact', NULL, ARRAY['a_b'], '0')",
        &[],
    )
    .await
    .unwrap();
    c.batch_execute(
        "UPDATE outbox.coverage_reports SET expires_at = now() - interval '1 second' \
          WHERE worker_id = 'narrow'",
    )
    .await
    .unwrap();
    assert_eq!(uncovered(&c, "0").await.len(), 4);

    for (call, argument) in [
        (
            "SELECT * FROM outbox.uncovered_topics(NULL)",
            "p_older_than",
        ),
        (
            "SELECT * FROM outbox.uncovered_topics('-1 second')",
            "p_older_than",
        ),
        (
            "SELECT outbox.report_coverage('w', NULL, NULL, '-1 second')",
            "p_ttl",
        ),
        (
            "SELECT outbox.report_coverage('w', ARRAY[NULL::text], NULL, '1 second')",
            "p_include_topics",
        ),
        (
            "SELECT outbox.report_coverage('', NULL, NULL, '1 second')",
            "p_worker_id",
        ),
    ] {
        let (code, message) = sqlstate(c.query(call, &[]).await);
        assert_eq!(code, "P7001", "{call}");
        assert!(message.contains(argument), "{call}: {message}");
    }
    db.finish().await;
}

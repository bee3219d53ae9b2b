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

/// `outbox.stalled_topics` names, beside the uncovered topics, a topic that every relayer
/// claiming it leaves out while the circuit of its route's destination is open (the
/// issue's case: `orders.dead` routed to a broker that is down, `orders.live` elsewhere,
/// keys with a message on each), with the destinations and the keys held on other topics.
/// A relayer that claims it with a closed circuit, or that reports no routes, clears it.
#[tokio::test]
async fn stalled_topics_name_a_topic_every_claiming_relayer_holds_behind_an_open_circuit() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for k in ["k1", "k2", "k3"] {
        enqueue(&c, "orders.dead", Some(k)).await;
        enqueue(&c, "orders.live", Some(k)).await;
        enqueue(&c, "orders.live", Some(k)).await;
    }
    enqueue(&c, "orders.live", None).await;
    enqueue(&c, "misc", None).await;
    type Row = (String, String, Vec<String>, i64, i64, Vec<String>);
    async fn stalled(c: &Client) -> Vec<Row> {
        c.query(
            "SELECT topic, cause, destinations, ready, held_keys, held_topics \
               FROM outbox.stalled_topics('0') ORDER BY topic, cause",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
        .collect()
    }
    let row = |t: &str, cause: &str, d: &[&str], n: i64, keys: i64, held: &[&str]| -> Row {
        let owned = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        (
            t.to_owned(),
            cause.to_owned(),
            owned(d),
            n,
            keys,
            owned(held),
        )
    };
    let report = |worker: &'static str, circuit: &'static str| {
        let c = &c;
        async move {
            // Routes in order: orders.dead to mqtt, orders.% (the rest) to kinesis, misc to
            // stdout; include_topics as the relayer writes them.
            c.execute(
                "SELECT outbox.report_coverage($1, ARRAY['orders.dead', 'orders.%', 'misc'], \
                        NULL, '90 seconds', ARRAY['orders.dead', 'orders.%', 'misc'], \
                        ARRAY['mqtt', 'kinesis', 'stdout'])",
                &[&worker],
            )
            .await
            .unwrap();
            c.execute(
                "SELECT outbox.report_circuits($1, '{mqtt,kinesis,stdout}', \
                        ARRAY[$2, 'closed', 'closed'], ARRAY[now(), now(), now()], \
                        interval '90 seconds')",
                &[&worker, &circuit],
            )
            .await
            .unwrap();
        }
    };

    // Nobody reports yet: every topic with ready messages is uncovered.
    assert_eq!(
        stalled(&c).await,
        [
            row("misc", "uncovered", &[], 1, 0, &[]),
            row("orders.dead", "uncovered", &[], 3, 3, &["orders.live"]),
            row("orders.live", "uncovered", &[], 7, 0, &[]),
        ]
    );

    // Two relayers cover everything, both with mqtt's circuit open (one half-open):
    // orders.dead is held, naming mqtt and the three keys whose orders.live messages wait.
    report("r1", "open").await;
    report("r2", "half-open").await;
    assert_eq!(
        stalled(&c).await,
        [row(
            "orders.dead",
            "circuit_open",
            &["mqtt"],
            3,
            3,
            &["orders.live"]
        )]
    );
    // The same figures through uncovered_topics' older contract: nothing is uncovered.
    let uncovered: i64 = c
        .query_one("SELECT count(*) FROM outbox.uncovered_topics('0')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(uncovered, 0);

    // One claiming relayer whose circuit is closed again: orders.dead moves, not held.
    report("r2", "closed").await;
    assert!(stalled(&c).await.is_empty());

    // A relayer that reports no routes (a release before them) never holds a topic.
    report("r2", "open").await;
    c.execute(
        "SELECT outbox.report_coverage('r3', NULL, NULL, '90 seconds')",
        &[],
    )
    .await
    .unwrap();
    assert!(stalled(&c).await.is_empty());

    // An expired circuit report holds nothing either: r1 alone, its report of mqtt expired.
    for w in ["r2", "r3"] {
        c.execute("SELECT outbox.report_coverage($1, NULL, NULL, '0')", &[&w])
            .await
            .unwrap();
    }
    c.batch_execute(
        "UPDATE outbox.circuit_reports SET expires_at = now() - interval '1 second' \
          WHERE worker_id = 'r1'",
    )
    .await
    .unwrap();
    assert!(stalled(&c).await.is_empty());

    for (call, argument) in [
        ("SELECT * FROM outbox.stalled_topics(NULL)", "p_older_than"),
        (
            "SELECT outbox.report_coverage('w', NULL, NULL, '1 second', ARRAY['a%'], NULL)",
            "p_route_destinations",
        ),
        (
            "SELECT outbox.report_coverage('w', NULL, NULL, '1 second', ARRAY['a%'], '{x,y}')",
            "p_route_destinations",
        ),
        (
            "SELECT outbox.report_coverage('w', NULL, NULL, '1 second', ARRAY[NULL::text], '{x}')",
            "p_route_patterns",
        ),
    ] {
        let (code, message) = sqlstate(c.query(call, &[]).await);
        assert_eq!(code, "P7001", "{call}");
        assert!(message.contains(argument), "{call}: {message}");
    }
    db.finish().await;
}

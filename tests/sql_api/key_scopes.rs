//! The scope of a key's order (`outbox.set_key_order_scope`, `schema/03_enqueue.sql`): a key
//! ordered per topic is delivered on its topic while its message on another topic waits;
//! the default, the whole outbox, makes it wait; a change of scope leaves the messages
//! already pending in the order they were given; bad rules are refused with P7001; the most
//! specific rule wins.

use super::*;

use tokio_postgres::Client;

/// Claims up to `n` messages of `topics` for `worker`: (id, topic, payload's `n`, seq), in
/// the order the claim returns them.
async fn claim_on(
    c: &Client,
    n: i32,
    worker: &str,
    topics: &[&str],
) -> Vec<(Uuid, Uuid, String, i64, i64)> {
    c.query(
        "SELECT outbox_id, lease_token, topic, (convert_from(payload, 'UTF8')::jsonb ->> 'n')::bigint, seq \
         FROM outbox.claim_outbox_batch_seq($1, $2, 30, $3::text[])",
        &[&n, &worker, &topics],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
    .collect()
}

/// Enqueues one message of `topic` under `key` whose payload is `{"n": n}`.
async fn enqueue_n(c: &Client, topic: &str, key: &str, n: i64) -> Uuid {
    c.query_one(
        "SELECT outbox.enqueue($1, jsonb_build_object('n', $3::bigint), $2)",
        &[&topic, &key, &n],
    )
    .await
    .unwrap()
    .get(0)
}

async fn deliver(c: &Client, worker: &str, id: Uuid, token: Uuid) {
    c.query_one(
        "SELECT outbox.complete_outbox_attempt($1, $2, $3, 'DISPATCHED')",
        &[&id, &token, &worker],
    )
    .await
    .unwrap();
}

/// One message of key `k` on `orders.dead`, then ten on `orders.live`.
async fn dead_then_live(c: &Client) -> Uuid {
    let dead = enqueue_n(c, "orders.dead", "k", 0).await;
    for n in 1..=10 {
        enqueue_n(c, "orders.live", "k", n).await;
    }
    dead
}

#[tokio::test]
async fn a_key_scoped_per_topic_is_delivered_on_its_topic_while_its_other_topic_waits() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let before: Option<String> = c
        .query_one(
            "SELECT outbox.set_key_order_scope('orders.%', 'topic')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(before, None, "orders.% had no rule");
    let dead = dead_then_live(&c).await;

    // The message on orders.dead is claimed and fails, to be tried again in an hour.
    let failing = claim_on(&c, 10, "dead-worker", &["orders.dead"]).await;
    assert_eq!(
        failing.iter().map(|m| m.0).collect::<Vec<_>>(),
        [dead],
        "the head of k on orders.dead"
    );
    c.query_one(
        "SELECT outbox.complete_outbox_attempt($1, $2, 'dead-worker', 'RETRYABLE', 'down', \
         now() + interval '1 hour')",
        &[&failing[0].0, &failing[0].1],
    )
    .await
    .unwrap();

    // The ten on orders.live are claimed and delivered, one at a time, in enqueue order.
    let mut delivered = Vec::new();
    let mut seqs = Vec::new();
    for _ in 0..10 {
        let got = claim_on(&c, 1, "live-worker", &["orders.live"]).await;
        assert_eq!(got.len(), 1, "k's next message on orders.live is claimable");
        assert_eq!(got[0].2, "orders.live");
        deliver(&c, "live-worker", got[0].0, got[0].1).await;
        delivered.push(got[0].3);
        seqs.push(got[0].4);
    }
    assert_eq!(delivered, (1..=10).collect::<Vec<i64>>(), "in key order");
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "seqs rise: {seqs:?}");

    // The one on orders.dead still waits for its retry, and is all that is left.
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.messages").await,
        1,
        "only the failing message is pending"
    );
    assert!(
        claim_on(&c, 10, "dead-worker", &["orders.dead"])
            .await
            .is_empty(),
        "the failing message waits for its retry"
    );
    db.finish().await;
}

#[tokio::test]
async fn by_default_a_key_waits_across_topics_for_its_message_on_another_topic() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let scope: String = c
        .query_one("SELECT outbox.key_order_scope('orders.live')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(scope, "global", "the whole outbox is the default");
    let dead = dead_then_live(&c).await;

    assert!(
        claim_on(&c, 10, "live-worker", &["orders.live"])
            .await
            .is_empty(),
        "k's messages on orders.live wait behind its unclaimed message on orders.dead"
    );
    let failing = claim_on(&c, 10, "dead-worker", &["orders.dead"]).await;
    assert_eq!(failing.iter().map(|m| m.0).collect::<Vec<_>>(), [dead]);
    c.query_one(
        "SELECT outbox.complete_outbox_attempt($1, $2, 'dead-worker', 'RETRYABLE', 'down', \
         now() + interval '1 hour')",
        &[&failing[0].0, &failing[0].1],
    )
    .await
    .unwrap();
    assert!(
        claim_on(&c, 10, "live-worker", &["orders.live"])
            .await
            .is_empty(),
        "and behind it while it waits for its retry"
    );
    db.finish().await;
}

#[tokio::test]
async fn stalled_topics_names_no_held_key_on_a_topic_scoped_per_topic() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // Both setups side by side: key a on topics ordered across the outbox, key b on topics
    // ordered per topic. No relayer reports coverage, so every ready topic is uncovered.
    c.execute("SELECT outbox.set_key_order_scope('p.%', 'topic')", &[])
        .await
        .unwrap();
    enqueue(&c, "o.first", Some("a")).await;
    enqueue(&c, "o.second", Some("a")).await;
    enqueue(&c, "p.first", Some("b")).await;
    enqueue(&c, "p.second", Some("b")).await;
    let rows = c
        .query(
            "SELECT topic, held_keys, held_topics FROM outbox.stalled_topics(interval '0') \
             ORDER BY topic",
            &[],
        )
        .await
        .unwrap();
    let got: Vec<(String, i64, Vec<String>)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        got,
        [
            ("o.first".to_owned(), 1, vec!["o.second".to_owned()]),
            ("o.second".to_owned(), 0, vec![]),
            ("p.first".to_owned(), 0, vec![]),
            ("p.second".to_owned(), 0, vec![]),
        ],
        "a's message on o.second is held behind o.first; b's messages hold nothing"
    );
    db.finish().await;
}

#[tokio::test]
async fn a_change_of_scope_never_reorders_a_key_on_one_topic() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let order_key = |id: Uuid| {
        let c = &c;
        async move {
            let row = c
                .query_one(
                    "SELECT order_key, behind FROM outbox.messages WHERE outbox_id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            (row.get::<_, String>(0), row.get::<_, bool>(1))
        }
    };
    // Enqueued under the default: k on b.y waits for k on b.x; m is pending on b.x only.
    let first = enqueue_n(&c, "b.x", "k", 1).await;
    let old = enqueue_n(&c, "b.y", "k", 2).await;
    let m_x = enqueue_n(&c, "b.x", "m", 3).await;
    c.execute("SELECT outbox.set_key_order_scope('b.%', 'topic')", &[])
        .await
        .unwrap();
    // After the change: k still has a message pending on b.y under the whole outbox, so its
    // new message there keeps that order key and waits behind it; m has nothing pending on
    // b.y, so its new message there is ordered on b.y alone.
    let new = enqueue_n(&c, "b.y", "k", 4).await;
    let m_y = enqueue_n(&c, "b.y", "m", 5).await;
    assert_eq!(order_key(old).await, ("k".to_owned(), true));
    assert_eq!(
        order_key(new).await,
        ("k".to_owned(), true),
        "k's new message on b.y keeps its place behind k's pending message there"
    );
    assert_eq!(order_key(m_y).await, ("m\u{1f}b.y".to_owned(), false));

    let got: Vec<Uuid> = claim_on(&c, 10, "y", &["b.y"])
        .await
        .iter()
        .map(|m| m.0)
        .collect();
    assert_eq!(
        got,
        [m_y],
        "m on b.y is its own head; k's messages on b.y still wait for b.x"
    );

    // Once b.x is delivered, k's messages on b.y go in their enqueue order.
    let x = claim_on(&c, 10, "x", &["b.x"]).await;
    let mut x_ids: Vec<Uuid> = x.iter().map(|m| m.0).collect();
    x_ids.sort();
    let mut expected = vec![first, m_x];
    expected.sort();
    assert_eq!(x_ids, expected);
    for m in &x {
        deliver(&c, "x", m.0, m.1).await;
    }
    let y = claim_on(&c, 10, "y2", &["b.y"]).await;
    let got: Vec<Uuid> = y.iter().map(|m| m.0).collect();
    assert_eq!(
        got.first(),
        Some(&old),
        "k's older message on b.y comes first"
    );
    assert!(
        got == [old] || got == [old, new],
        "then its newer one, never before: {got:?} (old {old}, new {new})"
    );
    for m in &y {
        deliver(&c, "y2", m.0, m.1).await;
    }
    if got == [old] {
        let y = claim_on(&c, 10, "y3", &["b.y"]).await;
        assert_eq!(y.iter().map(|m| m.0).collect::<Vec<_>>(), [new]);
        deliver(&c, "y3", y[0].0, y[0].1).await;
    }
    // Nothing of k is pending on b.y now: its next message there is ordered on b.y alone.
    let next = enqueue_n(&c, "b.y", "k", 6).await;
    assert_eq!(order_key(next).await, ("k\u{1f}b.y".to_owned(), false));

    // Removing the rule brings the whole outbox back, with the same care: m's message still
    // pending on b.y keeps m's next message there behind it.
    let had: bool = c
        .query_one("SELECT outbox.unset_key_order_scope('b.%')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(had);
    let m_y2 = enqueue_n(&c, "b.y", "m", 7).await;
    assert_eq!(order_key(m_y2).await, ("m\u{1f}b.y".to_owned(), true));
    let z = enqueue_n(&c, "b.y", "z", 8).await;
    assert_eq!(order_key(z).await, ("z".to_owned(), false));
    let later = enqueue_n(&c, "b.x", "z", 9).await;
    assert_eq!(
        order_key(later).await,
        ("z".to_owned(), true),
        "z on b.x waits again for z's message pending on b.y"
    );
    let had: bool = c
        .query_one("SELECT outbox.unset_key_order_scope('b.%')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!had, "the rule is gone");
    db.finish().await;
}

#[tokio::test]
async fn the_most_specific_rule_decides_a_topics_scope() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for (pattern, scope) in [
        ("%", "topic"),
        ("orders.%", "global"),
        ("orders.audit.%", "topic"),
        ("orders.audit.keep", "global"),
    ] {
        c.execute(
            "SELECT outbox.set_key_order_scope($1, $2)",
            &[&pattern, &scope],
        )
        .await
        .unwrap();
    }
    let replaced: Option<String> = c
        .query_one("SELECT outbox.set_key_order_scope('%', 'topic')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(replaced.as_deref(), Some("topic"), "the previous scope");
    for (topic, expected) in [
        ("payments", "topic"),
        ("orders.created", "global"),
        ("orders.audit.read", "topic"),
        ("orders.audit.keep", "global"),
    ] {
        let scope: String = c
            .query_one("SELECT outbox.key_order_scope($1)", &[&topic])
            .await
            .unwrap()
            .get(0);
        assert_eq!(scope, expected, "{topic}");
    }
    let listed: Vec<String> = c
        .query("SELECT topic_pattern FROM outbox.key_order_scopes", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        listed,
        ["orders.audit.keep", "orders.audit.%", "orders.%", "%"],
        "most specific first"
    );
    db.finish().await;
}

#[tokio::test]
async fn bad_key_order_rules_are_refused_with_p7001_naming_the_argument() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for (sql, argument, problem) in [
        (
            "SELECT outbox.set_key_order_scope('', 'topic')",
            "p_topic_pattern",
            "non-empty",
        ),
        (
            "SELECT outbox.set_key_order_scope(NULL, 'topic')",
            "p_topic_pattern",
            "non-empty",
        ),
        (
            "SELECT outbox.set_key_order_scope('orders.%', 'key')",
            "p_scope",
            "'key'",
        ),
        (
            "SELECT outbox.set_key_order_scope('orders.%', NULL)",
            "p_scope",
            "NULL",
        ),
        (
            "SELECT outbox.unset_key_order_scope('')",
            "p_topic_pattern",
            "non-empty",
        ),
    ] {
        let (code, message) = sqlstate(c.query(sql, &[]).await.map(|rows| rows.len()));
        assert_eq!(code, "P7001", "{sql} → {message}");
        assert!(
            message.contains(argument) && message.contains(problem),
            "{sql}: message {message:?} must name {argument} and {problem}"
        );
    }
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.key_order_scopes").await,
        0,
        "nothing was set"
    );
    db.finish().await;
}

#[tokio::test]
async fn the_console_finds_a_key_on_every_topic_and_counts_what_each_message_waits_for() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.execute("SELECT outbox.set_key_order_scope('t.%', 'topic')", &[])
        .await
        .unwrap();
    let u = enqueue(&c, "u", Some("k")).await;
    let a1 = enqueue(&c, "t.a", Some("k")).await;
    let a2 = enqueue(&c, "t.a", Some("k")).await;
    let b1 = enqueue(&c, "t.b", Some("k")).await;
    // keys that extend k: never k's
    enqueue(&c, "t.b", Some("k\u{1}")).await;
    enqueue(&c, "t.b", Some("kk")).await;
    enqueue(&c, "u", Some("kk")).await;

    let mut found: Vec<Uuid> = c
        .query(
            "SELECT outbox_id FROM outbox.console_messages(NULL, NULL, 'k', NULL, NULL, NULL, 50)",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    found.sort();
    let mut expected = vec![u, a1, a2, b1];
    expected.sort();
    assert_eq!(found, expected, "k's messages on every topic, and only k's");

    for (id, ahead, head) in [(u, 0, u), (a1, 0, a1), (a2, 1, a1), (b1, 0, b1)] {
        let row = c
            .query_one(
                "SELECT ahead, key_head, state FROM outbox.console_message($1, false)",
                &[&id],
            )
            .await
            .unwrap();
        assert_eq!(row.get::<_, i64>(0), ahead, "{id}: messages ahead");
        assert_eq!(row.get::<_, Uuid>(1), head, "{id}: its key's head");
        let state: String = row.get(2);
        assert_eq!(state, if id == a2 { "waiting" } else { "ready" }, "{id}");
    }
    db.finish().await;
}

/// Which of `order_keys` the session `c` holds the completion lock of (the advisory lock
/// outbox.lock_keys takes: classid hashtext('outbox.key'), objid hashtext(order key)), and
/// how many completion locks it holds in all.
async fn completion_locks_held(c: &Client, order_keys: &[&str]) -> (Vec<String>, i64) {
    let row = c
        .query_one(
            "SELECT coalesce((SELECT array_agg(k ORDER BY k)
                                FROM unnest($1::text[]) AS k
                               WHERE EXISTS (SELECT 1
                                               FROM pg_locks AS l
                                              WHERE l.locktype = 'advisory'
                                                AND l.pid = pg_backend_pid()
                                                AND l.granted
                                                AND l.classid = hashtext('outbox.key')::oid
                                                AND l.objid = hashtext(k)::oid
                                                AND l.objsubid = 2)), '{}'),
                    (SELECT count(*)
                       FROM pg_locks AS l
                      WHERE l.locktype = 'advisory'
                        AND l.pid = pg_backend_pid()
                        AND l.classid = hashtext('outbox.key')::oid
                        AND l.objsubid = 2)",
            &[&order_keys],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test]
async fn a_completion_locks_its_order_key_and_its_message_key() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.execute("SELECT outbox.set_key_order_scope('b', 'topic')", &[])
        .await
        .unwrap();
    c.execute("SELECT outbox.set_key_order_scope('c', 'topic')", &[])
        .await
        .unwrap();
    // Key a ordered per topic on b, and key "a<US>b" ordered across the whole outbox (on g):
    // two message_keys, one order key, one chain. Key a ordered per topic on c: another chain.
    let a_on_b = enqueue(&c, "b", Some("a")).await;
    let global = enqueue(&c, "g", Some("a\u{1f}b")).await;
    let a_on_c = enqueue(&c, "c", Some("a")).await;
    let order_key = |id: Uuid| {
        let c = &c;
        async move {
            c.query_one(
                "SELECT order_key FROM outbox.messages WHERE outbox_id = $1",
                &[&id],
            )
            .await
            .unwrap()
            .get::<_, String>(0)
        }
    };
    let chain = "a\u{1f}b";
    assert_eq!(order_key(a_on_b).await, chain);
    assert_eq!(
        order_key(global).await,
        chain,
        "the global key shares a's order key on b"
    );
    assert_eq!(order_key(a_on_c).await, "a\u{1f}c");
    let distinct_hashes: bool = c
        .query_one(
            "SELECT hashtext('a') <> hashtext(E'a\\x1fb') AND hashtext(E'a\\x1fb') <> hashtext(E'a\\x1fc')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        distinct_hashes,
        "the keys' hashes differ, so the locks below tell them apart"
    );

    // The completion of a on b holds its chain's lock and its message_key's, no other.
    let holder = db.client().await;
    holder.batch_execute("BEGIN").await.unwrap();
    holder
        .execute("SELECT outbox.lock_keys(ARRAY[$1::uuid])", &[&a_on_b])
        .await
        .unwrap();
    assert_eq!(
        completion_locks_held(&holder, &["a", chain, "a\u{1f}c"]).await,
        (vec!["a".to_owned(), chain.to_owned()], 2),
        "a on b is locked by its order key and its message_key"
    );

    // The global key's completion needs that very lock: it is not free, and lock_keys
    // waits for it until the holder ends.
    let other = db.client().await;
    let free: bool = other
        .query_one(
            "SELECT pg_try_advisory_xact_lock(hashtext('outbox.key'), hashtext(order_key)) \
             FROM outbox.messages WHERE outbox_id = $1",
            &[&global],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        !free,
        "the lock of the global key's completion is the one a on b holds"
    );
    let waiting = backend_pid(&other).await;
    let completion = tokio::spawn(async move {
        other.batch_execute("BEGIN").await.unwrap();
        other
            .execute("SELECT outbox.lock_keys(ARRAY[$1::uuid])", &[&global])
            .await
            .unwrap();
        let held = completion_locks_held(&other, &[chain]).await;
        other.batch_execute("COMMIT").await.unwrap();
        held
    });
    until_waiting_for_a_lock(
        &c,
        waiting,
        "the global key's completion lock to wait for a on b's",
    )
    .await;
    assert!(!completion.is_finished());

    // a on c, another chain of the same message_key: its own chain's lock is free, its
    // message_key's is the one a on b holds (so its completion would wait for a on b's).
    let per_topic = db.client().await;
    let row = per_topic
        .query_one(
            "SELECT pg_try_advisory_lock(hashtext('outbox.key'), hashtext(order_key)), \
                    pg_try_advisory_lock(hashtext('outbox.key'), hashtext(message_key)) \
               FROM outbox.messages WHERE outbox_id = $1",
            &[&a_on_c],
        )
        .await
        .unwrap();
    let (own_chain_free, message_key_free): (bool, bool) = (row.get(0), row.get(1));
    assert!(own_chain_free, "a on c's chain has a lock of its own");
    assert!(
        !message_key_free,
        "a on c shares its message_key's lock with a on b"
    );
    per_topic
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .unwrap();

    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        completion.await.unwrap(),
        (vec![chain.to_owned()], 1),
        "the global key's completion got the chain's lock once a on b's ended"
    );
    db.finish().await;
}

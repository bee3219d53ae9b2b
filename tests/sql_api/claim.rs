//! `outbox.claim_outbox_batch_seq`: what a claim returns and leases, fresh tokens, delayed
//! and leased messages skipped, the byte budget, the shards' turns (a held shard is passed, no
//! shard waits behind the others' backlog) and concurrent claimers that never share a
//! message; and `outbox.claim_outbox_batch`, kept for relayers of the previous release, which
//! leases the same messages and returns the same rows without seq.

use super::*;

#[tokio::test]
async fn happy_path_claims_completes_and_records_one_attempt() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let id = enqueue(&c, "orders", Some("customer-1")).await;

    let row = c
        .query_one(
            "SELECT * FROM outbox.claim_outbox_batch_seq(10, 'w1', 30)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Uuid>("outbox_id"), id);
    assert_eq!(row.get::<_, String>("topic"), "orders");
    assert_eq!(
        row.get::<_, Option<String>>("message_key").as_deref(),
        Some("customer-1")
    );
    assert_eq!(row.get::<_, Vec<u8>>("payload"), br#"{"n": 1}"#);
    assert_eq!(row.get::<_, String>("content_type"), "application/json");
    assert_eq!(row.get::<_, i32>("attempt_no"), 1);
    let leased = c
        .query_one(
            "SELECT claimed_by, lease_token, lease_expires_at > now() + interval '25 seconds', seq \
             FROM outbox.messages WHERE outbox_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, i64>("seq"),
        leased.get::<_, i64>(3),
        "the claim returns the message's seq"
    );
    assert_eq!(leased.get::<_, String>(0), "w1");
    assert_eq!(leased.get::<_, Uuid>(1), row.get::<_, Uuid>("lease_token"));
    assert!(
        leased.get::<_, bool>(2),
        "lease must run for the requested 30 s"
    );

    let m = Claimed {
        id,
        token: row.get("lease_token"),
        attempt_no: 1,
        key: None,
        seq: Some(row.get("seq")),
    };
    assert_eq!(complete(&c, &m, "w1", "DISPATCHED", None).await.unwrap(), 1);
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.messages").await, 0);
    assert_eq!(history(&c, id).await, ["1:DISPATCHED"]);
    let attempt = c
        .query_one("SELECT worker_id, lease_token FROM outbox.attempts", &[])
        .await
        .unwrap();
    assert_eq!(attempt.get::<_, String>(0), "w1");
    assert_eq!(attempt.get::<_, Uuid>(1), m.token);
    db.finish().await;
}

#[tokio::test]
async fn claim_gives_each_message_a_fresh_token_and_skips_leased_and_delayed_ones() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for _ in 0..3 {
        enqueue(&c, "t", None).await;
    }
    c.execute(
        "SELECT outbox.enqueue('t', '{}'::jsonb, p_available_at => now() + interval '1 hour')",
        &[],
    )
    .await
    .unwrap();
    let first = claim(&c, 2, "w1", 30).await;
    assert_eq!(first.len(), 2);
    assert_ne!(first[0].token, first[1].token);
    let second = claim(&c, 10, "w2", 30).await;
    assert_eq!(
        second.len(),
        1,
        "one ready message left; the delayed one is not claimable"
    );
    assert!(claim(&c, 10, "w3", 30).await.is_empty());
    db.finish().await;
}

#[tokio::test]
async fn a_claim_keeps_to_its_byte_budget_and_withholds_oversized_payloads() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // Ids of one claim shard, so that the claim meets the messages in enqueue order.
    let ids: Vec<Uuid> = c
        .query(
            "SELECT id FROM (SELECT gen_random_uuid() AS id FROM generate_series(1, 500)) AS g \
              WHERE hashtext(id::text) & 15 = 0 LIMIT 5",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for (size, id) in [600, 600, 600, 5000, 10].into_iter().zip(&ids) {
        c.execute(
            "SELECT outbox.enqueue('t', decode(repeat('ab', $1), 'hex'), p_outbox_id => $2)",
            &[&size, id],
        )
        .await
        .unwrap();
    }
    let sizes = |rows: Vec<tokio_postgres::Row>| -> Vec<(i64, bool)> {
        let mut sizes: Vec<(i64, bool)> = rows
            .iter()
            .map(|r| (r.get(0), r.get::<_, Option<Vec<u8>>>(1).is_none()))
            .collect();
        sizes.sort_unstable();
        sizes
    };
    let claim_sized = "SELECT payload_bytes, payload FROM outbox.claim_outbox_batch_seq(10, 'w', 30, \
                       p_max_bytes => $1, p_max_message_bytes => $2)";
    // 600 + 600 is within 1000 before the second is added; the third would start past it.
    let first = sizes(c.query(claim_sized, &[&1000_i64, &2000_i64]).await.unwrap());
    assert_eq!(first, [(600, false), (600, false)]);
    // The oversized one comes back without its payload and does not use the budget.
    let second = sizes(c.query(claim_sized, &[&700_i64, &2000_i64]).await.unwrap());
    assert_eq!(second, [(10, false), (600, false), (5000, true)]);
    db.finish().await;
}

#[tokio::test]
async fn a_claim_that_holds_its_shards_does_not_hold_up_claims_of_the_others() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for _ in 0..200 {
        enqueue(&c, "t", None).await;
    }
    // A claim that has not ended (as a slow one would not have): it holds the turns of the
    // shards it took its messages from.
    let slow = db.client().await;
    slow.batch_execute("BEGIN").await.unwrap();
    let held: HashSet<Uuid> = claim(&slow, 20, "slow", 30)
        .await
        .iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(held.len(), 20);

    // Another claim is not held up, and takes the messages of the other shards (those left
    // in the slow claim's shards wait for its end).
    c.batch_execute("SET statement_timeout = '5s'")
        .await
        .unwrap();
    let other = claim(&c, 200, "fast", 30).await;
    assert!(other.len() >= 100, "{} claimed", other.len());
    assert!(other.iter().all(|m| !held.contains(&m.id)));
    slow.batch_execute("COMMIT").await.unwrap();
    let rest = claim(&c, 200, "fast", 30).await;
    assert_eq!(held.len() + other.len() + rest.len(), 200);

    // With every shard's turn taken, a claim waits for one: the turns still keep claims
    // from walking a shard together.
    for _ in 0..10 {
        enqueue(&c, "t", None).await;
    }
    let owner = db.client().await;
    owner
        .batch_execute("BEGIN; SELECT * FROM outbox.turns WHERE name LIKE 'claim:%' FOR UPDATE")
        .await
        .unwrap();
    c.batch_execute("SET statement_timeout = '500ms'")
        .await
        .unwrap();
    let (code, _) = sqlstate(
        c.query(
            "SELECT * FROM outbox.claim_outbox_batch_seq(10, 'w', 30)",
            &[],
        )
        .await,
    );
    assert_eq!(
        code, "57014",
        "the claim waited for a turn until the timeout"
    );
    owner.batch_execute("COMMIT").await.unwrap();
    assert_eq!(claim(&c, 10, "w", 30).await.len(), 10);
    db.finish().await;
}

#[tokio::test]
async fn no_shard_waits_behind_the_backlog_of_the_others() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // The oldest message, in the last shard, then 10,000 newer ones spread over all 16: a
    // claim of 10 fills from the first shard it visits, so claims that visited the shards
    // in a fixed order would take the other 15 shards' 9,400 or so first (the 400 claims
    // allowed below take 4,000).
    let key: String = c
        .query_one(
            "SELECT k FROM generate_series(1, 1000) AS i, LATERAL (SELECT 'old-' || i AS k) AS x \
             WHERE (hashtext(k) & 15) = 15 ORDER BY i LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let old = enqueue(&c, "t", Some(&key)).await;
    c.batch_execute("SELECT outbox.enqueue('t', '{}'::jsonb) FROM generate_series(1, 10000)")
        .await
        .unwrap();
    // A claim starts at a random shard, so the old message's shard is the first visited by
    // one claim in 16: missing it 400 times in a row has a chance of about 1 in 10^11.
    let mut claims = 0;
    loop {
        let batch = claim(&c, 10, "w", 300).await;
        assert_eq!(batch.len(), 10);
        claims += 1;
        if batch.iter().any(|m| m.id == old) {
            break;
        }
        assert!(
            claims < 400,
            "the oldest message was not claimed in {claims} claims"
        );
    }
    db.finish().await;
}

#[tokio::test]
async fn a_claim_passes_a_held_shard_without_reading_its_leased_messages() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // 3,000 messages in shard 0 (each the only one of its key, so each is a head), all
    // leased, and one ready message in shard 7.
    let in_shard = |shard: i32, n: i64| {
        format!(
            "SELECT outbox.enqueue('t', '{{}}'::jsonb, k) \
               FROM (SELECT 'k' || i AS k FROM generate_series(1, 1000000) AS i \
                      WHERE (hashtext('k' || i) & 15) = {shard} LIMIT {n}) AS x"
        )
    };
    c.batch_execute(&in_shard(0, 3000)).await.unwrap();
    assert_eq!(claim(&c, 5000, "first", 300).await.len(), 3000);
    c.batch_execute(&in_shard(7, 1)).await.unwrap();

    // Another claim holds shard 0's turn. A claim of 10 has room after shard 7, so it
    // reaches shard 0 wherever it starts, and must pass it at the cost of one index entry
    // instead of reading its 3,000 leased messages.
    let owner = db.client().await;
    owner
        .batch_execute("BEGIN; SELECT * FROM outbox.turns WHERE name = 'claim:0' FOR UPDATE")
        .await
        .unwrap();
    // The index's counts since this session last reported them: report them now, then
    // read what the claim alone adds.
    c.batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    c.batch_execute("BEGIN").await.unwrap();
    let got = claim(&c, 10, "second", 300).await;
    let read: i64 = c
        .query_one(
            "SELECT sum(pg_stat_get_xact_tuples_returned(p.relid))::bigint \
               FROM pg_partition_tree('outbox.messages_shard_heads_idx') AS p WHERE p.isleaf",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    c.batch_execute("COMMIT").await.unwrap();
    owner.batch_execute("COMMIT").await.unwrap();
    assert_eq!(got.len(), 1, "the message of shard 7");
    assert!(
        read < 100,
        "the claim read {read} entries of the shards' index"
    );
    db.finish().await;
}

#[tokio::test]
async fn eight_concurrent_claimers_never_receive_the_same_message_twice() {
    const MESSAGES: i64 = 20_000;
    let db = TestDb::new().await;
    let c = db.client().await;
    c.execute(
        "INSERT INTO outbox.messages (topic, message_key, payload) \
         SELECT 't', CASE WHEN i % 10 = 0 THEN 'k' || (i % 50) END, '\\x7b7d' \
         FROM generate_series(1, $1::bigint) AS i",
        &[&MESSAGES],
    )
    .await
    .unwrap();

    let mut workers = Vec::new();
    for w in 0..8 {
        let client = db.client().await;
        workers.push(tokio::spawn(async move {
            let worker = format!("w{w}");
            let mut seen = Vec::new();
            loop {
                let batch = claim(&client, 100, &worker, 30).await;
                if batch.is_empty() {
                    let left: i64 = count(&client, "SELECT count(*) FROM outbox.messages").await;
                    if left == 0 {
                        return seen;
                    }
                    tokio::task::yield_now().await;
                    continue;
                }
                let ids: Vec<Uuid> = batch.iter().map(|m| m.id).collect();
                let tokens: Vec<Uuid> = batch.iter().map(|m| m.token).collect();
                let lost: i64 = client
                    .query_one(
                        "SELECT count(*) FILTER (WHERE lease_lost) FROM outbox.complete_outbox_batch(\
                         $1, $2, $3, array_fill('DISPATCHED'::outbox.attempt_state, \
                         ARRAY[cardinality($2::uuid[])]), NULL, NULL)",
                        &[&worker, &ids, &tokens],
                    )
                    .await
                    .unwrap()
                    .get(0);
                assert_eq!(lost, 0);
                seen.extend(ids);
            }
        }));
    }
    let mut all = Vec::new();
    let mut per_worker = Vec::new();
    for w in workers {
        let seen = w.await.unwrap();
        per_worker.push(seen.len());
        all.extend(seen);
    }
    let distinct: HashSet<Uuid> = all.iter().copied().collect();
    assert_eq!(
        i64::try_from(all.len()).unwrap(),
        MESSAGES,
        "claims per worker: {per_worker:?}"
    );
    assert_eq!(
        i64::try_from(distinct.len()).unwrap(),
        MESSAGES,
        "a message was claimed twice"
    );
    assert!(
        per_worker.iter().filter(|&&n| n > 0).count() > 1,
        "work was shared: {per_worker:?}"
    );
    assert_eq!(
        count(
            &c,
            "SELECT count(*) FROM outbox.attempts WHERE attempt_no = 1 AND state = 'DISPATCHED'"
        )
        .await,
        MESSAGES
    );
    db.finish().await;
}

/// The claim kept for relayers of the previous release leases what the relayer's claim
/// leases, in the same order, with the same columns but seq: each claims everything ready
/// (unkeyed messages, heads and their runs, past a delayed head and a leased one) in a
/// transaction rolled back afterwards, so both start from the same outbox.
#[tokio::test]
async fn the_kept_claim_leases_what_the_relayers_claim_leases_without_seq() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "SELECT outbox.enqueue(CASE WHEN n % 5 = 0 THEN 'u' ELSE 't' END, jsonb_build_object('n', n),
                               CASE WHEN n % 3 <> 0 THEN 'k' || (n % 4) END,
                               p_available_at => CASE WHEN n = 7 THEN now() + interval '1 hour' END)
           FROM generate_series(1, 60) AS n",
    )
    .await
    .unwrap();
    let held = claim(&c, 1, "other", 30).await;
    assert_eq!(held.len(), 1);

    const COLUMNS: &str = "outbox_id, topic, message_key, payload, content_type, headers::text, \
                           attempt_no, created_at, payload_bytes";
    type Row = (
        Uuid,
        String,
        Option<String>,
        Vec<u8>,
        String,
        String,
        i32,
        chrono::DateTime<chrono::Utc>,
        i64,
    );
    let rows = |rows: Vec<tokio_postgres::Row>| -> Vec<Row> {
        rows.iter()
            .map(|r| {
                (
                    r.get(0),
                    r.get(1),
                    r.get(2),
                    r.get(3),
                    r.get(4),
                    r.get(5),
                    r.get(6),
                    r.get(7),
                    r.get(8),
                )
            })
            .collect()
    };
    c.batch_execute("BEGIN").await.unwrap();
    let with_seq = c
        .query(
            &format!("SELECT {COLUMNS}, seq FROM outbox.claim_outbox_batch_seq(10000, 'w', 30)"),
            &[],
        )
        .await
        .unwrap();
    c.batch_execute("ROLLBACK").await.unwrap();
    c.batch_execute("BEGIN").await.unwrap();
    let kept = c
        .query(
            &format!("SELECT {COLUMNS} FROM outbox.claim_outbox_batch(10000, 'w', 30)"),
            &[],
        )
        .await
        .unwrap();
    c.batch_execute("ROLLBACK").await.unwrap();

    let seqs: Vec<i64> = with_seq.iter().map(|r| r.get(9)).collect();
    let with_seq = rows(with_seq);
    // Of the 60: one leased, one delayed (and its key behind it), and runs that stop where
    // a key's topic changes.
    assert!(
        (20..59).contains(&with_seq.len()),
        "the claims take some of the fixture, not all of it ({})",
        with_seq.len()
    );
    assert_eq!(rows(kept), with_seq, "the same rows, in the same order");
    assert!(
        seqs.windows(2).all(|p| p[0] < p[1]),
        "rows come in seq order: {seqs:?}"
    );
    for (row, seq) in with_seq.iter().zip(&seqs) {
        let stored: i64 = c
            .query_one(
                "SELECT seq FROM outbox.messages WHERE outbox_id = $1",
                &[&row.0],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(*seq, stored, "the seq of {}", row.0);
    }
    db.finish().await;
}

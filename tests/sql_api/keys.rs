//! Per-key order: a key's head blocks the rest of the key (through retries and delays), a
//! claim takes a run of a key in order, a failure in a run gives the rest back, and producers
//! committing behind a head neither lose their place, nor wait for completions, nor make a
//! lease fence wait. And the sequence consumers get (`seq`): a run redelivered after a crash
//! comes again with the seqs it had, and overlapping producers of one key are the one case
//! where first deliveries do not follow seq (docs/guarantees.md).

use super::*;

#[tokio::test]
async fn per_key_order_holds_through_a_retry_of_the_head() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // a2 and a3 on another topic than a1, so that no run follows a1 (a run stays on its
    // head's topic; runs: see a_claim_returns_a_run_of_a_key_in_order_in_the_room_the_heads_leave).
    let a1 = enqueue(&c, "t", Some("a")).await;
    let a2 = enqueue(&c, "u", Some("a")).await;
    let a3 = enqueue(&c, "u", Some("a")).await;
    let b1 = enqueue(&c, "t", Some("b")).await;
    let free = enqueue(&c, "t", None).await;

    let batch = claim(&c, 100, "w1", 30).await;
    let got: HashSet<Uuid> = batch.iter().map(|m| m.id).collect();
    assert_eq!(
        got,
        HashSet::from([a1, b1, free]),
        "the heads first: of each key, and unkeyed messages"
    );
    assert!(
        claim(&c, 100, "w2", 30).await.is_empty(),
        "a2 waits while a1 is leased"
    );

    // The head of `a` fails and is scheduled for later: a2 must still wait for it.
    let head = batch.iter().find(|m| m.id == a1).unwrap();
    retry_at(&c, head, "w1", 3600.0).await;
    assert!(
        claim(&c, 100, "w2", 30).await.is_empty(),
        "a2 waits for a1's retry"
    );

    c.execute(
        "UPDATE outbox.messages SET available_at = now() WHERE outbox_id = $1",
        &[&a1],
    )
    .await
    .unwrap();
    let retried = claim(&c, 1, "w2", 30).await;
    assert_eq!(retried.iter().map(|m| m.id).collect::<Vec<_>>(), [a1]);
    assert_eq!(retried[0].key.as_deref(), Some("a"));
    complete(&c, &retried[0], "w2", "DISPATCHED", None)
        .await
        .unwrap();

    let next = claim(&c, 1, "w2", 30).await;
    assert_eq!(next.iter().map(|m| m.id).collect::<Vec<_>>(), [a2]);
    complete(&c, &next[0], "w2", "DISPATCHED", None)
        .await
        .unwrap();
    let last = claim(&c, 1, "w2", 30).await;
    assert_eq!(last.iter().map(|m| m.id).collect::<Vec<_>>(), [a3]);
    db.finish().await;
}

#[tokio::test]
async fn a_delayed_head_blocks_its_key_but_not_other_keys() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.execute(
        "SELECT outbox.enqueue('t', '{}'::jsonb, 'a', p_available_at => now() + interval '1 hour')",
        &[],
    )
    .await
    .unwrap();
    enqueue(&c, "t", Some("a")).await;
    let b = enqueue(&c, "t", Some("b")).await;
    let got: Vec<Uuid> = claim(&c, 10, "w1", 30).await.iter().map(|m| m.id).collect();
    assert_eq!(got, [b]);
    db.finish().await;
}

#[tokio::test]
async fn a_claim_returns_a_run_of_a_key_in_order_in_the_room_the_heads_leave() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox.messages (topic, message_key, payload) \
           SELECT 't', 'hot', convert_to(g::text, 'UTF8') FROM generate_series(1, 1000) AS g; \
         INSERT INTO outbox.messages (topic, payload) \
           SELECT 't', convert_to('free', 'UTF8') FROM generate_series(1, 50); \
         UPDATE outbox.messages SET available_at = now() + interval '1 hour' \
          WHERE message_key = 'hot' AND convert_from(payload, 'UTF8') = '201'",
    )
    .await
    .unwrap();
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.messages WHERE behind").await,
        999,
        "every message after the key's head waits behind it, out of the claim's walk"
    );

    // Heads (50 unkeyed, the hot key's first), then the hot key's run in the room left. A
    // claim visits the shards in a random order and the run follows the heads of its own
    // shard, so the run has at least the room all 50 unkeyed heads would leave.
    let first = claim_texts(&c, 100).await;
    assert_eq!(first.len(), 100);
    let k = i32::try_from(run_of(&first, "hot").len()).unwrap();
    assert!(k >= 50, "a run of {k}");
    assert_eq!(run_of(&first, "hot"), (1..=k).collect::<Vec<_>>());
    let more = claim_texts(&c, 100).await;
    assert!(
        more.iter().all(|m| m.0.is_none()),
        "nothing of a key whose head is leased"
    );
    assert_eq!(
        more.len(),
        usize::try_from(k - 50).unwrap(),
        "the other heads"
    );
    complete_all(&c, &first, &["DISPATCHED"; 100]).await;
    complete_all(&c, &more, &vec!["DISPATCHED"; more.len()]).await;

    // The next message became the head; its run stops before the delayed message 201.
    let second = claim_texts(&c, 500).await;
    assert_eq!(run_of(&second, "hot"), (k + 1..=200).collect::<Vec<_>>());
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.messages WHERE NOT behind").await,
        1,
        "the leased run's head is the only head: the rest of the key is off the claim's walk"
    );
    db.finish().await;
}

#[tokio::test]
async fn a_retryable_failure_in_a_run_gives_back_the_rest_and_the_key_waits_for_it() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox.messages (topic, message_key, payload) \
           SELECT 't', 'k', convert_to(g::text, 'UTF8') FROM generate_series(1, 10) AS g",
    )
    .await
    .unwrap();
    let run = claim_texts(&c, 10).await;
    assert_eq!(run_of(&run, "k"), (1..=10).collect::<Vec<_>>());
    // What the relayer reports when message 4 fails: the rest given back, then 1–3
    // delivered and 4 retryable (an hour from now).
    let rest: Vec<_> = run[4..].to_vec();
    let released: i32 = c
        .query_one(
            "SELECT outbox.release_outbox_leases('w', $1, $2)",
            &[
                &rest.iter().map(|m| m.2).collect::<Vec<_>>(),
                &rest.iter().map(|m| m.3).collect::<Vec<_>>(),
            ],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(released, 6);
    complete_all(
        &c,
        &run[..4],
        &["DISPATCHED", "DISPATCHED", "DISPATCHED", "RETRYABLE"],
    )
    .await;
    assert!(
        claim_texts(&c, 10).await.is_empty(),
        "5–10 wait for 4's retry"
    );
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.attempts WHERE outbox_id = ANY (SELECT outbox_id FROM outbox.messages WHERE behind)").await,
        0,
        "the given-back messages were not attempted"
    );
    c.execute("UPDATE outbox.messages SET available_at = now()", &[])
        .await
        .unwrap();
    let again = claim_texts(&c, 10).await;
    assert_eq!(run_of(&again, "k"), (4..=10).collect::<Vec<_>>());
    db.finish().await;
}

#[tokio::test]
async fn a_producer_committing_behind_a_head_being_completed_becomes_the_next_head() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "t", Some("k")).await;
    let head = claim(&c, 1, "w", 30).await.remove(0);

    // The producer's commit-time check keeps the head from being deleted until the
    // producer commits.
    let (p, mine) = producer_committing_behind(&db, "k").await;
    let c2 = db.client().await;
    let completing = backend_pid(&c2).await;
    let completion = tokio::spawn(async move {
        complete(&c2, &head, "w", "DISPATCHED", None).await.unwrap();
    });
    until_waiting_for_a_lock(&c, completing, "the completion to wait for a lock").await;
    assert!(
        !completion.is_finished(),
        "the head's deletion waits for the producer queued behind it"
    );
    p.batch_execute("COMMIT").await.unwrap();
    completion.await.unwrap();
    let next: Vec<Uuid> = claim(&c, 10, "w", 30).await.iter().map(|m| m.id).collect();
    assert_eq!(
        next,
        [mine],
        "the completion made the producer's message the head"
    );

    // The head already gone when the producer commits, in either isolation level: the
    // producer's message marks itself as the head.
    for (n, isolation) in ["READ COMMITTED", "REPEATABLE READ"].iter().enumerate() {
        let key = format!("late-{n}");
        c.execute("SELECT outbox.enqueue('t', '{}'::jsonb, $1)", &[&key])
            .await
            .unwrap();
        let p = db.client().await;
        p.batch_execute(&format!("BEGIN ISOLATION LEVEL {isolation}"))
            .await
            .unwrap();
        let mine: Uuid = p
            .query_one("SELECT outbox.enqueue('t', '{}'::jsonb, $1)", &[&key])
            .await
            .unwrap()
            .get(0);
        let head = claim(&c, 10, "w", 30).await;
        assert_eq!(head.len(), 1, "{isolation}: the first message only");
        complete(&c, &head[0], "w", "DISPATCHED", None)
            .await
            .unwrap();
        p.batch_execute("COMMIT").await.unwrap();
        let next = claim(&c, 10, "w", 30).await;
        assert_eq!(
            next.iter().map(|m| m.id).collect::<Vec<_>>(),
            [mine],
            "{isolation}"
        );
        complete(&c, &next[0], "w", "DISPATCHED", None)
            .await
            .unwrap();
    }
    db.finish().await;
}

/// Two completions of consecutive messages of one key at once (the relayer completes a run's
/// messages as each is delivered, on connections of its pool): the head's completion finds,
/// in its promotion, the next message that the other completion is deleting, waits for it,
/// and then promotes the message after both, so the key goes on.
#[tokio::test]
async fn concurrent_completions_of_a_run_leave_the_message_after_it_the_head() {
    let db = TestDb::new().await;
    let c = db.client().await;
    for _ in 0..3 {
        enqueue(&c, "t", Some("k")).await;
    }
    let run = claim(&c, 2, "w", 30).await;
    assert_eq!(run.len(), 2, "the head and the run behind it");

    // The second message's completion deletes it and has not committed yet.
    let second = db.client().await;
    second.batch_execute("BEGIN").await.unwrap();
    complete(&second, &run[1], "w", "DISPATCHED", None)
        .await
        .unwrap();
    // The head's completion deletes the head; its promotion waits for the second message.
    let c2 = db.client().await;
    let completing = backend_pid(&c2).await;
    let head = run[0].clone();
    let first = tokio::spawn(async move {
        complete(&c2, &head, "w", "DISPATCHED", None).await.unwrap();
    });
    until_waiting_for_a_lock(&c, completing, "the head's completion to wait for a lock").await;
    second.batch_execute("COMMIT").await.unwrap();
    first.await.unwrap();

    let next = claim(&c, 10, "w", 30).await;
    assert_eq!(
        next.len(),
        1,
        "the third message is its key's head once both completions committed"
    );
    db.finish().await;
}

/// Two heads of one key held by two workers (overlapping producers: the later message
/// committed first and was taken as the head, then the earlier one), completed at once: the
/// second completion waits for the first, then makes the key's next message its head.
#[tokio::test]
async fn concurrent_completions_of_two_heads_of_a_key_leave_the_next_message_the_head() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let early = db.client().await;
    early.batch_execute("BEGIN").await.unwrap();
    let first = enqueue(&early, "t", Some("k")).await;
    let second = enqueue(&c, "t", Some("k")).await;
    let held_by_one = claim(&c, 10, "one", 30).await;
    assert_eq!(
        held_by_one.iter().map(|m| m.id).collect::<Vec<_>>(),
        [second]
    );
    early.batch_execute("COMMIT").await.unwrap();
    let held_by_two = claim(&c, 10, "two", 30).await;
    assert_eq!(
        held_by_two.iter().map(|m| m.id).collect::<Vec<_>>(),
        [first]
    );
    let next = enqueue(&c, "t", Some("k")).await;

    let a = db.client().await;
    a.batch_execute("BEGIN").await.unwrap();
    complete(&a, &held_by_two[0], "two", "DISPATCHED", None)
        .await
        .unwrap();
    let b = db.client().await;
    let completing = backend_pid(&b).await;
    let other = held_by_one[0].clone();
    let done = tokio::spawn(async move {
        complete(&b, &other, "one", "DISPATCHED", None)
            .await
            .unwrap();
    });
    until_waiting_for_a_lock(
        &c,
        completing,
        "the second completion to wait for the first",
    )
    .await;
    a.batch_execute("COMMIT").await.unwrap();
    done.await.unwrap();

    let after = claim(&c, 10, "one", 30).await;
    assert_eq!(
        after.iter().map(|m| m.id).collect::<Vec<_>>(),
        [next],
        "the message after both heads is the key's head"
    );
    db.finish().await;
}

#[tokio::test]
async fn a_producer_behind_messages_being_completed_commits_without_waiting_or_deadlocking() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "t", Some("a")).await;
    enqueue(&c, "t", Some("b")).await;
    let heads = claim(&c, 10, "w", 30).await;
    assert_eq!(heads.len(), 2, "the heads of a and b");

    // One producer transaction enqueues behind both heads.
    let p = db.client().await;
    p.batch_execute("BEGIN").await.unwrap();
    let behind_a = enqueue(&p, "t", Some("a")).await;
    let behind_b = enqueue(&p, "t", Some("b")).await;
    // A completion has deleted b's head and not committed yet when the producer commits;
    // then it deletes a's head. Were the producer to wait for b's head while holding a's,
    // the two would deadlock and Postgres would fail one of them.
    let done = db.client().await;
    done.batch_execute("BEGIN").await.unwrap();
    complete(&done, &heads[1], "w", "DISPATCHED", None)
        .await
        .unwrap();
    let committing = backend_pid(&p).await;
    let producer = tokio::spawn(async move { p.batch_execute("COMMIT").await });
    // The commit ends, or waits for a lock (held by the completion, which does not end
    // before it): whichever comes first, within a minute.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !producer.is_finished() {
        assert!(
            !waits_for_a_lock(&c, committing).await,
            "the producer's commit does not wait for a completion"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "the producer's commit did not end within a minute"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    producer.await.unwrap().expect("the producer commits");
    complete(&done, &heads[0], "w", "DISPATCHED", None)
        .await
        .expect("the completion is not failed either");
    done.batch_execute("COMMIT").await.unwrap();

    let next: HashSet<Uuid> = claim(&c, 10, "w", 30).await.iter().map(|m| m.id).collect();
    assert_eq!(
        next,
        HashSet::from([behind_a, behind_b]),
        "both are the heads of their keys now"
    );
    db.finish().await;
}

#[tokio::test]
async fn no_lease_fence_waits_for_a_producer_committing_behind_the_message() {
    let db = TestDb::new().await;
    let c = db.client().await;
    enqueue(&c, "t", Some("k")).await;
    let head = claim(&c, 1, "w", 30).await.remove(0);

    // A producer enqueued behind the head and is committing: its commit-time check holds
    // the head FOR KEY SHARE.
    let (p, _) = producer_committing_behind(&db, "k").await;

    // A heartbeat and a retry take the head's fence and change only lease columns: neither
    // waits for the producer (while a fence waited, the producer could wait for it in turn).
    let quick = std::time::Duration::from_secs(5);
    let extended = tokio::time::timeout(
        quick,
        c.query(
            "SELECT * FROM outbox.extend_outbox_leases('w', ARRAY[$1::uuid], ARRAY[$2::uuid], 60)",
            &[&head.id, &head.token],
        ),
    )
    .await
    .expect("the heartbeat does not wait for the producer")
    .unwrap();
    assert_eq!(extended.len(), 1);
    let attempt = tokio::time::timeout(quick, retry_at(&c, &head, "w", 3600.0))
        .await
        .expect("the retry's completion does not wait for the producer");
    assert_eq!(attempt, 1);
    p.batch_execute("COMMIT").await.unwrap();
    db.finish().await;
}

/// A run whose relayer died (its leases expired and were repaired) is claimed again from its
/// head with the same seqs, so a consumer that kept the last seq of the key recognises the
/// rewind: every message of it has a seq at or below the last one it saw.
#[tokio::test]
async fn a_run_redelivered_after_a_crash_keeps_its_seqs() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let ids = [
        enqueue(&c, "t", Some("k")).await,
        enqueue(&c, "t", Some("k")).await,
        enqueue(&c, "t", Some("k")).await,
    ];
    let first = claim(&c, 10, "w1", 30).await;
    assert_eq!(first.iter().map(|m| m.id).collect::<Vec<_>>(), ids);
    let seqs: Vec<i64> = first.iter().map(|m| m.seq.unwrap()).collect();
    assert!(
        seqs.windows(2).all(|p| p[0] < p[1]),
        "a run's seqs increase: {seqs:?}"
    );

    // w1 delivered the run and died before recording it.
    expire_leases(&c).await;
    assert_eq!(repair(&c).await, (3, 0));
    let again = claim(&c, 10, "w2", 30).await;
    assert_eq!(again.iter().map(|m| m.id).collect::<Vec<_>>(), ids);
    assert_eq!(
        again.iter().map(|m| m.seq.unwrap()).collect::<Vec<_>>(),
        seqs,
        "the redelivered run carries the seqs of its first delivery"
    );
    assert_eq!(again[0].attempt_no, 2);
    db.finish().await;
}

/// Two transactions enqueue under one key at once. `early` is numbered first but commits
/// last, after `late` (numbered after it) was claimed and delivered: `early` is delivered
/// second, with the lower seq. This is the case the consumer rule of docs/guarantees.md
/// excludes (producers of a key that overlap have no order between them).
#[tokio::test]
async fn overlapping_producers_of_a_key_are_delivered_in_commit_order_not_seq_order() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let producer = db.client().await;
    producer.batch_execute("BEGIN").await.unwrap();
    let early = enqueue(&producer, "t", Some("k")).await;
    let late = enqueue(&c, "t", Some("k")).await;

    let first = claim(&c, 10, "w1", 30).await;
    assert_eq!(first.iter().map(|m| m.id).collect::<Vec<_>>(), [late]);
    complete(&c, &first[0], "w1", "DISPATCHED", None)
        .await
        .unwrap();

    producer.batch_execute("COMMIT").await.unwrap();
    let second = claim(&c, 10, "w1", 30).await;
    assert_eq!(second.iter().map(|m| m.id).collect::<Vec<_>>(), [early]);
    assert!(
        second[0].seq < first[0].seq,
        "the message delivered second has the lower seq ({:?} after {:?})",
        second[0].seq,
        first[0].seq
    );
    db.finish().await;
}

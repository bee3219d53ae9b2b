//! The store's mapping of the SQL API: typed errors for P7002 and P7001, idempotent
//! migrations, and round trips of the domain types.

use crate::common;

use common::TestDb;
use outbox_relay::message::{AttemptState, Completion, LeaseToken, NewMessage, WorkerId};
use outbox_relay::store::{StoreError, TopicFilter};

#[tokio::test]
async fn migrate_is_idempotent() {
    let db = TestDb::new().await;
    let store = db.store();
    assert!(
        store.migrate().await.unwrap().is_empty(),
        "nothing left to apply"
    );
    db.finish().await;
}

#[tokio::test]
async fn lease_lost_and_invalid_arguments_become_typed_errors() {
    let db = TestDb::new().await;
    let store = db.store();
    let worker = WorkerId::new("w1");
    let id = store
        .enqueue(&NewMessage {
            topic: "orders".into(),
            key: Some("k".into()),
            payload: serde_json::json!({"total": 42}).into(),
            ..NewMessage::default()
        })
        .await
        .unwrap();
    let batch = store
        .claim(
            10,
            &worker,
            30,
            None,
            TopicFilter::default(),
            Default::default(),
        )
        .await
        .unwrap();
    assert_eq!(batch.len(), 1);
    let m = &batch[0];
    assert_eq!((m.id, m.attempt_no, m.key.as_deref()), (id, 1, Some("k")));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&m.payload).unwrap(),
        serde_json::json!({"total": 42})
    );

    let stale = Completion {
        id,
        lease_token: LeaseToken(uuid::Uuid::new_v4()),
        state: AttemptState::Dispatched,
        error: None,
        retry_at: None,
    };
    let results = store.complete(&worker, &[stale]).await.unwrap();
    assert!(results[0].lease_lost);

    match store
        .claim(
            0,
            &worker,
            30,
            None,
            TopicFilter::default(),
            Default::default(),
        )
        .await
    {
        Err(StoreError::InvalidArgument(msg)) => assert!(msg.contains("p_batch_size"), "{msg}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    match store
        .extend(&WorkerId::new(""), &[(id, m.lease_token)], 30)
        .await
    {
        Err(StoreError::InvalidArgument(msg)) => assert!(msg.contains("p_worker_id"), "{msg}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }

    let client = db.client().await;
    let err = client
        .query_one(
            "SELECT outbox.complete_outbox_attempt($1, gen_random_uuid(), 'w1', 'DISPATCHED')",
            &[&id.0],
        )
        .await
        .unwrap_err();
    assert!(matches!(StoreError::from(err), StoreError::LeaseLost(_)));

    let done = Completion {
        lease_token: m.lease_token,
        ..stale_completion(id)
    };
    let results = store.complete(&worker, &[done]).await.unwrap();
    assert_eq!(
        (results[0].attempt_no, results[0].lease_lost),
        (Some(1), false)
    );
    let status = store.status().await.unwrap();
    assert_eq!(
        (status.ready, status.in_flight, status.dead_letters),
        (0, 0, 0)
    );
    db.finish().await;
}

fn stale_completion(id: outbox_relay::message::OutboxId) -> Completion {
    Completion {
        id,
        lease_token: LeaseToken(uuid::Uuid::nil()),
        state: AttemptState::Dispatched,
        error: None,
        retry_at: None,
    }
}

#[tokio::test]
async fn an_unreachable_database_is_reported_as_unavailable() {
    let store =
        outbox_relay::store::Store::connect("postgres://nobody@127.0.0.1:1/none", 1).unwrap();
    match store.ping().await {
        Err(e @ StoreError::Unavailable { .. }) => assert_eq!(
            e.to_string(),
            "cannot connect to 127.0.0.1:1 as \"nobody\", database \"none\": \
             connection refused (127.0.0.1:1)"
        ),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    match outbox_relay::store::Store::connect("postgres://u:pw@host:notaport/db", 1) {
        Err(StoreError::InvalidUrl(msg)) => assert!(!msg.contains("pw@"), "{msg}"),
        other => panic!("expected InvalidUrl, got {:?}", other.err()),
    }
}

/// The producer API enqueues inside the caller's own transaction: rolled back, no message;
/// committed, the message with the caller's other writes. A deadpool client serves too.
#[tokio::test]
async fn enqueue_joins_the_callers_transaction() {
    use outbox_relay::message::{NewMessage, Payload};
    use outbox_relay::store::enqueue;

    let db = TestDb::new().await;
    let mut c = db.client().await;
    c.batch_execute("CREATE TABLE public.orders (id bigint PRIMARY KEY)")
        .await
        .unwrap();
    let message = |key: &str| NewMessage {
        topic: "orders.placed".into(),
        key: Some(key.into()),
        payload: serde_json::json!({"order": key}).into(),
        headers: Some(serde_json::json!({"x-tenant": "acme"})),
        ..NewMessage::default()
    };

    let tx = c.transaction().await.unwrap();
    tx.execute("INSERT INTO public.orders VALUES (1)", &[])
        .await
        .unwrap();
    enqueue(&tx, &message("rolled-back")).await.unwrap();
    tx.rollback().await.unwrap();

    let tx = c.transaction().await.unwrap();
    tx.execute("INSERT INTO public.orders VALUES (2)", &[])
        .await
        .unwrap();
    let committed = enqueue(&tx, &message("committed")).await.unwrap();
    tx.commit().await.unwrap();

    let pool = deadpool_postgres::Pool::builder(deadpool_postgres::Manager::new(
        db.url.parse().unwrap(),
        tokio_postgres::NoTls,
    ))
    .build()
    .unwrap();
    let mut pooled = pool.get().await.unwrap();
    let tx = pooled.transaction().await.unwrap();
    let bytes = enqueue(
        &*tx,
        &NewMessage {
            topic: "blobs".into(),
            payload: Payload::Bytes {
                data: vec![0, 159, 255],
                content_type: "application/octet-stream".into(),
            },
            ..NewMessage::default()
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let plain = enqueue(&**pooled, &message("pooled")).await.unwrap();

    let rows = c
        .query(
            "SELECT outbox_id, message_key, headers, payload, content_type FROM outbox.messages \
             ORDER BY outbox_id",
            &[],
        )
        .await
        .unwrap();
    let ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(
        ids,
        vec![committed.0, bytes.0, plain.0],
        "no rolled-back message"
    );
    assert_eq!(
        rows[0].get::<_, Option<String>>(1).as_deref(),
        Some("committed")
    );
    assert_eq!(
        rows[0].get::<_, serde_json::Value>(2),
        serde_json::json!({"x-tenant": "acme"})
    );
    assert_eq!(rows[1].get::<_, Vec<u8>>(3), vec![0, 159, 255]);
    assert_eq!(rows[1].get::<_, String>(4), "application/octet-stream");
    let orders: Vec<i64> = c
        .query("SELECT id FROM public.orders", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(orders, vec![2]);
    db.finish().await;
}

/// Leasing calls of stores sharing one turn run one at a time on the server: with a lock
/// holding the claims up, two stores' claims leave one session waiting in the database and
/// the other waiting for its turn; without turns both wait in the database. Lease
/// extensions take no turn.
#[tokio::test]
async fn stores_sharing_turns_run_their_leasing_calls_one_at_a_time() {
    use std::sync::Arc;
    use std::time::Duration;

    let db = TestDb::new().await;
    let worker = WorkerId::new("w1");
    let locked = LockedClaims::new(&db, &worker).await;
    let blocker = &locked.blocker;
    let waiting = || locked.waiting();
    for turns in [Some(1), None] {
        let shared = Arc::new(outbox_relay::store::Turns::new(1, 1));
        let stores: Vec<_> = (0..2)
            .map(|_| match turns {
                Some(_) => db.store().with_turns(shared.clone()),
                None => db.store(),
            })
            .collect();
        blocker
            .batch_execute("BEGIN; LOCK TABLE outbox.messages IN ACCESS EXCLUSIVE MODE")
            .await
            .unwrap();
        let claims: Vec<_> = stores.iter().map(|s| spawn_claim(s, &worker)).collect();
        let expected = if turns.is_some() { 1 } else { 2 };
        let mut seen = 0;
        for _ in 0..100 {
            seen = waiting().await;
            if seen >= expected {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Long enough for a second call to reach the database if it could.
        tokio::time::sleep(Duration::from_millis(300)).await;
        seen = seen.max(waiting().await);
        assert_eq!(
            seen, expected,
            "sessions waiting in the database, turns {turns:?}"
        );
        blocker.batch_execute("COMMIT").await.unwrap();
        for claim in claims {
            claim.await.unwrap().unwrap();
        }
        if turns.is_some() {
            // While the only turn is taken, a claim waits and an extension does not.
            let taken = shared.take(false).await;
            let claim = stores[0].claim(
                10,
                &worker,
                30,
                None,
                TopicFilter::default(),
                Default::default(),
            );
            assert!(
                tokio::time::timeout(Duration::from_millis(300), claim)
                    .await
                    .is_err(),
                "a claim ran without a turn"
            );
            let extended =
                tokio::time::timeout(Duration::from_secs(5), stores[1].extend(&worker, &[], 30))
                    .await;
            assert!(
                matches!(extended, Ok(Ok(_))),
                "an extension waited: {extended:?}"
            );
            drop(taken);
            stores[0]
                .claim(
                    10,
                    &worker,
                    30,
                    None,
                    TopicFilter::default(),
                    Default::default(),
                )
                .await
                .unwrap();
        }
    }
    db.finish().await;
}

/// A store whose latest claim came back full (a backlog) waits for one of the backlogged
/// turns: with 2 turns of which 1 for backlogged sources, two claims of the backlogged
/// store leave one session waiting in the database, and a claim of a store that is not
/// backlogged still gets the other turn. A claim that comes back short ends the backlog.
#[tokio::test]
async fn a_backlogged_store_leaves_turns_to_the_others() {
    use std::sync::Arc;

    let db = TestDb::new().await;
    let worker = WorkerId::new("w1");
    let locked = LockedClaims::new(&db, &worker).await;
    common::fill(&locked.blocker, "t", 30, None).await;
    let turns = Arc::new(outbox_relay::store::Turns::new(2, 1));
    let backlogged = db.store().with_turns(turns.clone());
    let quiet = db.store().with_turns(turns.clone());
    let claimed = backlogged
        .claim(
            10,
            &worker,
            30,
            None,
            TopicFilter::default(),
            Default::default(),
        )
        .await
        .unwrap();
    assert_eq!(claimed.len(), 10, "the first claim comes back full");
    let (seen, got) = locked
        .run(vec![backlogged.clone(), backlogged.clone()])
        .await;
    assert_eq!(seen, 1, "two backlogged claims both ran at once");
    assert_eq!(got, [10, 10]);
    let (seen, _) = locked
        .run(vec![backlogged.clone(), backlogged.clone(), quiet.clone()])
        .await;
    assert_eq!(seen, 2, "a quiet store's claim waited behind a backlog's");
    // All 30 are leased: the claims of the round above came back empty, so the store is no
    // longer backlogged and two of its claims run at once.
    let (seen, got) = locked
        .run(vec![backlogged.clone(), backlogged.clone()])
        .await;
    assert_eq!(got, [0, 0]);
    assert_eq!(
        seen, 2,
        "a store whose claim came back short stayed backlogged"
    );
    db.finish().await;
}

/// Adaptive turns (the default): a backlog has all of its backlogged turns until a store
/// that is not backlogged has a claim return messages; for the next second its calls run
/// one at a time. The short last claim of a store that was backlogged is not quiet traffic.
#[tokio::test]
async fn adaptive_turns_run_a_backlog_one_call_at_a_time_while_quiet_sources_flow() {
    use std::sync::Arc;

    let db = TestDb::new().await;
    let worker = WorkerId::new("w1");
    let locked = LockedClaims::new(&db, &worker).await;
    let turns = Arc::new(outbox_relay::store::Turns::new(3, 2).adaptive());
    let backlogged = db.store().with_turns(turns.clone());
    let quiet = db.store().with_turns(turns.clone());
    let claim = |store: &outbox_relay::store::Store, limit: i32| {
        let (store, worker) = (store.clone(), worker.clone());
        async move {
            store
                .claim(
                    limit,
                    &worker,
                    30,
                    None,
                    TopicFilter::default(),
                    Default::default(),
                )
                .await
                .unwrap()
                .len()
        }
    };
    common::fill(&locked.blocker, "t", 40, None).await;
    assert_eq!(
        claim(&backlogged, 10).await,
        10,
        "the backlog's claim is full"
    );
    // The other store's backlog runs dry: a full claim, then a short one.
    assert_eq!(claim(&quiet, 10).await, 10);
    assert_eq!(claim(&quiet, 100).await, 20);
    let (seen, _) = locked
        .run(vec![backlogged.clone(), backlogged.clone()])
        .await;
    assert_eq!(
        seen, 2,
        "a backlog's last short claim held the other backlog to one call"
    );
    // Both stores are empty now; a backlog again, and quiet traffic beside it.
    common::fill(&locked.blocker, "t", 10, None).await;
    assert_eq!(
        claim(&backlogged, 10).await,
        10,
        "the backlog's claim is full"
    );
    common::fill(&locked.blocker, "t", 3, None).await;
    assert_eq!(
        claim(&quiet, 100).await,
        3,
        "the quiet store's claim is short"
    );
    let (seen, _) = locked
        .run(vec![backlogged.clone(), backlogged.clone(), quiet.clone()])
        .await;
    assert_eq!(
        seen, 2,
        "beside quiet traffic, two backlogged calls ran at once (3 turns: the quiet call never waits)"
    );
    db.finish().await;
}

/// Claims run against a table locked ACCESS EXCLUSIVE, to count how many of them reach
/// the database at once.
struct LockedClaims {
    blocker: tokio_postgres::Client,
    watcher: tokio_postgres::Client,
    worker: WorkerId,
}

impl LockedClaims {
    async fn new(db: &TestDb, worker: &WorkerId) -> Self {
        Self {
            blocker: db.client().await,
            watcher: db.client().await,
            worker: worker.clone(),
        }
    }

    /// Runs a claim of up to 10 by each of `stores` while the table is locked; returns how
    /// many of them reached the database (waiting for the lock) and, once it is released,
    /// what each claimed.
    async fn run(&self, stores: Vec<outbox_relay::store::Store>) -> (i64, Vec<usize>) {
        self.blocker
            .batch_execute("BEGIN; LOCK TABLE outbox.messages IN ACCESS EXCLUSIVE MODE")
            .await
            .unwrap();
        let claims: Vec<_> = stores
            .iter()
            .map(|s| spawn_claim(s, &self.worker))
            .collect();
        // Long enough for every call that may run to reach the database.
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let seen = self.waiting().await;
        self.blocker.batch_execute("COMMIT").await.unwrap();
        (seen, futures_join(claims).await)
    }

    /// Sessions of this database waiting on a lock while running a claim.
    async fn waiting(&self) -> i64 {
        self.watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock' AND query LIKE '%claim_outbox_batch_seq%'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    }
}

/// A served source's leasing calls that queue for the server's turns hold at most all but
/// one of its pool's connections, so that its slot renewal (`serve_source`) is not kept
/// waiting for a connection behind them (and its slot does not lapse).
#[tokio::test]
async fn leasing_calls_waiting_for_turns_leave_a_connection_for_the_slot_renewal() {
    use std::sync::Arc;
    use std::time::Duration;

    let db = TestDb::new().await;
    let worker = WorkerId::new("w1");
    common::fill(&db.client().await, "t", 30, None).await;
    let turns = Arc::new(outbox_relay::store::Turns::new(1, 1));
    let store = outbox_relay::store::Store::connect(&db.url, 2)
        .unwrap()
        .with_turns(turns.clone());
    // Every turn of the server is taken: three claims of the source queue for one.
    let taken = turns.take(false).await;
    let claims: Vec<_> = (0..3).map(|_| spawn_claim(&store, &worker)).collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let renewed = tokio::time::timeout(
        Duration::from_secs(5),
        store.serve_source(
            &worker,
            1,
            true,
            Duration::from_secs(15),
            Duration::from_secs(30),
        ),
    )
    .await;
    let turn = renewed
        .expect("the renewal waited for a connection behind the claims queued for a turn")
        .expect("serve_source");
    assert!(turn.held.is_some(), "the slot is taken");
    drop(taken);
    assert_eq!(futures_join(claims).await, [10, 10, 10]);
    db.finish().await;
}

/// A claim of up to 10 by `store` for `worker`, run as a task of its own.
fn spawn_claim(
    store: &outbox_relay::store::Store,
    worker: &WorkerId,
) -> tokio::task::JoinHandle<Result<Vec<outbox_relay::message::ClaimedMessage>, StoreError>> {
    let (store, worker) = (store.clone(), worker.clone());
    tokio::spawn(async move {
        store
            .claim(
                10,
                &worker,
                30,
                None,
                TopicFilter::default(),
                Default::default(),
            )
            .await
    })
}

async fn futures_join(
    claims: Vec<
        tokio::task::JoinHandle<Result<Vec<outbox_relay::message::ClaimedMessage>, StoreError>>,
    >,
) -> Vec<usize> {
    let mut got = Vec::new();
    for claim in claims {
        got.push(claim.await.unwrap().unwrap().len());
    }
    got
}

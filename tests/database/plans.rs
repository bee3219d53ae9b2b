//! The plans of the hot path's statements (inside claim, extend, release and complete; the
//! claim both as the relayer calls it and as the previous release's relayers do),
//! read with auto_explain, at 0-row statistics over 20,000 rows (what autovacuum leaves
//! after the queue drained), 20,000 analyzed rows and 1,000,000: each is driven by an index
//! (the claim's lease by tuple address), never by a scan of outbox.messages that rescans
//! the batch per row (nor one that walks outbox.messages to promote the next head of a
//! completed key). And the plan of the
//! attempt log's retention beside a large backlog: its cost follows the attempts pruned,
//! not the backlog. And the console's reads (`schema/11_console.sql`): each walks an index
//! and stops at its limit.

use crate::common;

use std::sync::{Arc, Mutex};

use common::TestDb;
use futures_util::StreamExt;
use tokio_postgres::{AsyncMessage, Client, NoTls};
use uuid::Uuid;

/// A connection whose statements, nested ones included, have their plans sent back as
/// notices (auto_explain), collected into the returned list.
async fn explaining(url: &str) -> (Client, Arc<Mutex<Vec<String>>>) {
    let (client, mut connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    let plans = Arc::new(Mutex::new(Vec::new()));
    let sink = plans.clone();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notice(notice) = message {
                sink.lock().unwrap().push(notice.message().to_owned());
            }
        }
    });
    client
        .batch_execute(
            "LOAD 'auto_explain';
             SET auto_explain.log_min_duration = 0;
             SET auto_explain.log_nested_statements = on;
             SET auto_explain.log_analyze = on;
             SET auto_explain.log_timing = off;
             SET auto_explain.log_level = notice;",
        )
        .await
        .unwrap();
    (client, plans)
}

/// The claims whose plans are checked: the relayer's (with and without the topics its routes
/// cover), and the one kept for relayers of the previous release (the same statements; both
/// run during a rolling upgrade).
const CLAIMS: [&str; 3] = [
    "claim_outbox_batch_seq(500, 'w', 30)",
    "claim_outbox_batch(500, 'w', 30)",
    // A relayer whose routes cover some topics (all of these, here).
    "claim_outbox_batch_seq(500, 'w', 30, NULL, NULL, NULL, NULL, ARRAY['pl%', 'x\\_y'])",
];

/// Seven rounds (past plpgsql's five custom plans, into its generic one) of: claim 500 with
/// `outbox.<claim>`, extend them, release the last 100, complete the rest. Returns every plan
/// auto_explain printed.
async fn hot_path_plans(url: &str, claim: &str) -> Vec<String> {
    let (c, plans) = explaining(url).await;
    for _ in 0..7 {
        let rows = c
            .query(
                &format!("SELECT outbox_id, lease_token FROM outbox.{claim}"),
                &[],
            )
            .await
            .unwrap();
        let ids: Vec<Uuid> = rows.iter().map(|r| r.get(0)).collect();
        let tokens: Vec<Uuid> = rows.iter().map(|r| r.get(1)).collect();
        assert_eq!(ids.len(), 500);
        let extended = c
            .query(
                "SELECT * FROM outbox.extend_outbox_leases('w', $1, $2, 30)",
                &[&ids, &tokens],
            )
            .await
            .unwrap();
        assert_eq!(extended.len(), 500);
        let released: i32 = c
            .query_one(
                "SELECT outbox.release_outbox_leases('w', $1, $2)",
                &[&&ids[400..], &&tokens[400..]],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(released, 100);
        let done = c
            .query(
                "SELECT * FROM outbox.complete_outbox_batch('w', $1, $2, \
                 array_fill('DISPATCHED'::outbox.attempt_state, ARRAY[400]), NULL, NULL) \
                 WHERE NOT lease_lost",
                &[&&ids[..400], &&tokens[..400]],
            )
            .await
            .unwrap();
        assert_eq!(done.len(), 400);
    }
    let plans = plans.lock().unwrap().clone();
    assert!(
        plans.len() > 20,
        "auto_explain printed {} plans",
        plans.len()
    );
    plans
}

/// The figure after `label` on a plan line, e.g. "Rows Removed by Join Filter: 749500".
fn removed(plan: &str, label: &str) -> u64 {
    plan.lines()
        .filter_map(|l| l.split_once(label))
        .filter_map(|(_, n)| n.trim().parse::<u64>().ok())
        .max()
        .unwrap_or(0)
}

/// A plan with its long lines (arrays of ids) cut short, for a failure message.
fn short(plan: &str) -> String {
    plan.lines()
        .map(|l| l.chars().take(200).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n")
}

fn assert_index_driven(shape: &str, plans: &[String]) {
    let (mut fences, mut deletions, mut leases, mut promotions) = (0, 0, 0, 0);
    for full in plans {
        let plan = &short(full);
        // A join that compares every leased row with every listed one.
        assert!(
            removed(plan, "Rows Removed by Join Filter:") < 1_000,
            "{shape}: a join rescans the batch per row:\n{plan}"
        );
        assert!(
            !plan.contains("Seq Scan on messages"),
            "{shape}: a hot-path statement scans outbox.messages:\n{plan}"
        );
        if plan.contains("SET behind = false") && plan.contains("ANY (p_ids)") {
            promotions += 1;
            assert!(
                plan.contains("Index Cond: (outbox_id = ANY"),
                "{shape}: the keys' next heads are not updated by primary key:\n{plan}"
            );
        }
        if plan.contains("FROM outbox.messages_") && plan.contains("ORDER BY n0.seq") {
            assert!(
                plan.contains("_order_key_seq_idx on messages_"),
                "{shape}: a key's next head is not found through messages_order_key_seq_idx:\n{plan}"
            );
        }
        if plan.contains("hashtext(m.message_key)") {
            assert!(
                plan.contains("Index Cond: (outbox_id = u.id)"),
                "{shape}: the completion's keys are not read by primary key:\n{plan}"
            );
        }
        if plan.contains("CROSS JOIN LATERAL") && plan.contains("FOR NO KEY UPDATE") {
            fences += 1;
            assert!(
                plan.contains("Index Cond: (outbox_id = u.id)")
                    || plan.contains("Index Cond: ((outbox_id = u.id) AND (slot = "),
                "{shape}: the fence is not one primary-key probe per listed id:\n{plan}"
            );
        }
        if plan.contains("DELETE FROM outbox.messages_0 AS m") {
            deletions += 1;
            assert!(
                plan.contains("Index Scan using messages_0_pkey on messages_0 m")
                    && plan.contains("Index Cond: (outbox_id = ANY"),
                "{shape}: the deleting fence is not one scan of the primary key for the \
                 listed ids (in id order):\n{plan}"
            );
        }
        if plan.contains("lease_token = (left(gen_random_uuid()") {
            leases += 1;
            assert!(
                plan.contains("Tid Scan on messages_0"),
                "{shape}: the claim does not lease its rows by tuple address:\n{plan}"
            );
        }
    }
    // extend and release, seven rounds each; every round's completion deletes by its fence
    // (all its messages are delivered) and every claim leases.
    assert!(fences >= 14, "{shape}: {fences} fence plans seen");
    assert!(
        deletions >= 7,
        "{shape}: {deletions} deleting fence plans seen"
    );
    assert!(leases >= 7, "{shape}: {leases} lease plans seen");
    // A round promotes when its 400 hold a key's head with messages behind it, which
    // depends on the shard its claim starts at (chosen at random): 4 of the 7 rounds in one
    // run at 1,000,000 rows. At least one, so that the promotion's plan is checked.
    assert!(
        promotions >= 1,
        "{shape}: {promotions} head promotions seen"
    );
}

/// `n` messages, every tenth with one of 50 keys (so completions promote keys' next heads).
async fn fill(c: &Client, n: i64) {
    c.execute(
        "INSERT INTO outbox.messages (topic, message_key, payload) \
         SELECT 'plans', CASE WHEN i % 10 = 0 THEN 'k' || (i / 10 % 50) END, \
                convert_to(json_build_object('n', i)::text, 'UTF8') \
           FROM generate_series(1, $1::bigint) AS i",
        &[&n],
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn hot_path_plans_are_index_driven_at_any_backlog_and_any_statistics() {
    let db = TestDb::new().await;
    let c = db.client().await;

    // What autovacuum leaves behind once the queue drained: statistics of an empty table
    // that keeps its pages; then a burst arrives.
    fill(&c, 20_000).await;
    c.batch_execute("DELETE FROM outbox.messages")
        .await
        .unwrap();
    c.batch_execute("VACUUM (TRUNCATE false) outbox.messages")
        .await
        .unwrap();
    let reltuples: f32 = c
        .query_one(
            "SELECT reltuples FROM pg_class WHERE oid = 'outbox.messages_0'::regclass",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(reltuples < 1.0, "reltuples {reltuples}");
    fill(&c, 20_000).await;
    for claim in CLAIMS {
        assert_index_driven(
            &format!("{claim}, 0-row statistics, 20,000 rows"),
            &hot_path_plans(&db.url, claim).await,
        );
    }

    c.batch_execute("ANALYZE outbox.messages").await.unwrap();
    for claim in CLAIMS {
        assert_index_driven(
            &format!("{claim}, 20,000 rows analyzed"),
            &hot_path_plans(&db.url, claim).await,
        );
    }

    fill(&c, 1_000_000).await;
    c.batch_execute("ANALYZE outbox.messages").await.unwrap();
    for claim in CLAIMS {
        assert_index_driven(
            &format!("{claim}, 1,000,000 rows analyzed"),
            &hot_path_plans(&db.url, claim).await,
        );
    }
    db.finish().await;
}

/// Adds 50,000 histories of finished messages two hours old and 50,000 new ones, prunes
/// those older than an hour in calls of 10,000 (as a retention job does) and checks the
/// plans of the prune: old attempts in time order from the time index, each probed in
/// outbox.messages by primary key, stopped at the limit, then deleted by row address.
async fn assert_retention_probes_per_old_attempt(shape: &str, url: &str, c: &Client) {
    c.batch_execute(
        "INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token, created_at)
         SELECT gen_random_uuid(), 1, 'DISPATCHED', 'w', gen_random_uuid(),
                now() - CASE WHEN i % 2 = 0 THEN interval '2 hours' ELSE interval '0' END
           FROM generate_series(1, 100000) AS i;
         ANALYZE outbox.attempts;",
    )
    .await
    .unwrap();

    let (explained, plans) = explaining(url).await;
    let mut pruned = 0;
    loop {
        let chunk: i64 = explained
            .query_one(
                "SELECT outbox.prune_attempts(interval '1 hour', 10000)",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        pruned += chunk;
        if chunk < 10_000 {
            break;
        }
    }
    assert_eq!(
        pruned, 50_000,
        "{shape}: the old histories of finished messages are pruned"
    );
    let plans = plans.lock().unwrap().clone();
    let select = plans
        .iter()
        .find(|p| p.contains("array_agg(o.slot)"))
        .unwrap_or_else(|| panic!("{shape}: no plan of the prune's selection among {plans:?}"));
    let select = short(select);
    for whole in [
        "Seq Scan on messages",
        "Hash Anti Join",
        "Merge Anti Join",
        "Materialize",
        // a Sort node, not the Merge Append's sort key
        "Sort  (",
        "Bitmap Heap Scan on attempts",
        "Seq Scan on attempts",
    ] {
        assert!(
            !select.contains(whole),
            "{shape}: the prune reads the whole backlog or the whole log ({whole}):\n{select}"
        );
    }
    assert!(
        select.contains("Index Cond: (outbox_id = o.outbox_id)"),
        "{shape}: the prune does not probe outbox.messages per old attempt:\n{select}"
    );
    assert!(
        select.contains("Index Scan using attempts_0_created_at_idx"),
        "{shape}: the prune does not take old attempts in order from the time index:\n{select}"
    );
    // The deletion finds each selected attempt by its address in its own slot.
    let delete = plans
        .iter()
        .find(|p| p.contains("Delete on attempts"))
        .unwrap_or_else(|| panic!("{shape}: no plan of the prune's DELETE among {plans:?}"));
    let delete = short(delete);
    assert!(
        delete.contains("Tid Scan on attempts_0") && !delete.contains("Seq Scan"),
        "{shape}: the prune does not delete by row address:\n{delete}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_probes_the_backlog_per_old_attempt_however_large_the_backlog() {
    let db = TestDb::new().await;
    let c = db.client().await;

    // Statistics of a drained queue (see above), then a burst.
    fill(&c, 20_000).await;
    c.batch_execute("DELETE FROM outbox.messages")
        .await
        .unwrap();
    c.batch_execute("VACUUM (TRUNCATE false) outbox.messages")
        .await
        .unwrap();
    fill(&c, 200_000).await;
    assert_retention_probes_per_old_attempt("0-row statistics, 200,000 rows", &db.url, &c).await;

    fill(&c, 800_000).await;
    c.batch_execute("ANALYZE outbox.messages").await.unwrap();
    assert_retention_probes_per_old_attempt("1,000,000 rows analyzed", &db.url, &c).await;
    db.finish().await;
}

/// The rows each scan of `table` in `plan` read (its `actual rows=` per loop, times its
/// loops), the largest.
fn rows_scanned(plan: &str, table: &str) -> u64 {
    plan.lines()
        .filter(|l| l.contains(" Scan ") && l.contains(&format!(" on {table}")))
        .filter_map(|l| {
            let (_, after) = l.split_once("actual rows=")?;
            let rows: u64 = after.split_whitespace().next()?.parse().ok()?;
            let loops: u64 = after
                .split_once("loops=")?
                .1
                .trim_end_matches(')')
                .parse()
                .ok()?;
            Some(rows * loops)
        })
        .max()
        .unwrap_or(0)
}

/// The rows the sequential scans of `table` in `plan` read: those they returned and those
/// their filter removed (a partition the data is not in is scanned empty, reading none).
fn seq_scanned(plan: &str, table: &str) -> u64 {
    let lines: Vec<&str> = plan.lines().collect();
    let mut read = 0;
    for (i, line) in lines.iter().enumerate() {
        if !(line.contains("Seq Scan on ") && line.contains(&format!(" on {table}"))) {
            continue;
        }
        read += line
            .split_once("actual rows=")
            .and_then(|(_, a)| a.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
        read += lines[i + 1..]
            .iter()
            .take(2)
            .map(|l| removed(l, "Rows Removed by Filter:"))
            .sum::<u64>();
    }
    read
}

/// The console's reads (`schema/11_console.sql`) over 200,000 pending messages (every tenth
/// keyed), their 200,000 attempts and 50,000 dead letters, analyzed: each call's statement,
/// planned for the filters it was given, reads outbox.messages and outbox.attempts through
/// an index only (the primary key walked from the cursor, or messages_order_key_seq_idx for a
/// key) and stops at its limit, or at the end of its search window for a filter few match;
/// the unfiltered dead-letter count reads at most 10,001 rows.
#[tokio::test(flavor = "multi_thread")]
async fn console_reads_are_index_driven_and_stop_at_their_limit() {
    let db = TestDb::new().await;
    let c = db.client().await;
    fill(&c, 200_000).await;
    c.batch_execute(
        "INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token)
         SELECT outbox_id, 1, 'FAILED', 'w', gen_random_uuid() FROM outbox.messages;
         INSERT INTO outbox.dead_letters (outbox_id, topic, payload, content_type, headers,
                                          created_at, attempt_count, max_attempts, last_error)
         SELECT gen_random_uuid(), 'dl' || (i % 100), '\\x00', 'application/json', '{}',
                now(), 10, 10, 'HTTP 500 #' || i
           FROM generate_series(1, 50000) AS i;
         ANALYZE outbox.messages; ANALYZE outbox.attempts; ANALYZE outbox.dead_letters;",
    )
    .await
    .unwrap();
    let keyed: Uuid = c
        .query_one(
            "SELECT outbox_id FROM outbox.messages WHERE message_key = 'k7' \
             ORDER BY seq DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let middle: Uuid = c
        .query_one(
            "SELECT outbox_id FROM outbox.messages ORDER BY outbox_id OFFSET 100000 LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let dead: Uuid = c
        .query_one("SELECT outbox_id FROM outbox.dead_letters LIMIT 1", &[])
        .await
        .unwrap()
        .get(0);
    let (e, plans) = explaining(&db.url).await;
    // (what is called, the text its plans must hold, the most rows a scan may read)
    let calls = [
        (
            "console_messages(NULL, NULL, NULL, NULL, NULL, NULL, 51)".to_owned(),
            "Index Scan Backward using messages_0_pkey",
            51,
        ),
        (
            format!("console_messages(NULL, NULL, NULL, NULL, NULL, '{middle}', 51)"),
            "Index Cond: (outbox_id < ",
            51,
        ),
        (
            "console_messages(NULL, 'plans', NULL, 'ready', '0 seconds', NULL, 1001)".to_owned(),
            "Index Scan Backward using messages_",
            // the window's scan hands on every message it reads, the ready ones and the
            // tenth that waits behind its key, until 1001 are ready
            1_250,
        ),
        // A topic no message has: searched in the window of 100,000 below the cursor, not
        // through the whole primary key.
        (
            "console_messages(NULL, 'none', NULL, 'leased', NULL, NULL, 51)".to_owned(),
            "Index Scan Backward using messages_",
            100_000,
        ),
        (
            format!("console_window_end('{middle}')"),
            "messages_0_pkey",
            100_000,
        ),
        (
            "console_messages(NULL, NULL, 'k7', NULL, NULL, NULL, 51)".to_owned(),
            "messages_0_order_key_seq_idx",
            1_000,
        ),
        (
            format!("console_messages('{keyed}', NULL, NULL, NULL, NULL, NULL, 51)"),
            "Index Cond: (outbox_id = ",
            1,
        ),
        (
            format!("console_message('{keyed}', true)"),
            "messages_0_order_key_seq_idx",
            1_000,
        ),
        (
            format!("console_attempts('{keyed}', 1000)"),
            "Index Cond: (outbox_id = ",
            1,
        ),
        (
            "console_dead_letters(NULL, NULL, NULL, NULL, NULL, 51)".to_owned(),
            "Index Scan Backward using dead_letters_pkey",
            51,
        ),
        (
            format!("console_dead_letters(NULL, NULL, NULL, 'http', '{dead}', 51)"),
            "dead_letters_pkey",
            50_000,
        ),
        (
            format!("console_dead_letters(ARRAY['{dead}'::uuid], NULL, NULL, NULL, NULL, 51)"),
            "Index Cond: (outbox_id = ANY ",
            1,
        ),
        (
            "console_dead_letter_count(NULL, NULL, NULL, NULL)".to_owned(),
            "Limit",
            10_001,
        ),
        (
            format!("console_dead_letter('{dead}', false)"),
            "Index Cond: (outbox_id = ",
            1,
        ),
    ];
    for (call, expected, most) in calls {
        plans.lock().unwrap().clear();
        e.batch_execute(&format!("SELECT * FROM outbox.{call}"))
            .await
            .unwrap();
        let all = plans.lock().unwrap().join("\n");
        let plan = short(&all);
        assert!(
            plan.contains(expected),
            "{call}: no {expected:?} in\n{plan}"
        );
        for table in ["messages_", "attempts_"] {
            let read = seq_scanned(&plan, table);
            assert!(
                read == 0,
                "{call}: a sequential scan of a {table} partition read {read} rows:\n{plan}"
            );
        }
        for table in ["messages_", "attempts_", "dead_letters"] {
            let read = rows_scanned(&plan, table);
            assert!(
                read <= most,
                "{call}: a scan of {table} read {read} rows (at most {most}):\n{plan}"
            );
        }
    }
    db.finish().await;
}

/// What the console's overview and destinations pages read instead of tables
/// (`schema/08_observation.sql`), over 200,000 pending messages (a tenth leased) and
/// 200,000 attempts of the last hour: `latest_observation` and `observed_attempt_rates`
/// read no row of outbox.messages or outbox.attempts, whatever the backlog; the
/// observation's refresh counts each minute of attempts once, by ranges of
/// attempts_created_at_idx, and a second refresh within the same minute counts none again;
/// and the snapshot names each lease holder with its leases.
#[tokio::test(flavor = "multi_thread")]
async fn the_console_reads_the_observation_not_the_tables() {
    let db = TestDb::new().await;
    let c = db.client().await;
    fill(&c, 200_000).await;
    c.batch_execute(
        "UPDATE outbox.messages
            SET claimed_by = 'w' || (seq % 3), lease_token = gen_random_uuid(),
                lease_expires_at = now() + interval '1 minute'
          WHERE seq % 10 = 0;
         INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token,
                                      created_at)
         SELECT outbox_id, 1, 'DISPATCHED', 'w', gen_random_uuid(),
                now() - interval '1 hour' + seq * interval '17 milliseconds'
           FROM outbox.messages;
         ANALYZE outbox.messages; ANALYZE outbox.attempts;",
    )
    .await
    .unwrap();
    let (e, plans) = explaining(&db.url).await;
    let run = |sql: &'static str| {
        let (e, plans) = (&e, plans.clone());
        async move {
            plans.lock().unwrap().clear();
            e.batch_execute(sql).await.unwrap();
            short(&plans.lock().unwrap().join("\n"))
        }
    };
    let refresh = run("SELECT * FROM outbox.observe(10, interval '0')").await;
    let counted = refresh
        .lines()
        .filter(|l| l.contains("Index Only Scan") || l.contains("Index Scan"))
        .filter(|l| l.contains("created_at_idx on attempts_"))
        .count();
    assert!(
        counted > 0,
        "the refresh read no range of attempts_created_at_idx:\n{refresh}"
    );
    assert_eq!(
        seq_scanned(&refresh, "attempts_"),
        0,
        "the refresh read attempts sequentially:\n{refresh}"
    );
    let minutes: i64 = c
        .query_one("SELECT count(*) FROM outbox.attempt_minutes", &[])
        .await
        .unwrap()
        .get(0);
    assert!((59..=60).contains(&minutes), "{minutes} minutes counted");
    let again = run("SELECT * FROM outbox.observe(10, interval '0')").await;
    let lines_of_attempts = |plan: &str| {
        plan.lines()
            .filter(|l| l.contains("created_at_idx on attempts_") && l.contains("actual rows="))
            .filter_map(|l| {
                l.split_once("actual rows=")?
                    .1
                    .split_whitespace()
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum::<u64>()
    };
    assert!(
        lines_of_attempts(&again) < lines_of_attempts(&refresh),
        "a second refresh counted the hour again:\n{again}"
    );
    for read in [
        "SELECT * FROM outbox.latest_observation()",
        "SELECT * FROM outbox.observed_attempt_rates()",
    ] {
        let plan = run(read).await;
        for table in ["messages_", "attempts_"] {
            assert_eq!(
                rows_scanned(&plan, table) + seq_scanned(&plan, table),
                0,
                "{read} read {table}:\n{plan}"
            );
        }
    }
    let rates: i64 = c
        .query_one(
            "SELECT sum(delivered)::bigint FROM outbox.observed_attempt_rates()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(rates > 150_000, "{rates} delivered in the counted minutes");
    let workers: serde_json::Value = c
        .query_one(
            "SELECT snapshot -> 'workers' FROM outbox.latest_observation()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let held: i64 = workers
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| {
            w["worker_id"]
                .as_str()
                .is_some_and(|id| id.starts_with("w") && id.len() == 2)
        })
        .map(|w| w["leases_held"].as_i64().unwrap())
        .sum();
    assert_eq!(held, 20_000, "{workers}");
    db.finish().await;
}

/// A filter no id or key bounds is searched window by window: over 150,000 pending messages
/// whose only leased one is the oldest, `console_messages` for leased messages returns none
/// from the newest window of 100,000, `console_window_end` names the next window's cursor,
/// the next window has it, and the window after that reaches the oldest message.
#[tokio::test(flavor = "multi_thread")]
async fn a_rare_filter_is_searched_one_window_at_a_time() {
    let db = TestDb::new().await;
    let c = db.client().await;
    fill(&c, 150_000).await;
    let oldest: Uuid = c
        .query_one(
            "UPDATE outbox.messages
                SET claimed_by = 'w', lease_token = gen_random_uuid(),
                    lease_expires_at = now() + interval '1 minute'
              WHERE outbox_id = (SELECT outbox_id FROM outbox.messages ORDER BY outbox_id LIMIT 1)
             RETURNING outbox_id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let leased = |before: Option<Uuid>| {
        let c = &c;
        async move {
            c.query(
                "SELECT outbox_id FROM outbox.console_messages(NULL, NULL, NULL, 'leased', \
                                                               NULL, $1, 51)",
                &[&before],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<_, Uuid>(0))
            .collect::<Vec<_>>()
        }
    };
    let end = |before: Option<Uuid>| {
        let c = &c;
        async move {
            c.query_one("SELECT outbox.console_window_end($1)", &[&before])
                .await
                .unwrap()
                .get::<_, Option<Uuid>>(0)
        }
    };
    assert_eq!(leased(None).await, Vec::<Uuid>::new());
    let next = end(None).await.expect("a second window");
    let newer: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE outbox_id >= $1",
            &[&next],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        newer, 100_000,
        "the first window ends at its 100,000th message"
    );
    assert_eq!(leased(Some(next)).await, vec![oldest]);
    assert_eq!(
        end(Some(next)).await,
        None,
        "the second window reaches the oldest"
    );
    db.finish().await;
}

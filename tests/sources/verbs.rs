//! `repair`, `dead-letters` and `replay` with `--all-sources`, as processes against real
//! databases: three sources listed as `[sources.NAME]` tables of a config file (made from a
//! migrated template), with dead letters and expired leases made through the SQL API, and a
//! fourth listed source whose database does not exist. Each verb prints a line per source
//! (or, for `dead-letters list`, each dead letter with its source), changes each database
//! as it says (read back with SQL), and exits 2 naming the missing source after trying the
//! others; `--source` with `--all-sources` is refused.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::sql::{claim, complete, enqueue, enqueue_with, expire_leases};
use common::{TestDb, base_url, connect, count, text};
use outbox_relay::store::with_database;
use tokio_postgres::Client;
use uuid::Uuid;

/// The sources, by name, in the order their dead letters are made (so `beta`'s are the
/// newest).
const NAMES: [&str; 3] = ["alpha", "beta", "gamma"];
const MISSING: &str = "missing";

/// `n` dead letters on `topic`, each enqueued, claimed and failed for good with `error`;
/// their ids.
async fn dead(c: &Client, topic: &str, n: usize, error: &str) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let id = enqueue(c, topic, None).await;
        let claimed = claim(c, 1, "w", 30).await;
        assert_eq!(claimed.len(), 1);
        assert_eq!(claimed[0].id, id);
        complete(c, &claimed[0], "w", "FAILED", Some(error))
            .await
            .unwrap();
        ids.push(id);
    }
    ids
}

/// Messages claimed and left with expired leases, as by a worker that died: `again` with
/// attempts left (a repair requeues them), `last` on their last attempt (a repair
/// dead-letters them).
async fn stuck(c: &Client, again: usize, last: usize) {
    for _ in 0..again {
        enqueue_with(c, None, 5).await;
    }
    for _ in 0..last {
        enqueue_with(c, None, 1).await;
    }
    let n = i32::try_from(again + last).unwrap();
    assert_eq!(claim(c, n, "gone", 30).await.len(), again + last);
    expire_leases(c).await;
}

/// A config file listing `sources` (name → database) as `[sources.NAME]` tables.
fn config(dir: &Path, file: &str, sources: &[(&str, &str)]) -> PathBuf {
    let mut toml = String::new();
    for (name, database) in sources {
        toml.push_str(&format!(
            "[sources.{name}]\ndatabase_url = \"{}\"\n",
            with_database(&base_url(), database)
        ));
    }
    let path = dir.join(file);
    std::fs::write(&path, toml).unwrap();
    path
}

/// `outbox-relay --config CONFIG ARGS`: (exit code, stdout, stderr).
fn verb(db: &TestDb, config: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let mut all = vec!["--config", config.to_str().unwrap()];
    all.extend_from_slice(args);
    let out = common::verb(&all, &db.url);
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// The lines of `stdout` that start with `NAME: `, by name.
fn per_source(stdout: &str) -> BTreeMap<String, String> {
    stdout
        .lines()
        .filter_map(|l| l.split_once(": "))
        .filter(|(name, _)| NAMES.contains(name) || *name == MISSING)
        .map(|(name, rest)| (name.to_owned(), rest.to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_dead_letters_and_replay_take_every_source_and_name_the_one_that_fails() {
    let _serial = crate::SERIAL.lock().await;
    let db = TestDb::new().await;
    let template = db.migrated_template().await;
    let mut databases = BTreeMap::new();
    let mut clients = BTreeMap::new();
    for name in NAMES {
        let database = db.sibling_from(name, &template).await;
        clients.insert(
            name,
            connect(&with_database(&base_url(), &database))
                .await
                .unwrap(),
        );
        databases.insert(name, database);
    }
    let missing_database = format!("{}_{MISSING}", db.name);
    let dir = db.scratch_dir();
    let listed: Vec<(&str, &str)> = databases.iter().map(|(n, d)| (*n, d.as_str())).collect();
    let healthy = config(&dir, "healthy.toml", &listed);
    let mut with_missing = listed.clone();
    with_missing.push((MISSING, &missing_database));
    let broken = config(&dir, "broken.toml", &with_missing);

    // alpha: 3 timeouts on orders and a refused email; beta: 2 timeouts on orders, made
    // after alpha's; gamma: none. Then the leases a dead worker left behind.
    let (alpha, beta, gamma) = (&clients["alpha"], &clients["beta"], &clients["gamma"]);
    let alpha_timeouts = dead(alpha, "orders", 3, "HTTP 503: upstream timeout").await;
    dead(alpha, "emails", 1, "HTTP 400: bad address").await;
    let beta_timeouts = dead(beta, "orders", 2, "HTTP 503: upstream timeout").await;
    stuck(alpha, 1, 1).await;
    stuck(beta, 2, 0).await;

    // --source and --all-sources together are refused, whatever the verb.
    for args in [
        &["repair", "--all-sources", "--source", "alpha"][..],
        &[
            "dead-letters",
            "count",
            "--all-sources",
            "--source",
            "alpha",
        ],
        &["replay", "--all", "--all-sources", "--source", "alpha"],
    ] {
        let (code, _, stderr) = verb(&db, &healthy, args);
        assert_eq!(code, Some(2), "{args:?}");
        assert!(
            stderr.contains("give --source NAME or --all-sources, not both"),
            "{args:?}: {stderr}"
        );
    }

    // repair: a line per source with what it did; the missing one fails the verb, named,
    // after the others were repaired.
    let (code, stdout, stderr) = verb(
        &db,
        &broken,
        &["repair", "--all-sources", "--parallel", "1"],
    );
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    let lines = per_source(&stdout);
    assert_eq!(lines["alpha"], "requeued 1 dead_lettered 1", "{stdout}");
    assert_eq!(lines["beta"], "requeued 2 dead_lettered 0", "{stdout}");
    assert_eq!(lines["gamma"], "requeued 0 dead_lettered 0", "{stdout}");
    assert!(
        lines[MISSING].starts_with("failed: ") && lines[MISSING].contains("does not exist"),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!(
            "1 of the sources could not be repaired: {MISSING}"
        )),
        "{stderr}"
    );
    let expired = "SELECT count(*) FROM outbox.messages WHERE lease_token IS NOT NULL";
    for (name, c) in &clients {
        assert_eq!(count(c, expired).await, 0, "{name}: no lease left held");
    }
    assert_eq!(
        count(alpha, "SELECT count(*) FROM outbox.messages").await,
        1
    );
    assert_eq!(count(beta, "SELECT count(*) FROM outbox.messages").await, 2);
    assert_eq!(
        count(alpha, "SELECT count(*) FROM outbox.dead_letters").await,
        5
    );
    let (code, stdout, stderr) = verb(&db, &healthy, &["repair", "--all-sources"]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert_eq!(
        stdout,
        "alpha: requeued 0 dead_lettered 0\nbeta: requeued 0 dead_lettered 0\n\
         gamma: requeued 0 dead_lettered 0\n",
        "a line per source, in name order"
    );

    // dead-letters count: a line per source, then the sum of those read.
    let (code, stdout, stderr) = verb(
        &db,
        &broken,
        &[
            "dead-letters",
            "count",
            "--all-sources",
            "--topic",
            "orders",
        ],
    );
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    let lines = per_source(&stdout);
    assert_eq!(
        (
            lines["alpha"].as_str(),
            lines["beta"].as_str(),
            lines["gamma"].as_str()
        ),
        ("3", "2", "0"),
        "{stdout}"
    );
    assert!(lines[MISSING].contains("does not exist"), "{stdout}");
    assert!(
        stdout.contains("all sources: 5 (1 of 4 not read)"),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!("1 of the sources could not be read: {MISSING}")),
        "{stderr}"
    );
    let (code, stdout, _) = verb(&db, &healthy, &["dead-letters", "count", "--all-sources"]);
    assert_eq!(code, Some(0));
    assert!(stdout.ends_with("all sources: 7\n"), "{stdout}");

    // dead-letters list: the newest of every source, each with its source; the missing
    // source's cause on stderr, so that the JSON lines stay JSON.
    let (code, stdout, stderr) = verb(
        &db,
        &broken,
        &[
            "dead-letters",
            "list",
            "--all-sources",
            "--json",
            "--error-contains",
            "TIMEOUT",
        ],
    );
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    let listed: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let got: Vec<(String, Uuid)> = listed
        .iter()
        .map(|v| {
            (
                v["source"].as_str().unwrap().to_owned(),
                v["outbox_id"].as_str().unwrap().parse().unwrap(),
            )
        })
        .collect();
    let mut expected: Vec<(String, Uuid)> = beta_timeouts
        .iter()
        .rev()
        .map(|id| ("beta".to_owned(), *id))
        .chain(
            alpha_timeouts
                .iter()
                .rev()
                .map(|id| ("alpha".to_owned(), *id)),
        )
        .collect();
    assert_eq!(got, expected, "newest first across the sources");
    assert!(
        stderr.contains(&format!("{MISSING}: failed: ")) && stderr.contains("does not exist"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("1 of the sources could not be read: {MISSING}")),
        "{stderr}"
    );
    let (code, stdout, stderr) = verb(
        &db,
        &healthy,
        &[
            "dead-letters",
            "list",
            "--all-sources",
            "--topic",
            "orders",
            "--limit",
            "3",
        ],
    );
    assert_eq!(code, Some(0), "{stderr}");
    expected.truncate(3);
    let shown: Vec<(&str, &str)> = stdout
        .lines()
        .map(|l| l.split_once("  ").unwrap())
        .map(|(source, rest)| (source.trim_end(), rest.trim_start()))
        .collect();
    assert_eq!(shown.len(), 3, "--limit over every source: {stdout}");
    for ((source, rest), (name, id)) in shown.iter().zip(&expected) {
        assert_eq!(source, name, "{stdout}");
        assert!(rest.starts_with(&id.to_string()), "{stdout}");
        assert!(rest.contains("upstream timeout"), "{stdout}");
    }

    // dead-letters show: found in the source that holds it, named.
    let id = beta_timeouts[0].to_string();
    let (code, stdout, stderr) = verb(
        &db,
        &healthy,
        &["dead-letters", "show", "--all-sources", &id],
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.starts_with("source        beta\noutbox_id     "),
        "{stdout}"
    );
    assert!(stdout.contains("upstream timeout"), "{stdout}");
    let (code, stdout, _) = verb(
        &db,
        &healthy,
        &["dead-letters", "show", "--all-sources", "--json", &id],
    );
    assert_eq!(code, Some(0));
    let shown: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(shown["source"], "beta");
    assert_eq!(shown["outbox_id"], id.as_str());
    let nil = Uuid::nil().to_string();
    let (code, _, stderr) = verb(
        &db,
        &healthy,
        &["dead-letters", "show", "--all-sources", &nil],
    );
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains(&format!("no dead letter {nil} in any of the 3 sources")),
        "{stderr}"
    );
    let (code, stdout, stderr) = verb(
        &db,
        &broken,
        &["dead-letters", "show", "--all-sources", &nil],
    );
    assert_eq!(code, Some(2));
    assert!(
        stdout.contains("no dead letter") && stdout.contains("in the 3 sources read"),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!("could not be read: {MISSING}")),
        "{stderr}"
    );

    // replay: a filter is still required, an --id is refused, a dry run moves nothing.
    let (code, _, stderr) = verb(&db, &healthy, &["replay", "--all-sources"]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("replay needs a filter"), "{stderr}");
    let (code, _, stderr) = verb(&db, &healthy, &["replay", "--all-sources", "--id", &id]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("--id names a dead letter of one source"),
        "{stderr}"
    );
    let (code, stdout, stderr) = verb(
        &db,
        &healthy,
        &["replay", "--all-sources", "--topic", "orders", "--dry-run"],
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        stdout,
        "alpha: would replay 3\nbeta: would replay 2\ngamma: would replay 0\n\
         all sources: would replay 5\n"
    );
    assert_eq!(
        count(alpha, "SELECT count(*) FROM outbox.dead_letters").await,
        5
    );
    assert_eq!(
        count(beta, "SELECT count(*) FROM outbox.dead_letters").await,
        2
    );

    // The replay: each source moves its own and records it with the reason; the missing
    // one fails the verb after the others moved theirs.
    let (code, stdout, stderr) = verb(
        &db,
        &broken,
        &[
            "replay",
            "--all-sources",
            "--topic",
            "orders",
            "--error-contains",
            "timeout",
            "--reason",
            "INC-7: upstream fixed",
            "--step",
            "2",
        ],
    );
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    let lines = per_source(&stdout);
    assert!(
        lines["alpha"].starts_with("replayed 3 (replay "),
        "{stdout}"
    );
    assert!(lines["beta"].starts_with("replayed 2 (replay "), "{stdout}");
    assert_eq!(
        lines["gamma"], "replayed 0 (no dead letter matches)",
        "{stdout}"
    );
    assert!(lines[MISSING].starts_with("failed: "), "{stdout}");
    assert!(
        stdout.contains("all sources: replayed 5 (1 of 4 failed)"),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!(
            "1 of the sources could not be replayed: {MISSING}"
        )),
        "{stderr}"
    );
    let audit = "SELECT reason, replayed FROM outbox.replay_log";
    for (name, c, moved, left) in [("alpha", alpha, 3, 2), ("beta", beta, 2, 0)] {
        let rows = c.query(audit, &[]).await.unwrap();
        assert_eq!(rows.len(), 1, "{name}: one audit row");
        assert_eq!(
            rows[0].get::<_, String>(0),
            "INC-7: upstream fixed",
            "{name}"
        );
        assert_eq!(rows[0].get::<_, i64>(1), moved, "{name}");
        assert_eq!(
            count(
                c,
                "SELECT count(*) FROM outbox.messages WHERE topic = 'orders'"
            )
            .await,
            moved,
            "{name}: the replayed dead letters are back in the outbox"
        );
        assert_eq!(
            count(c, "SELECT count(*) FROM outbox.dead_letters").await,
            left,
            "{name}: the others are still dead letters"
        );
    }
    assert_eq!(
        count(gamma, "SELECT count(*) FROM outbox.replay_log").await,
        0,
        "no audit row for a replay of nothing"
    );

    drop(clients);
    db.finish().await;
}

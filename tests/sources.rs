//! Many outboxes, one fleet, with real processes against real databases: three relayer
//! processes serve every database a catalogue query lists, each database by one process at
//! a time; a process killed with SIGKILL loses its sources to the others; databases added
//! to the catalogue are served within the discovery interval; a dropped database and one
//! whose login lost its grants are reported while the others flow; the connections stay
//! within the server's budget; and a stopping process gives its sources back.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use common::{Relayer, TestDb, base_url, connect, eventually, fill, free_port};
use outbox_relay::store::with_database;
use uuid::Uuid;

/// Sources at start, and added while the fleet runs. The server of `make test` takes 100
/// connections: 27 sources of at most 3 sessions each fit its budget of 84 below.
const SOURCES: usize = 20;
const ADDED: usize = 5;
const PER_SOURCE: i64 = 500;
/// `max_connections_per_server`: 3 processes × 9 sources × (pool 2 + LISTEN).
const BUDGET: i64 = 84;
const CATALOGUE: &str = "SELECT name, url FROM public.sources";

struct Source {
    name: String,
    url: String,
    ids: Vec<Uuid>,
}

/// Copies of `template` named `s<i>`, each with PER_SOURCE messages (every third keyed),
/// listed in the catalogue of `db`.
async fn sources(db: &TestDb, template: &str, range: std::ops::Range<usize>) -> Vec<Source> {
    let catalogue = db.client().await;
    let mut made = Vec::new();
    for i in range {
        let name = db.sibling_from(&format!("s{i}"), template).await;
        let url = with_database(&base_url(), &name);
        let c = connect(&url).await.expect("connect to a source");
        let ids = fill(&c, "orders", PER_SOURCE, Some(3)).await;
        drop(c);
        catalogue
            .execute(
                "INSERT INTO public.sources (name, url) VALUES ($1, $2)",
                &[&name, &url],
            )
            .await
            .unwrap();
        made.push(Source { name, url, ids });
    }
    made
}

/// One line of a file sink: (outbox_id, key, seq).
type Line = (Uuid, Option<String>, Option<i64>);

fn lines(path: &Path) -> Vec<Line> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            (
                v["outbox_id"].as_str().unwrap().parse().unwrap(),
                v["key"].as_str().map(str::to_owned),
                v["seq"].as_i64(),
            )
        })
        .collect()
}

fn delivered(files: &[std::path::PathBuf]) -> BTreeSet<Uuid> {
    files.iter().flat_map(|f| lines(f)).map(|l| l.0).collect()
}

/// The tests of this file one at a time: a fleet discovering a server's databases would
/// serve the other test's too.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_of_three_serves_every_database_each_by_one_process_and_takes_over_a_killed_ones() {
    let _serial = SERIAL.lock().await;
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute("CREATE TABLE public.sources (name text PRIMARY KEY, url text NOT NULL)")
        .await
        .unwrap();
    let template = db.sibling("tmpl").await;
    {
        let mut t = connect(&with_database(&base_url(), &template))
            .await
            .unwrap();
        outbox_relay::schema::runner()
            .run_async(&mut t)
            .await
            .expect("migrate the template");
    }
    let mut all = sources(&db, &template, 0..SOURCES).await;
    // Two sources that go wrong while the fleet runs: one is dropped, one loses its grants.
    let gone = db.sibling_from("gone", &template).await;
    let revoked = db.sibling_from("revoked", &template).await;
    let revoked_login = db.login("revoked", Some("outbox_relay")).await;
    let revoked_url = with_database(&revoked_login, &revoked);
    for (name, url) in [
        (&gone, with_database(&base_url(), &gone)),
        (&revoked, revoked_url.clone()),
    ] {
        c.execute(
            "INSERT INTO public.sources (name, url) VALUES ($1, $2)",
            &[name, &url],
        )
        .await
        .unwrap();
    }

    // The connections of the relayers' pools and LISTEN sessions to every database of this
    // test (those added later included), sampled while they run.
    let most = Arc::new(AtomicI64::new(0));
    let sampler = {
        let most = most.clone();
        let pattern = format!("{}\\_%", db.name.replace('_', "\\_"));
        let admin = connect(&base_url()).await.unwrap();
        tokio::spawn(async move {
            loop {
                if let Ok(row) = admin
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity \
                         WHERE application_name IN ('outbox-relay', 'outbox-relay listener') \
                           AND datname::text LIKE $1",
                        &[&pattern],
                    )
                    .await
                {
                    most.fetch_max(row.get(0), Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    let dir = db.scratch_dir();
    let files: Vec<_> = (0..3).map(|i| dir.join(format!("w{i}.jsonl"))).collect();
    let addrs: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let budget = BUDGET.to_string();
    let mut relayers: Vec<Relayer> = (0..3)
        .map(|i| {
            Relayer::start(
                &db,
                &format!("w{i}"),
                &[
                    "--sink",
                    "file",
                    "--sink-file",
                    files[i].to_str().unwrap(),
                    "--sink-file-fsync",
                    "false",
                    "--sources-catalogue-url",
                    &db.url,
                    "--sources-catalogue-query",
                    CATALOGUE,
                    "--sources-discover-interval-secs",
                    "1",
                    "--source-lease-secs",
                    "3",
                    "--source-pool-size",
                    "2",
                    "--max-connections-per-server",
                    &budget,
                    "--batch-size",
                    "20",
                    "--telemetry-addr",
                    &addrs[i],
                ],
            )
        })
        .collect();

    // A third delivered, then one process is killed.
    let total: usize = all.iter().map(|s| s.ids.len()).sum();
    eventually(Duration::from_secs(90), "a third delivered", || async {
        delivered(&files).len() >= total / 3
    })
    .await;
    relayers[0].signal("KILL");
    let killed = relayers.remove(0);

    // Databases added to the catalogue are served within the discovery interval.
    let added_at = Instant::now();
    all.extend(sources(&db, &template, SOURCES..SOURCES + ADDED).await);
    let added: BTreeSet<Uuid> = all[SOURCES..].iter().flat_map(|s| s.ids.clone()).collect();
    eventually(
        Duration::from_secs(60),
        "a message of every added source delivered",
        || {
            let files = files.clone();
            let all = &all;
            async move {
                let got = delivered(&files);
                all[SOURCES..]
                    .iter()
                    .all(|s| s.ids.iter().any(|id| got.contains(id)))
            }
        },
    )
    .await;
    let first_of_added = added_at.elapsed();

    // One source is dropped, another's login loses its grants: the others keep flowing.
    let admin = connect(&base_url()).await.unwrap();
    admin
        .batch_execute(&format!("DROP DATABASE {gone} WITH (FORCE)"))
        .await
        .unwrap();
    let login = revoked_login
        .trim_start_matches("postgres://")
        .split('@')
        .next()
        .unwrap()
        .to_owned();
    c.batch_execute(&format!("REVOKE outbox_relay FROM {login}"))
        .await
        .unwrap();
    let expected: BTreeSet<Uuid> = all.iter().flat_map(|s| s.ids.clone()).collect();
    eventually(
        Duration::from_secs(120),
        "every message delivered",
        || async { delivered(&files).is_superset(&expected) },
    )
    .await;
    let readyz = |addr: String| async move {
        outbox_relay::http::probe(&addr, "/readyz")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default()
    };
    let down = |body: &str, name: &str| {
        body.lines()
            .any(|l| l.starts_with(&format!("source {name}: down")))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let body = loop {
        let body = readyz(addrs[1].clone()).await;
        if down(&body, &gone) && down(&body, &revoked) {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "both broken sources reported down within 30 s: /readyz says\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        body.lines()
            .any(|l| l.contains("does not exist") && l.contains(&gone)),
        "the dropped database is named with its cause: {body}"
    );
    assert!(
        body.lines()
            .any(|l| l.contains("may not use schema outbox") && l.contains(&revoked)),
        "the source whose login lost its grants is named with its cause: {body}"
    );

    // Nothing lost, nothing unknown.
    let got = delivered(&files);
    assert!(got.is_superset(&expected));
    assert_eq!(
        got.len(),
        expected.len(),
        "only the enqueued messages arrive"
    );

    // Per source and key, each process's first deliveries follow the key's sequence.
    let source_of: HashMap<Uuid, usize> = all
        .iter()
        .enumerate()
        .flat_map(|(i, s)| s.ids.iter().map(move |id| (*id, i)))
        .collect();
    for file in &files {
        let mut seen: HashSet<Uuid> = HashSet::new();
        let mut last: BTreeMap<(usize, String), i64> = BTreeMap::new();
        for (id, key, seq) in lines(file) {
            if !seen.insert(id) {
                continue;
            }
            if let (Some(key), Some(seq)) = (key, seq) {
                let at = last.entry((source_of[&id], key.clone())).or_insert(0);
                assert!(
                    seq > *at,
                    "{}: key {key} of source {} delivered seq {seq} first after seq {at}",
                    file.display(),
                    all[source_of[&id]].name
                );
                *at = seq;
            }
        }
    }

    // Each source served by one process at a time: in its attempt log, the worker changes
    // only at a handover (a kill, a process joining), never back and forth as two claimers
    // sharing a source do every few batches.
    for source in &all {
        let s = connect(&source.url).await.unwrap();
        let workers: Vec<String> = s
            .query(
                "SELECT worker_id FROM outbox.attempts \
                 WHERE state = 'DISPATCHED' ORDER BY created_at, outbox_id",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let switches = workers.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(
            switches <= 3,
            "source {} was delivered by {switches} alternations of workers: {:?}",
            source.name,
            workers.iter().collect::<BTreeSet<_>>()
        );
    }

    // The sources were spread: each live process served several of them.
    for file in &files[1..] {
        let served: BTreeSet<usize> = lines(file).iter().map(|l| source_of[&l.0]).collect();
        assert!(
            served.len() >= 3,
            "{} served only {} sources",
            file.display(),
            served.len()
        );
    }

    sampler.abort();
    let most = most.load(Ordering::Relaxed);
    assert!(
        most <= BUDGET,
        "the relayers' pools and LISTEN sessions reached {most} connections (budget {BUDGET})"
    );

    // Stopping gives the sources back at once.
    for r in &relayers {
        r.signal("TERM");
    }
    for r in &mut relayers {
        assert_eq!(r.exit_code(Duration::from_secs(60)).await, Some(0));
    }
    for source in &all {
        let s = connect(&source.url).await.unwrap();
        let holders: Vec<String> = s
            .query("SELECT worker_id FROM outbox.source_holders", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert!(
            holders.iter().all(|w| w == &killed.worker_id),
            "source {} still held by {holders:?} after its processes stopped",
            source.name
        );
    }
    eprintln!(
        "{} sources ({} added), {} messages, 3 processes (1 killed): the first message of the \
         added sources after {first_of_added:?}; at most {most} relayer connections (budget \
         {BUDGET}); {} added messages",
        all.len(),
        ADDED,
        expected.len(),
        added.len()
    );
    drop(killed);
    drop(c);
    drop(admin);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_config_serves_every_outbox_database_of_a_server_and_skips_the_others() {
    let _serial = SERIAL.lock().await;
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute("CREATE TABLE public.sources (name text PRIMARY KEY, url text NOT NULL)")
        .await
        .unwrap();
    let template = db.sibling("tmpl").await;
    {
        let mut t = connect(&with_database(&base_url(), &template))
            .await
            .unwrap();
        outbox_relay::schema::runner()
            .run_async(&mut t)
            .await
            .expect("migrate the template");
    }
    let served = sources(&db, &template, 0..3).await;
    let plain = db.sibling("plain").await;

    // Discovery alone: the migrated databases are sources, the plain one is not.
    let settings = outbox_relay::sources::SourcesSettings {
        server_url: Some(base_url()),
        ..Default::default()
    };
    let found = outbox_relay::sources::discover(&settings).await.unwrap();
    for s in &served {
        assert_eq!(found.get(&s.name), Some(&s.url), "{} discovered", s.name);
    }
    assert!(
        !found.contains_key(&plain),
        "a database without an outbox is not a source"
    );

    // The example, as it is, with its two variables.
    let sink = db.scratch_dir().join("example.jsonl");
    let log = db.scratch_dir().join("example.log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["run", "--config"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/sources-discover.toml"))
        .args(["--worker-id", "example", "--telemetry-addr"])
        .arg(format!("127.0.0.1:{}", free_port()))
        .env("OUTBOX_SOURCES_SERVER_URL", base_url())
        .env("OUTBOX_SINK_FILE", &sink)
        .env("RUST_LOG", "info")
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let expected: BTreeSet<Uuid> = served.iter().flat_map(|s| s.ids.clone()).collect();
    eventually(
        Duration::from_secs(60),
        "the example delivers every message",
        || async { delivered(std::slice::from_ref(&sink)).is_superset(&expected) },
    )
    .await;
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = child.wait().unwrap();
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        status.success(),
        "the example exits cleanly on SIGTERM: {log}"
    );
    assert!(
        log.contains("starting with many sources"),
        "it ran with many sources: {log}"
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_and_status_take_every_source_and_name_the_ones_that_fail() {
    let _serial = SERIAL.lock().await;
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute("CREATE TABLE public.sources (name text PRIMARY KEY, url text NOT NULL)")
        .await
        .unwrap();
    let fresh: Vec<String> = vec![db.sibling("a").await, db.sibling("b").await];
    let missing = format!("{}_missing", db.name);
    for name in fresh.iter().chain([&missing]) {
        c.execute(
            "INSERT INTO public.sources (name, url) VALUES ($1, $2)",
            &[name, &with_database(&base_url(), name)],
        )
        .await
        .unwrap();
    }
    let env = [
        ("OUTBOX_SOURCES_CATALOGUE_URL", db.url.as_str()),
        ("OUTBOX_SOURCES_CATALOGUE_QUERY", CATALOGUE),
    ];

    // Every source is tried; the missing one fails the verb, named.
    let out = common::verb_env(&["migrate", "--all-sources"], &db.url, &env);
    let (stdout, stderr) = (common::text(&out.stdout), common::text(&out.stderr));
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    for name in &fresh {
        assert!(
            stdout.contains(&format!("{name}: applied ")),
            "{name} migrated: {stdout}"
        );
    }
    assert!(
        stdout.contains(&format!("{missing}: failed: ")) && stdout.contains("does not exist"),
        "{stdout}"
    );
    assert!(
        stderr.contains("1 of the sources could not be migrated") && stderr.contains(&missing),
        "{stderr}"
    );
    // Again: the migrated ones are up to date.
    let out = common::verb_env(&["migrate", "--source", &fresh[0]], &db.url, &env);
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    assert!(common::text(&out.stdout).contains("schema is up to date"));

    // status: a line per source, the unreadable one with its cause.
    let a = connect(&with_database(&base_url(), &fresh[0]))
        .await
        .unwrap();
    fill(&a, "orders", 7, None).await;
    let out = common::verb_env(&["status", "--all-sources", "--json"], &db.url, &env);
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    let lines: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let by_name: BTreeMap<String, &serde_json::Value> = lines
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["source"].as_str().unwrap().to_owned(), l))
        .collect();
    assert_eq!(by_name[&fresh[0]]["health"], "ok");
    assert_eq!(by_name[&fresh[0]]["ready"], 7);
    assert_eq!(by_name[&fresh[1]]["ready"], 0);
    assert!(
        by_name[&missing]["health"]
            .as_str()
            .unwrap()
            .contains("does not exist"),
        "{lines}"
    );
    let out = common::verb_env(&["status", "--all-sources"], &db.url, &env);
    let table = common::text(&out.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&fresh[0]) && l.contains(" ok")),
        "{table}"
    );
    assert!(table.contains("1 of 3 sources cannot be read"), "{table}");
    // One source in full.
    let out = common::verb_env(&["status", "--source", &fresh[0]], &db.url, &env);
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    assert!(common::text(&out.stdout).contains("orders"));
    // Every operator verb takes --source.
    let out = common::verb_env(&["repair", "--source", &fresh[1]], &db.url, &env);
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    assert_eq!(
        common::text(&out.stdout).trim(),
        "requeued 0 dead_lettered 0"
    );
    let out = common::verb_env(&["repair", "--source", "nope"], &db.url, &env);
    assert!(
        common::text(&out.stderr).contains("no source is named \"nope\""),
        "{}",
        common::text(&out.stderr)
    );
    // Without any source configured, the verb says what to configure.
    let out = common::verb(&["migrate", "--all-sources"], &db.url);
    assert!(
        common::text(&out.stderr).contains("no sources are configured"),
        "{}",
        common::text(&out.stderr)
    );
    drop(a);
    db.finish().await;
}

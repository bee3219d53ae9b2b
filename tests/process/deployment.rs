//! What a deployment relies on, checked on the built binary: probes that tell the truth
//! (liveness from the start, readiness only with the database and the right schema, a
//! destination outage reported without failing readiness), a schema version named when it is wrong, a telemetry port conflict that
//! names the way out, a least-privilege login that relays but cannot migrate, and secrets
//! that come from the environment or files and never show up in logs or `/readyz`.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::{ClosedPort, Relayer, TestDb, eventually, free_port, text, verb};
use outbox_relay::probes::probe;
use outbox_relay::store::with_database;

const MINUTE: Duration = Duration::from_secs(60);

/// `GET path` on the relayer's listener once it answers: (status, body).
async fn get(port: u16, path: &str) -> (u16, String) {
    let addr = format!("127.0.0.1:{port}");
    let deadline = std::time::Instant::now() + MINUTE;
    loop {
        match probe(&addr, path).await {
            Ok(answer) => return answer,
            Err(e) => assert!(
                std::time::Instant::now() < deadline,
                "{addr}{path} did not answer: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts a relayer with its own telemetry port and a file sink.
fn start(db: &TestDb, url: &str, worker: &str, port: u16, more: &[&str]) -> Relayer {
    let out = db.scratch_dir().join(format!("{worker}.jsonl"));
    let addr = format!("127.0.0.1:{port}");
    let mut args = vec![
        "--telemetry-addr",
        addr.as_str(),
        "--sink",
        "file",
        "--sink-file",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(more);
    Relayer::start_with_url(db, url, worker, &args)
}

#[tokio::test(flavor = "multi_thread")]
async fn healthz_answers_from_the_start_and_readyz_carries_the_database_error() {
    let db = TestDb::new().await;
    let held = ClosedPort::new();
    let closed = held.port;
    let url = format!("postgres://postgres@127.0.0.1:{closed}/postgres");
    let port = free_port();
    let mut relayer = start(&db, &url, "unreachable", port, &[]);

    assert_eq!(get(port, "/healthz").await, (200, "ok\n".to_owned()));
    let (status, body) = get(port, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains(&format!(
            "database: cannot connect to 127.0.0.1:{closed} as \"postgres\", database \
             \"postgres\": connection refused (127.0.0.1:{closed})"
        )),
        "{body}"
    );
    // The error the operator reads in the log too.
    eventually(MINUTE, "the connection error in the log", || async {
        relayer.log_text().contains("connection refused")
    })
    .await;

    let healthcheck = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["healthcheck", "--addr", &format!("0.0.0.0:{port}")])
        .output()
        .unwrap();
    assert!(
        healthcheck.status.success(),
        "{}",
        text(&healthcheck.stderr)
    );
    let readiness = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args([
            "healthcheck",
            "--ready",
            "--addr",
            &format!("127.0.0.1:{port}"),
        ])
        .output()
        .unwrap();
    assert_eq!(readiness.status.code(), Some(2));
    assert!(
        text(&readiness.stderr).contains("/readyz on 127.0.0.1:"),
        "{}",
        text(&readiness.stderr)
    );

    // The relayer keeps trying: once something answers on that port (a proxy to the test
    // server), it gets past "connection refused" without a restart.
    let proxy = forward(held.listen(), port_of(&db.url));
    eventually(
        MINUTE,
        "the relayer to reach the database on a retry",
        || async {
            probe(&format!("127.0.0.1:{port}"), "/readyz")
                .await
                .is_ok_and(|(_, body)| !body.contains("connection refused"))
        },
    )
    .await;
    proxy.abort();

    relayer.signal("TERM");
    assert_eq!(relayer.exit_code(MINUTE).await, Some(0));
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_destination_outage_is_reported_but_leaves_the_relayer_ready() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // An HTTP destination on a port nothing listens on: every delivery fails retryably.
    let closed = ClosedPort::new();
    let config = db.scratch_dir().join("down.toml");
    std::fs::write(
        &config,
        format!(
            "[destinations.hooks]\ntype = \"http\"\nurl = \"http://127.0.0.1:{}\"\n\
             [[routes]]\ntopic = \"*\"\ndestination = \"hooks\"\n",
            closed.port
        ),
    )
    .unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let config = config.display().to_string();
    let mut w = Relayer::start(
        &db,
        "outage",
        &[
            "--config",
            &config,
            "--telemetry-addr",
            &addr,
            "--circuit-failures",
            "2",
            "--circuit-cooldown-ms",
            "60000",
            "--retry-base-ms",
            "10",
        ],
    );
    common::fill(&c, "orders", 5, None).await;
    eventually(MINUTE, "the circuit to open", || async {
        get(port, "/health/destinations")
            .await
            .1
            .contains("\"circuit\":\"open\"")
    })
    .await;

    let (status, body) = get(port, "/health/destinations").await;
    assert_eq!(status, 503, "{body}");
    let health: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(health["status"], "degraded");
    assert_eq!(health["destinations"][0]["name"], "hooks");
    assert_eq!(health["destinations"][0]["ok"], false);

    let (status, body) = get(port, "/readyz").await;
    assert_eq!(
        status, 200,
        "an outage downstream is not unreadiness: {body}"
    );
    assert!(body.starts_with("database: ok"), "{body}");
    assert!(
        body.contains("destination hooks: down") && body.contains("(circuit open)"),
        "reported: {body}"
    );
    let ready = verb(&["healthcheck", "--ready", "--addr", &addr], &db.url);
    assert!(ready.status.success(), "{}", text(&ready.stderr));
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_start_logs_what_an_operator_can_act_on_once() {
    let db = TestDb::empty().await;
    // An AMQP broker that cannot be used (nothing listens on the port, and nothing else
    // can take it while the test runs).
    let closed = ClosedPort::new();
    let config = db.scratch_dir().join("amqp.toml");
    std::fs::write(
        &config,
        format!(
            "[destinations.rabbit]\ntype = \"amqp\"\n\
             url = \"amqp://app:secret@127.0.0.1:{}/%2f\"\n\
             [[routes]]\ntopic = \"*\"\ndestination = \"rabbit\"\n",
            closed.port
        ),
    )
    .unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let config = config.display().to_string();
    let mut w = Relayer::start(
        &db,
        "quiet",
        &["--migrate", "--config", &config, "--telemetry-addr", &addr],
    );
    eventually(MINUTE, "the schema and the destination report", || async {
        let log = w.log_text();
        log.contains("database ready") && log.contains("destination not usable at start")
    })
    .await;
    let log = w.log_text();
    // The destination's problem at once, in words, with the destination named.
    let unusable: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("destination not usable at start"))
        .collect();
    assert_eq!(unusable.len(), 1, "{log}");
    assert!(
        unusable[0].contains("destination=rabbit") && unusable[0].contains("amqp connect"),
        "{log}"
    );
    // The migrations in one line, no sslmode warning on loopback, no client chatter.
    assert_eq!(log.matches("schema migrated").count(), 1, "{log}");
    assert!(!log.contains("V2__"), "no list of migrations: {log}");
    assert!(
        !log.contains("sslmode=prefer"),
        "no warning on loopback: {log}"
    );
    assert!(
        !log.contains("Close {") && !log.contains("ShortString("),
        "{log}"
    );
    // /readyz waits at most 2 s for a destination's answer (a loaded machine may need a
    // second look before the connection's refusal is in).
    eventually(
        MINUTE,
        "/readyz to name the destination's problem",
        || async {
            get(port, "/readyz")
                .await
                .1
                .contains("destination rabbit: amqp connect")
        },
    )
    .await;
    let (status, body) = get(port, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    assert!(!body.contains("secret"), "{body}");
    w.signal("TERM");
    assert_eq!(w.exit_code(MINUTE).await, Some(0));
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_old_schema_is_named_by_every_verb_and_readyz_until_migrated() {
    // What a database migrated by an earlier release looks like: this build's migrations up
    // to V7 and no further.
    let db = TestDb::at_version(7).await;
    let needed = outbox_relay::schema::version();
    let message = format!(
        "schema outbox is at version 7, this build needs {needed}: run `outbox-relay migrate` \
         (as the schema owner)"
    );
    for args in [
        &["status"][..],
        &["repair"],
        &["replay", "--all"],
        &["enqueue", "--topic", "t", "--payload", "{}"],
    ] {
        let out = verb(args, &db.url);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert_eq!(text(&out.stderr), format!("error: {message}\n"), "{args:?}");
    }

    let port = free_port();
    let mut relayer = start(&db, &db.url, "old-schema", port, &[]);
    let (status, body) = get(port, "/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains(&message), "{body}");

    let out = verb(&["migrate"], &db.url);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Every migration of this build after V7, in order, each named as it applied.
    let mut after_v7: Vec<_> = outbox_relay::schema::runner()
        .get_migrations()
        .iter()
        .filter(|m| m.version() > 7)
        .map(|m| {
            (
                m.version(),
                format!("applied V{}__{}\n", m.version(), m.name()),
            )
        })
        .collect();
    after_v7.sort();
    assert!(after_v7.len() >= 26, "V8 to V33 at least: {after_v7:?}");
    let expected: String = after_v7.into_iter().map(|(_, line)| line).collect();
    assert_eq!(text(&out.stdout), expected);
    eventually(MINUTE, "readiness after the migration", || async {
        probe(&format!("127.0.0.1:{port}"), "/readyz")
            .await
            .is_ok_and(|(status, _)| status == 200)
    })
    .await;
    let (_, body) = get(port, "/readyz").await;
    assert!(
        body.starts_with(&format!("database: ok (schema version {needed})\n")),
        "{body}"
    );

    let never = db.sibling("never").await;
    let out = verb(&["status"], &with_database(&db.url, &never));
    assert_eq!(
        text(&out.stderr),
        format!(
            "error: schema outbox does not exist in database \"{never}\" (never migrated); this \
             build needs version {needed}: run `outbox-relay migrate` (as the schema owner)\n"
        )
    );
    relayer.signal("TERM");
    assert_eq!(relayer.exit_code(MINUTE).await, Some(0));
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_taken_telemetry_port_names_the_way_out_and_port_0_is_logged() {
    let db = TestDb::new().await;
    let port = free_port();
    let mut first = start(&db, &db.url, "first", port, &[]);
    assert_eq!(get(port, "/healthz").await.0, 200);
    let mut second = start(&db, &db.url, "second", port, &[]);
    assert_eq!(second.exit_code(MINUTE).await, Some(2));
    let log = second.log_text();
    assert!(
        log.contains(&format!(
            "error: telemetry_addr 127.0.0.1:{port} cannot be bound: Address already in use \
             (os error 98). When several relayers run on one host, give each its own address \
             (--telemetry-addr 127.0.0.1:0 picks a free port and logs it) or turn the listener \
             off with --no-telemetry"
        )),
        "{log}"
    );

    let mut ephemeral = start(&db, &db.url, "ephemeral", 0, &[]);
    let listening = |log: String| {
        log.lines()
            .find(|l| l.contains("telemetry listening"))
            .and_then(|l| l.split("addr=").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .map(str::to_owned)
    };
    eventually(MINUTE, "the bound address in the log", || async {
        listening(ephemeral.log_text()).is_some()
    })
    .await;
    let bound = listening(ephemeral.log_text()).unwrap();
    assert!(!bound.ends_with(":0"), "{bound}");
    assert_eq!(probe(&bound, "/healthz").await.unwrap().0, 200);

    for r in [&mut first, &mut ephemeral] {
        r.signal("TERM");
        assert_eq!(r.exit_code(MINUTE).await, Some(0));
    }
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_least_privilege_login_relays_but_cannot_migrate() {
    let db = TestDb::new().await;
    let relay_login = format!("{}_relay", db.name);
    let relay_url = db.login("relay", Some("outbox_relay")).await;
    let producer_url = db.login("producer", Some("outbox_producer")).await;

    let mut ids = Vec::new();
    for n in 0..20 {
        let out = verb(
            &[
                "enqueue",
                "--topic",
                "lp",
                "--payload",
                &format!("{{\"n\":{n}}}"),
            ],
            &producer_url,
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        ids.push(text(&out.stdout).trim().to_owned());
    }
    let port = free_port();
    let mut relayer = start(&db, &relay_url, "least-privilege", port, &[]);
    let out_file = db.scratch_dir().join("least-privilege.jsonl");
    eventually(MINUTE, "the 20 messages to arrive", || async {
        let written = std::fs::read_to_string(&out_file).unwrap_or_default();
        ids.iter().all(|id| written.contains(id.as_str()))
    })
    .await;
    assert_eq!(get(port, "/readyz").await.0, 200);
    relayer.signal("TERM");
    assert_eq!(relayer.exit_code(MINUTE).await, Some(0));
    let log = relayer.log_text();
    assert!(!log.contains("permission denied"), "{log}");

    let out = verb(&["migrate"], &relay_url);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        format!(
            "error: migrate: migration failed: login \"{relay_login}\" cannot change schema \
             outbox, which belongs to \"postgres\": run `outbox-relay migrate` as \"postgres\" \
             (the DDL role); the relayer itself needs only a login in outbox_relay\n"
        )
    );
    let out = verb(&["repair"], &producer_url);
    assert!(
        text(&out.stderr).contains("permission denied for function repair_expired_leases"),
        "{}",
        text(&out.stderr)
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn secrets_come_from_the_environment_and_files_and_are_never_printed() {
    let db = TestDb::new().await;
    let dir = db.scratch_dir();
    let signing = "whsec_c2lnbmluZy1zM2NyZXQtdmFsdWU=";
    std::fs::write(dir.join("signing-secret"), format!("{signing}\n")).unwrap();
    let url_file = dir.join("database-url");
    // Trust authentication ignores the password, but it is in the URL the relayer holds.
    std::fs::write(
        &url_file,
        db.url.replace("postgres@", "postgres:db-pw-s3cret@"),
    )
    .unwrap();
    let closed = ClosedPort::new();
    let closed_port = closed.port;
    let config = dir.join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[destinations.hook]\n\
             type = \"http\"\n\
             url = \"http://hook:${{HOOK_PASSWORD}}@127.0.0.1:{closed_port}/in/{{topic}}\"\n\
             signing_secret = \"${{file:{}}}\"\n\
             [[routes]]\n\
             topic = \"*\"\n\
             destination = \"hook\"\n",
            dir.join("signing-secret").display()
        ),
    )
    .unwrap();
    let c = db.client().await;
    c.execute("SELECT outbox.enqueue('s', '{}'::jsonb)", &[])
        .await
        .unwrap();

    let port = free_port();
    let log = dir.join("secrets.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["run", "--config"])
        .arg(&config)
        .args(["--telemetry-addr", &format!("127.0.0.1:{port}")])
        .args(["--circuit-failures", "100", "--retry-base-ms", "50"])
        .env_remove("DATABASE_URL")
        .env("DATABASE_URL_FILE", &url_file)
        .env("HOOK_PASSWORD", "hook-pw-s3cret")
        .env("RUST_LOG", "debug")
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    eventually(MINUTE, "a failed delivery to be logged", || async {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("delivery failed")
    })
    .await;
    let (_, readyz) = get(port, "/readyz").await;
    let (_, metrics) = get(port, "/metrics").await;
    child.kill().unwrap();
    child.wait().unwrap();
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("hook:***@127.0.0.1"),
        "the URL is logged redacted: {logged}"
    );
    for secret in [
        "hook-pw-s3cret",
        "db-pw-s3cret",
        "c2lnbmluZy1zM2NyZXQtdmFsdWU",
    ] {
        for (place, text) in [
            ("log", &logged),
            ("/readyz", &readyz),
            ("/metrics", &metrics),
        ] {
            assert!(
                !text.contains(secret),
                "{secret} appears in the {place}:\n{text}"
            );
        }
    }

    // A secret that is not there refuses the start, naming the setting and the variable.
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["run", "--no-telemetry", "--config"])
        .arg(&config)
        .env("DATABASE_URL", &db.url)
        .env_remove("HOOK_PASSWORD")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        format!(
            "error: invalid setting config: {}: destinations.hook.url: environment variable \
             HOOK_PASSWORD is not set\n",
            config.display()
        )
    );
    db.finish().await;
}

/// Forwards the connections `listener` accepts to 127.0.0.1:`to` until aborted.
fn forward(listener: tokio::net::TcpListener, to: u16) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    })
}

fn port_of(url: &str) -> u16 {
    let config: tokio_postgres::Config = url.parse().unwrap();
    config.get_ports().first().copied().unwrap_or(5432)
}

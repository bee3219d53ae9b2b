//! `outbox-relay console` as an operator's browser meets it, over HTTP against the built
//! binary and seeded databases: every screen answers with its content, a message is found
//! by id in whichever source holds it, a statement timeout shows on the page, and each
//! safety rule holds (the CSP, the admin token for a replay and its audit, the refusal of
//! a cross-site POST, the refusal of a non-loopback address without a token). Each rule's
//! test fails when the rule is taken out of `src/console/security.rs` or the replay handler.

use crate::common;

use std::time::Duration;

use common::{KillOnDrop, TestDb, free_port, text};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_postgres::Client;

pub(crate) const TOKEN: &str = "s3cret-console-token-for-tests";
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' \
     data:; connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; \
     form-action 'self'";

/// An answer: status, headers (lower-case names), body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.0 exchange with the console on `port`.
async fn http(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the console");
    let mut request = format!("{method} {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n");
    for (name, value) in headers {
        request += &format!("{name}: {value}\r\n");
    }
    if method == "POST" {
        request += &format!(
            "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
            body.len()
        );
    }
    request += "\r\n";
    request += body;
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut response))
        .await
        .expect("the console answers within 30 s")
        .unwrap();
    let response = text(&response);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_owned(),
    }
}

async fn get(port: u16, path: &str) -> Answer {
    http(port, "GET", path, &[], "").await
}

/// A console process; killed when the test ends.
pub(crate) struct Console {
    pub(crate) port: u16,
    child: KillOnDrop,
    log: std::path::PathBuf,
}

impl Console {
    /// `outbox-relay console --listen 127.0.0.1:PORT ARGS` on `url`, the admin token in
    /// the environment when given; returns once it answers.
    pub(crate) async fn start(
        db: &TestDb,
        url: &str,
        token: Option<&str>,
        args: &[&str],
    ) -> Console {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let log = db.scratch_dir().join(format!("console-{port}.log"));
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
        command
            .args(["console", "--listen", &listen])
            .args(args)
            .env("DATABASE_URL", url)
            .env_remove("OUTBOX_CONSOLE_TOKEN")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if let Some(token) = token {
            command.env("OUTBOX_CONSOLE_TOKEN", token);
        }
        let mut console = Console {
            port,
            child: KillOnDrop(command.spawn().expect("spawn outbox-relay console")),
            log,
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return console;
            }
            if let Some(status) = console.child.try_wait().unwrap() {
                panic!("the console exited ({status}): {}", console.log_text());
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the console never listened"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(crate) fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Three keyed messages on `orders` (the first leased by `w-lease`), and two dead letters
/// on `bad`; returns (the last orders message, the dead letters).
pub(crate) async fn seed(c: &Client) -> (uuid::Uuid, Vec<uuid::Uuid>) {
    let mut orders = Vec::new();
    for i in 1..=3 {
        let row = c
            .query_one(
                "SELECT outbox.enqueue('orders', jsonb_build_object('order', 42, 'line', $1::int), 'k1')",
                &[&i],
            )
            .await
            .unwrap();
        orders.push(row.get::<_, uuid::Uuid>(0));
    }
    for i in 1..=2 {
        c.query_one(
            "SELECT outbox.enqueue('bad', jsonb_build_object('x', $1::int))",
            &[&i],
        )
        .await
        .unwrap();
    }
    let dead: Vec<uuid::Uuid> = c
        .query(
            "SELECT c.outbox_id FROM outbox.claim_outbox_batch(10, 'w-fail', 30, ARRAY['bad']) AS c, \
                    outbox.complete_outbox_attempt(c.outbox_id, c.lease_token, 'w-fail', 'FAILED', \
                                                   'HTTP 400: refused for good')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(dead.len(), 2);
    c.execute(
        "SELECT 1 FROM outbox.claim_outbox_batch(1, 'w-lease', 300, ARRAY['orders'])",
        &[],
    )
    .await
    .unwrap();
    (orders[2], dead)
}

fn scripts_are_files_only(body: &str) {
    assert_eq!(
        body.matches("<script").count(),
        body.matches("<script src=").count(),
        "an inline script: {body}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_screen_answers_with_its_content_and_the_security_headers() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let (last, dead) = seed(&c).await;
    let console = Console::start(&db, &db.url, None, &[]).await;
    let p = console.port;
    let source = &db.name;
    let (last_id, dead_id) = (last.to_string(), dead[0].to_string());

    let pages = [
        (
            format!("/?source={source}"),
            vec![
                "Overview",
                "orders",
                "Delivered per minute",
                "<svg",
                "w-lease",
            ],
        ),
        (
            format!("/messages?source={source}&topic=orders"),
            vec![&*last_id, "waiting", "leased"],
        ),
        (
            format!("/messages/{last}?source={source}"),
            vec![
                "Key position",
                "2 message(s) of key k1 before it",
                "&quot;line&quot;: 3",
            ],
        ),
        (
            format!("/dead-letters?source={source}"),
            vec![
                "2 dead letter(s) match",
                &*dead_id,
                "HTTP 400: refused for good",
                "type=\"checkbox\" name=\"id\"",
            ],
        ),
        (
            format!("/dead-letters/replay?source={source}&id={}", dead[0]),
            vec![
                "Dry run",
                "would move <strong>1</strong>",
                &*dead_id,
                "read-only",
            ],
        ),
        (
            format!("/sources?source={source}"),
            vec!["ok, schema version", &*db.name],
        ),
        (
            format!("/destinations?source={source}"),
            vec!["Recent errors", "w-fail", "HTTP 400: refused for good"],
        ),
    ];
    for (path, expected) in &pages {
        let a = get(p, path).await;
        assert_eq!(a.status, 200, "{path}: {}", a.body);
        assert_eq!(a.header("content-security-policy"), Some(CSP), "{path}");
        assert_eq!(
            a.header("x-content-type-options"),
            Some("nosniff"),
            "{path}"
        );
        assert_eq!(a.header("x-frame-options"), Some("DENY"), "{path}");
        scripts_are_files_only(&a.body);
        for e in expected {
            assert!(a.body.contains(e), "{path} lacks {e:?}: {}", a.body);
        }
    }
    // The dead-lettered message's own page: where it is and its attempt timeline.
    let a = get(p, &format!("/messages/{}?source={source}", dead[1])).await;
    assert!(
        a.body.contains("Dead letter") && a.body.contains("FAILED") && a.body.contains("w-fail"),
        "{}",
        a.body
    );
    // The assets the pages name are served, with their types.
    let js = get(p, "/assets/console.js").await;
    assert_eq!(
        (js.status, js.header("content-type")),
        (200, Some("text/javascript; charset=utf-8"))
    );
    assert!(js.body.contains("X-Console-Refresh"));
    let css = get(p, "/assets/console.css").await;
    assert_eq!(
        (css.status, css.header("content-type")),
        (200, Some("text/css; charset=utf-8"))
    );
    // Bad input is named; an unknown source lists the known ones.
    let bad = get(p, &format!("/messages?source={source}&state=gone")).await;
    assert_eq!(bad.status, 400);
    assert!(
        bad.body
            .contains("none of ready, leased, waiting, scheduled"),
        "{}",
        bad.body
    );
    let unknown = get(p, "/?source=nowhere").await;
    assert_eq!(unknown.status, 404);
    assert!(unknown.body.contains(&db.name), "{}", unknown.body);
    // Keyset pagination: one row per page, the next page's link carries the cursor.
    drop(console);
    let console = Console::start(&db, &db.url, None, &["--page-size", "1"]).await;
    let first = get(
        console.port,
        &format!("/messages?source={source}&topic=orders"),
    )
    .await;
    assert!(first.body.contains(&last.to_string()), "{}", first.body);
    let next = first
        .body
        .split("rel=\"next\" href=\"")
        .nth(1)
        .expect("a next link")
        .split('"')
        .next()
        .unwrap()
        .replace("&amp;", "&");
    assert!(next.contains(&format!("before={last}")), "{next}");
    let second = get(console.port, &next).await;
    assert_eq!(second.status, 200);
    assert!(
        !second.body.contains(&format!(">{last}<")),
        "{}",
        second.body
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_message_is_found_by_id_in_whichever_source_holds_it() {
    let east = TestDb::new().await;
    let west = TestDb::new().await;
    let (in_west, _) = seed(&west.client().await).await;
    let config = east.scratch_dir().join("sources.toml");
    std::fs::write(
        &config,
        format!(
            "[sources.east]\ndatabase_url = \"{}\"\n[sources.west]\ndatabase_url = \"{}\"\n",
            east.url, west.url
        ),
    )
    .unwrap();
    let console = Console::start(
        &east,
        &east.url,
        None,
        &["--config", config.to_str().unwrap()],
    )
    .await;
    let a = get(console.port, &format!("/find?source=east&id={in_west}")).await;
    assert_eq!(a.status, 303, "{}", a.body);
    assert_eq!(
        a.header("location"),
        Some(&*format!("/messages/{in_west}?source=west"))
    );
    let page = get(console.port, &format!("/messages/{in_west}?source=west")).await;
    assert!(
        page.body.contains("Pending") && page.body.contains("orders"),
        "{}",
        page.body
    );
    // One overview serves both sources; an id held nowhere is a 404 that says so.
    let overview = get(console.port, "/").await;
    assert!(
        overview
            .body
            .contains("Source <a href=\"/messages?source=east\">east</a>"),
        "{}",
        overview.body
    );
    assert!(
        overview
            .body
            .contains("Source <a href=\"/messages?source=west\">west</a>")
    );
    let nowhere = get(
        console.port,
        &format!("/find?source=east&id={}", uuid::Uuid::now_v7()),
    )
    .await;
    assert_eq!(nowhere.status, 404);
    assert!(
        nowhere.body.contains("No source holds message"),
        "{}",
        nowhere.body
    );
}

/// The sources of a many-source fleet are found again while the console runs: a database
/// of the server created after the console started shows on its Sources page.
#[tokio::test(flavor = "multi_thread")]
async fn a_source_created_after_the_start_is_found_again() {
    let first = TestDb::new().await;
    let server = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let config = first.scratch_dir().join("server.toml");
    std::fs::write(
        &config,
        format!("sources_server_url = \"{server}\"\nsources_discover_interval_secs = 1\n"),
    )
    .unwrap();
    let console = Console::start(
        &first,
        &first.url,
        None,
        &["--config", config.to_str().unwrap()],
    )
    .await;
    let page = get(console.port, "/sources").await;
    assert!(page.body.contains(&first.name), "{}", page.body);
    let later = TestDb::new().await;
    assert!(
        !page.body.contains(&later.name),
        "created after the page: {}",
        page.body
    );
    common::eventually(
        Duration::from_secs(30),
        "the console finds the new database",
        || async {
            get(console.port, "/sources")
                .await
                .body
                .contains(&later.name)
        },
    )
    .await;
}

/// The replay form's body for `id`, with `token`.
fn replay_form(source: &str, id: uuid::Uuid, token: &str) -> String {
    format!("source={source}&id={id}&actor=Ann+Operator&reason=schema+fixed&token={token}")
}

async fn dead_letter_count(c: &Client) -> i64 {
    common::count(c, "SELECT count(*) FROM outbox.dead_letters").await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replay_needs_the_token_from_the_same_origin_and_is_audited() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let (_, dead) = seed(&c).await;
    let source = &db.name;
    let same_origin = [("Sec-Fetch-Site", "same-origin")];

    // No token configured: read-only, whatever is presented.
    let read_only = Console::start(&db, &db.url, None, &[]).await;
    let a = http(
        read_only.port,
        "POST",
        "/dead-letters/replay",
        &same_origin,
        &replay_form(source, dead[0], TOKEN),
    )
    .await;
    assert_eq!(a.status, 403, "{}", a.body);
    assert!(a.body.contains("read-only"), "{}", a.body);
    drop(read_only);
    // --read-only wins over a token.
    let explicit = Console::start(&db, &db.url, Some(TOKEN), &["--read-only"]).await;
    let a = http(
        explicit.port,
        "POST",
        "/dead-letters/replay",
        &same_origin,
        &replay_form(source, dead[0], TOKEN),
    )
    .await;
    assert_eq!(a.status, 403, "{}", a.body);
    drop(explicit);

    let console = Console::start(&db, &db.url, Some(TOKEN), &[]).await;
    let p = console.port;
    // A wrong or missing token.
    let a = http(
        p,
        "POST",
        "/dead-letters/replay",
        &same_origin,
        &replay_form(source, dead[0], "not-the-token-at-all"),
    )
    .await;
    assert_eq!(a.status, 403, "{}", a.body);
    let a = http(
        p,
        "POST",
        "/dead-letters/replay",
        &same_origin,
        &format!("source={source}&id={}&actor=x", dead[0]),
    )
    .await;
    assert_eq!(a.status, 403, "{}", a.body);
    // The right token from another site: refused before the handler.
    for headers in [
        vec![("Sec-Fetch-Site", "cross-site")],
        vec![("Sec-Fetch-Site", "same-site")],
        vec![("Origin", "http://evil.example")],
        vec![],
    ] {
        let a = http(
            p,
            "POST",
            "/dead-letters/replay",
            &headers,
            &replay_form(source, dead[0], TOKEN),
        )
        .await;
        assert_eq!(a.status, 403, "{headers:?}: {}", a.body);
        assert!(
            a.body.contains("must come from the console's own pages"),
            "{}",
            a.body
        );
        assert_eq!(a.header("content-security-policy"), Some(CSP));
    }
    assert_eq!(dead_letter_count(&c).await, 2, "nothing was replayed");
    assert_eq!(
        common::count(&c, "SELECT count(*) FROM outbox.replay_log").await,
        0
    );

    // The right token from the console's own page (or a matching Origin): replayed, audited.
    let a = http(
        p,
        "POST",
        "/dead-letters/replay",
        &same_origin,
        &replay_form(source, dead[0], TOKEN),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body.contains("Replayed 1 dead letter(s)"), "{}", a.body);
    let origin = format!("http://127.0.0.1:{p}");
    let a = http(
        p,
        "POST",
        "/dead-letters/replay",
        &[("Origin", &origin)],
        &replay_form(source, dead[1], TOKEN),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(dead_letter_count(&c).await, 0);
    let back: i64 = common::count(
        &c,
        &format!(
            "SELECT count(*) FROM outbox.messages WHERE outbox_id IN ('{}', '{}')",
            dead[0], dead[1]
        ),
    )
    .await;
    assert_eq!(back, 2);
    let audit: Vec<(String, i64)> = c
        .query(
            "SELECT reason, replayed FROM outbox.replay_log ORDER BY replay_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        audit,
        vec![
            ("console, by Ann Operator: schema fixed".to_owned(), 1),
            ("console, by Ann Operator: schema fixed".to_owned(), 1)
        ]
    );
    let log = console.log_text();
    assert!(
        log.contains("console replayed dead letters") && log.contains("Ann Operator"),
        "{log}"
    );
    assert!(
        !log.contains(TOKEN),
        "the token never reaches the log: {log}"
    );
}

/// A console on a loopback address answers only for loopback host names: a page whose own
/// name was made to resolve to 127.0.0.1 (DNS rebinding) is not the console's origin.
#[tokio::test(flavor = "multi_thread")]
async fn a_loopback_console_answers_only_for_loopback_host_names() {
    let db = TestDb::new().await;
    let console = Console::start(&db, &db.url, None, &[]).await;
    let status = |host: String| async move {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", console.port))
            .await
            .expect("connect to the console");
        let request = format!("GET / HTTP/1.0\r\nHost: {host}\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut response))
            .await
            .expect("the console answers within 30 s")
            .unwrap();
        text(&response)
            .lines()
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u16>().ok())
            .expect("a status line")
    };
    let port = console.port;
    assert_eq!(status(format!("evil.example:{port}")).await, 421);
    assert_eq!(status(format!("127.0.0.1.nip.io:{port}")).await, 421);
    assert_eq!(status(format!("localhost:{port}")).await, 200);
    assert_eq!(status(format!("127.0.0.1:{port}")).await, 200);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_non_loopback_address_without_a_token_is_refused_unless_read_only() {
    let db = TestDb::new().await;
    let port = free_port();
    let listen = format!("0.0.0.0:{port}");
    let out = common::verb_env(
        &["console", "--listen", &listen],
        &db.url,
        &[("OUTBOX_CONSOLE_TOKEN", "")],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("invalid setting --listen") && err.contains("--read-only"),
        "{err}"
    );
    // A short token is refused, naming the rule.
    let out = common::verb_env(&["console"], &db.url, &[("OUTBOX_CONSOLE_TOKEN", "short")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("at least 16 characters"),
        "{}",
        text(&out.stderr)
    );
    // Read-only said explicitly: it serves.
    let mut child = KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
            .args(["console", "--read-only", "--listen", &listen])
            .env("DATABASE_URL", &db.url)
            .env_remove("OUTBOX_CONSOLE_TOKEN")
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    common::eventually(
        Duration::from_secs(60),
        "the read-only console answers",
        || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        },
    )
    .await;
    let a = get(port, "/").await;
    assert_eq!(a.status, 200);
    assert!(a.body.contains("read-only"));
    assert!(child.try_wait().unwrap().is_none());
}

/// The console's pools stay within the fleet's `max_connections_per_server`: a console
/// whose pools could hold more connections to the server than the cap is refused, naming
/// what fits; within it, it serves.
#[tokio::test(flavor = "multi_thread")]
async fn the_consoles_pools_stay_within_the_fleets_connection_cap() {
    let db = TestDb::new().await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let out = common::verb_env(
        &[
            "console",
            "--connections-per-source",
            "4",
            "--listen",
            &listen,
        ],
        &db.url,
        &[("OUTBOX_MAX_CONNECTIONS_PER_SERVER", "3")],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("max_connections_per_server of 3")
            && err.contains("--connections-per-source 3 or less"),
        "{err}"
    );
    let mut child = KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
            .args([
                "console",
                "--connections-per-source",
                "3",
                "--listen",
                &listen,
            ])
            .env("DATABASE_URL", &db.url)
            .env("OUTBOX_MAX_CONNECTIONS_PER_SERVER", "3")
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    common::eventually(
        Duration::from_secs(60),
        "the console within the cap answers",
        || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        },
    )
    .await;
    assert_eq!(get(port, "/").await.status, 200);
    assert!(child.try_wait().unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_statement_timeout_shows_on_the_page_and_the_rest_still_renders() {
    let db = TestDb::new().await;
    let mut c = db.client().await;
    seed(&c).await;
    let console = Console::start(&db, &db.url, None, &["--statement-timeout", "300ms"]).await;
    // Another session holds the dead letters: every read of them waits for the lock.
    let tx = c.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE outbox.dead_letters IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let a = get(console.port, &format!("/dead-letters?source={}", db.name)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(
        a.body.contains(
            "cancelled: the query ran longer than the console&#39;s statement timeout (300 ms)"
        ),
        "{}",
        a.body
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    // The messages page does not read the dead letters: it renders.
    let m = get(console.port, &format!("/messages?source={}", db.name)).await;
    assert!(
        m.body.contains("orders") && !m.body.contains("cancelled"),
        "{}",
        m.body
    );
    tx.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn sensitive_payloads_stay_hidden_and_the_base_path_prefixes_everything() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let (last, _) = seed(&c).await;
    let console = Console::start(
        &db,
        &db.url,
        None,
        &["--sensitive-payloads", "--base-path", "/ops/console"],
    )
    .await;
    let a = get(
        console.port,
        &format!("/ops/console/messages/{last}?source={}", db.name),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body.contains("Payload hidden"), "{}", a.body);
    assert!(!a.body.contains("&quot;line&quot;"), "{}", a.body);
    assert!(a.body.contains("href=\"/ops/console/assets/console.css\""));
    assert!(a.body.contains("href=\"/ops/console/dead-letters?source="));
    assert_eq!(
        get(console.port, "/ops/console/assets/console.js")
            .await
            .status,
        200
    );
    assert_eq!(get(console.port, "/").await.status, 404);
    let bare = get(console.port, "/ops/console").await;
    assert_eq!(
        (bare.status, bare.header("location")),
        (308, Some("/ops/console/"))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn no_page_renders_a_password_or_a_connection_string() {
    let db = TestDb::new().await;
    seed(&db.client().await).await;
    let login = db.login("console_pw", Some("outbox_reader")).await;
    let user = login
        .split("://")
        .nth(1)
        .unwrap()
        .split('@')
        .next()
        .unwrap()
        .to_owned();
    db.client()
        .await
        .batch_execute(&format!(
            "ALTER ROLE {user} PASSWORD 'Pa55word-never-shown'"
        ))
        .await
        .unwrap();
    let url = login.replacen(
        &format!("{user}@"),
        &format!("{user}:Pa55word-never-shown@"),
        1,
    );
    let console = Console::start(&db, &url, None, &[]).await;
    for path in [
        "/",
        "/sources",
        "/messages",
        "/dead-letters",
        "/destinations",
    ] {
        let a = get(console.port, path).await;
        assert!(
            !a.body.contains("Pa55word-never-shown"),
            "{path}: {}",
            a.body
        );
        assert!(!a.body.contains("postgres://"), "{path}: {}", a.body);
    }
    // outbox_reader alone reads the overview and the message lists.
    let overview = get(console.port, "/").await;
    assert!(overview.body.contains("orders"), "{}", overview.body);
    let messages = get(console.port, "/messages").await;
    assert!(messages.body.contains("orders"), "{}", messages.body);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_login_with_outbox_reader_sees_every_screen_and_replays_with_the_two_replay_functions() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let (last, dead) = seed(&c).await;
    let reader = db.login("console_reader", Some("outbox_reader")).await;
    let source = &db.name;
    let same_origin = [("Sec-Fetch-Site", "same-origin")];
    let console = Console::start(&db, &reader, Some(TOKEN), &[]).await;
    let p = console.port;
    let (last_id, dead_id) = (last.to_string(), dead[0].to_string());
    let pages = [
        (format!("/?source={source}"), vec!["orders", "w-lease"]),
        (
            format!("/messages?source={source}&topic=orders&state=waiting"),
            vec![&*last_id, "waiting"],
        ),
        (
            format!("/messages?source={source}&key=k1"),
            vec![&*last_id, "leased"],
        ),
        (
            format!("/messages/{last}?source={source}"),
            vec!["2 message(s) of key k1 before it", "&quot;line&quot;: 3"],
        ),
        (
            format!("/messages/{dead_id}?source={source}"),
            vec!["Dead letter", "HTTP 400: refused for good", "&quot;x&quot;"],
        ),
        (
            format!("/dead-letters?source={source}&topic=bad"),
            vec!["2 dead letter(s) match", &*dead_id],
        ),
        (
            format!("/dead-letters/replay?source={source}&id={dead_id}"),
            vec!["Dry run", "would move <strong>1</strong>"],
        ),
        ("/sources".to_owned(), vec![source.as_str()]),
        (
            format!("/destinations?source={source}"),
            vec!["Destinations"],
        ),
    ];
    for (path, wanted) in &pages {
        let a = get(p, path).await;
        assert_eq!(a.status, 200, "{path}: {}", a.body);
        assert!(
            !a.body.contains("may not read") && !a.body.contains("permission denied"),
            "{path}: a read refused to outbox_reader: {}",
            a.body
        );
        for w in wanted {
            assert!(a.body.contains(w), "{path}: no {w:?} in {}", a.body);
        }
    }

    // Find by id leads to the message's page in the source holding it.
    let found = get(p, &format!("/find?id={dead_id}")).await;
    assert_eq!(found.status, 303, "{}", found.body);
    assert!(
        found
            .header("location")
            .is_some_and(|l| l.contains(&format!("/messages/{dead_id}"))),
        "{:?}",
        found.header("location")
    );

    // outbox_reader has no right to replay: the page says so and nothing moves.
    let a = http(
        p,
        "POST",
        "/dead-letters/replay",
        &same_origin,
        &replay_form(source, dead[0], TOKEN),
    )
    .await;
    assert!(!a.body.contains("Replayed 1"), "{}", a.body);
    assert_eq!(dead_letter_count(&c).await, 2);

    // EXECUTE on start_replay and replay_step is all a replay needs beyond outbox_reader.
    let user = reader
        .split("://")
        .nth(1)
        .unwrap()
        .split('@')
        .next()
        .unwrap();
    c.batch_execute(&format!(
        "GRANT EXECUTE ON FUNCTION outbox.start_replay(uuid[], text, timestamptz, text, text), \
                                   outbox.replay_step(bigint, integer) TO {user}"
    ))
    .await
    .unwrap();
    let a = http(
        p,
        "POST",
        "/dead-letters/replay",
        &same_origin,
        &replay_form(source, dead[0], TOKEN),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body.contains("Replayed 1 dead letter(s)"), "{}", a.body);
    assert_eq!(dead_letter_count(&c).await, 1);
    let replayed_by: String = c
        .query_one("SELECT replayed_by FROM outbox.replay_log", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(replayed_by, user);
    drop(console);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn run_serves_the_console_beside_the_relay_when_console_addr_is_set() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let (_, dead) = seed(&c).await;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let relayer = common::Relayer::start(
        &db,
        "w-console",
        &["--no-telemetry", "--console-addr", &addr, "--sink", "null"],
    );
    common::eventually(Duration::from_secs(60), "run's console answers", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    let a = get(port, &format!("/dead-letters?source={}", db.name)).await;
    assert_eq!(a.status, 200, "{}\n{}", a.body, relayer.log_text());
    assert_eq!(a.header("content-security-policy"), Some(CSP));
    assert!(
        a.body.contains(&dead[0].to_string()) && a.body.contains("read-only"),
        "{}",
        a.body
    );
    // The relay runs beside it: a new message is delivered (the seeded key stays leased).
    let fresh: uuid::Uuid = c
        .query_one("SELECT outbox.enqueue('fresh', '{}'::jsonb)", &[])
        .await
        .unwrap()
        .get(0);
    common::eventually(Duration::from_secs(60), "the relay delivers", || async {
        common::count(
            &c,
            &format!("SELECT count(*) FROM outbox.messages WHERE outbox_id = '{fresh}'"),
        )
        .await
            == 0
    })
    .await;
}

/// `run --console-addr` takes the console's own variables, as `outbox-relay console` does:
/// its base path and its sensitive payloads here.
#[tokio::test(flavor = "multi_thread")]
async fn runs_console_takes_the_consoles_variables() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let (last, _) = seed(&c).await;
    let port = free_port();
    let _child = KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
            .args([
                "run",
                "--worker-id",
                "w-env",
                "--no-telemetry",
                "--sink",
                "null",
            ])
            .args(["--topics", "nothing-of-the-seed"])
            .args(["--console-addr", &format!("127.0.0.1:{port}")])
            .env("DATABASE_URL", &db.url)
            .env("OUTBOX_CONSOLE_BASE_PATH", "/ops")
            .env("OUTBOX_CONSOLE_SENSITIVE_PAYLOADS", "true")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn outbox-relay"),
    );
    common::eventually(Duration::from_secs(60), "run's console answers", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    let a = get(port, &format!("/ops/messages/{last}?source={}", db.name)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body.contains("Payload hidden"), "{}", a.body);
    assert_eq!(
        get(port, "/messages").await.status,
        404,
        "served under /ops only"
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_overview_is_rendered_at_most_once_per_ten_seconds() {
    let db = TestDb::new().await;
    let c = db.client().await;
    seed(&c).await;
    let console = Console::start(&db, &db.url, None, &[]).await;
    let path = format!("/?source={}", db.name);
    let first = get(console.port, &path).await;
    assert!(
        first.body.contains("w-lease") && !first.body.contains("w-late"),
        "{}",
        first.body
    );
    c.execute(
        "SELECT 1 FROM outbox.claim_outbox_batch(10, 'w-late', 300, ARRAY['orders'])",
        &[],
    )
    .await
    .unwrap();
    c.query_one("SELECT outbox.enqueue('late', '{}'::jsonb)", &[])
        .await
        .unwrap();
    c.execute(
        "SELECT 1 FROM outbox.claim_outbox_batch(10, 'w-late', 300, ARRAY['late'])",
        &[],
    )
    .await
    .unwrap();
    // Within the 10 s, the section rendered first is served again, as it says.
    let again = get(console.port, &path).await;
    assert_eq!(
        again.body.split("<div id=\"live\">").nth(1),
        first.body.split("<div id=\"live\">").nth(1)
    );
    assert!(
        again.body.contains("shown again for up to 10 s"),
        "{}",
        again.body
    );
    // After them, a new rendering shows the new lease holder, once the observation it
    // reads is refreshed (older than 15 s: in the background, shown by the next render).
    let started = std::time::Instant::now();
    common::eventually(
        Duration::from_secs(60),
        "the overview renders anew",
        || async { get(console.port, &path).await.body.contains("w-late") },
    )
    .await;
    assert!(
        started.elapsed() > Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

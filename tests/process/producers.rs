//! The producer snippets of the README (`examples/producers/`), each run with its own
//! language against a fresh database: psql, Python (psycopg), Node (pg), Go (pgx). Each
//! must enqueue the order message inside its transaction and print its outbox_id, directly
//! and through PgBouncer in transaction mode (tests/common/pgbouncer.rs); the trace context
//! snippets (Python, Node, Go) must store their span's traceparent with the message, the
//! same two ways; the
//! README must show each file as it is. A toolchain or driver that is missing fails its
//! test, naming what is missing and what installs it: `make test` (scripts/test-services.sh)
//! installs psycopg and the OpenTelemetry SDK into the virtual environment `target/venv`, pg into
//! `target/node_modules`, and Go and pgx v4 from Debian's packages (golang-go and
//! golang-github-jackc-pgx-v4-dev); the Go test builds in GOPATH mode against those
//! sources, fetching nothing (the Go module proxy is not reachable from every machine), with
//! its build cache in `target/go`.

use crate::common;

use std::path::Path;
use std::process::Command;

use common::TestDb;
use common::pgbouncer::PgBouncer;
use uuid::Uuid;

const SNIPPETS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/producers");

/// The target directory (`CARGO_TARGET_DIR`), where scripts/test-services.sh puts the
/// drivers.
fn target_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Panics naming a missing `program` and what installs it, unless it is on the PATH.
fn require(program: &str, installed_by: &str) {
    assert!(
        on_path(program),
        "{program} is not on this machine: {installed_by} (`make test` does it)"
    );
}

fn on_path(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Runs `command` with DATABASE_URL = `url` and returns the outbox_id it printed.
fn printed_id(url: &str, command: &mut Command) -> Uuid {
    let out = command.env("DATABASE_URL", url).output().unwrap();
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{command:?} printed {text:?}: {e}"))
}

/// Runs the snippet `command` makes twice: directly, then through PgBouncer in transaction
/// mode (Debian's 1.18, without named statements); checks what each enqueued.
async fn enqueues_directly_and_through_a_pooler(db: &TestDb, mut command: impl FnMut() -> Command) {
    let bouncer = PgBouncer::start(&db.scratch_dir(), "transaction").await;
    for url in [db.url.clone(), bouncer.url(db)] {
        let id = printed_id(&url, &mut command());
        check_enqueued(db, id).await;
    }
}

async fn check_enqueued(db: &TestDb, id: Uuid) {
    let c = db.client().await;
    let row = c
        .query_one(
            "SELECT topic, message_key, headers, convert_from(payload, 'UTF8')::jsonb \
             FROM outbox.messages WHERE outbox_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "orders.placed");
    assert_eq!(row.get::<_, Option<String>>(1).as_deref(), Some("order-42"));
    assert_eq!(
        row.get::<_, serde_json::Value>(2),
        serde_json::json!({"x-tenant": "acme"})
    );
    assert_eq!(
        row.get::<_, serde_json::Value>(3),
        serde_json::json!({"order_id": 42})
    );
}

fn snippet(file: &str) -> String {
    Path::new(SNIPPETS).join(file).display().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn psql() {
    let db = TestDb::new().await;
    enqueues_directly_and_through_a_pooler(&db, || {
        let mut command = Command::new("sh");
        command.args([
            "-c",
            "psql \"$DATABASE_URL\" -Atq -v ON_ERROR_STOP=1 -f \"$0\"",
            &snippet("enqueue.sql"),
        ]);
        command
    })
    .await;
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn python_psycopg() {
    let python = target_dir().join("venv/bin/python");
    assert!(
        python.exists(),
        "no Python virtual environment with psycopg at {}: python3 -m venv {0}; {0}/bin/pip \
         install 'psycopg[binary]' (`make test` does it)",
        target_dir().join("venv").display()
    );
    let db = TestDb::new().await;
    enqueues_directly_and_through_a_pooler(&db, || {
        let mut command = Command::new(&python);
        command.arg(snippet("enqueue.py"));
        command
    })
    .await;
    db.finish().await;
}

/// Runs a trace context snippet that `command` makes, directly and through PgBouncer in
/// transaction mode: it prints the outbox_id and its span's traceparent, and the message an
/// unchanged enqueue call made in that transaction carries that traceparent (the SDKs'
/// own tracestate is empty: none is stored).
async fn carries_the_span_context(db: &TestDb, mut command: impl FnMut() -> Command) {
    let bouncer = PgBouncer::start(&db.scratch_dir(), "transaction").await;
    let c = db.client().await;
    for url in [db.url.clone(), bouncer.url(db)] {
        let mut command = command();
        let out = command.env("DATABASE_URL", &url).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{command:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (id, traceparent) = text
            .trim()
            .split_once(' ')
            .unwrap_or_else(|| panic!("{command:?} printed {text:?}"));
        let sampled = traceparent.len() == 55
            && u8::from_str_radix(&traceparent[53..], 16).is_ok_and(|flags| flags & 1 == 1);
        assert!(
            traceparent.starts_with("00-") && sampled,
            "a sampled span's traceparent: {traceparent}"
        );
        let headers: serde_json::Value = c
            .query_one(
                "SELECT headers FROM outbox.messages WHERE outbox_id = $1::text::uuid",
                &[&id],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(headers, serde_json::json!({"traceparent": traceparent}));
    }
    drop(bouncer);
}

/// The README's Python trace context snippet, with a span of the OpenTelemetry Python SDK.
#[tokio::test(flavor = "multi_thread")]
async fn python_trace_context() {
    let python = target_dir().join("venv/bin/python");
    let ready = Command::new(&python)
        .args(["-c", "import psycopg, opentelemetry.sdk.trace"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ready,
        "no Python virtual environment with psycopg and the OpenTelemetry SDK at {}: \
         python3 -m venv {0}; {0}/bin/pip install 'psycopg[binary]' opentelemetry-sdk \
         (`make test` does it)",
        target_dir().join("venv").display()
    );
    let db = TestDb::new().await;
    carries_the_span_context(&db, || {
        let mut command = Command::new(&python);
        command.arg(snippet("trace.py"));
        command
    })
    .await;
    db.finish().await;
}

/// The README's Node trace context snippet, with a span of the OpenTelemetry JS SDK.
#[tokio::test(flavor = "multi_thread")]
async fn node_trace_context() {
    require("node", "apt-get install nodejs npm");
    let modules = target_dir().join("node_modules");
    for module in [
        "pg",
        "@opentelemetry/api",
        "@opentelemetry/context-async-hooks",
        "@opentelemetry/core",
        "@opentelemetry/sdk-trace-base",
    ] {
        assert!(
            modules.join(module).exists(),
            "the {module} module under {}: npm install --prefix {} pg @opentelemetry/api \
             @opentelemetry/context-async-hooks @opentelemetry/core @opentelemetry/sdk-trace-base \
             (`make test` does it)",
            modules.display(),
            target_dir().display()
        );
    }
    let db = TestDb::new().await;
    carries_the_span_context(&db, || {
        let mut command = Command::new("node");
        command.env("NODE_PATH", &modules).arg(snippet("trace.js"));
        command
    })
    .await;
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn node_pg() {
    require("node", "apt-get install nodejs npm");
    let modules = target_dir().join("node_modules");
    assert!(
        modules.join("pg").exists(),
        "the pg module under {}: npm install --prefix {} pg (`make test` does it)",
        modules.display(),
        target_dir().display()
    );
    let db = TestDb::new().await;
    enqueues_directly_and_through_a_pooler(&db, || {
        let mut command = Command::new("node");
        command
            .env("NODE_PATH", &modules)
            .arg(snippet("enqueue.js"));
        command
    })
    .await;
    db.finish().await;
}

/// Where Debian's Go packages put their sources (GOPATH layout), as one GOPATH list:
/// unpacked under the target directory by scripts/test-services.sh where installing them
/// would have upgraded an installed package, and installed. One package may be in each
/// (pgx unpacked, OpenTelemetry installed), so both are searched.
fn debian_gopath() -> Vec<std::path::PathBuf> {
    let dirs: Vec<std::path::PathBuf> = [
        target_dir().join("debs/root/usr/share/gocode"),
        Path::new("/usr/share/gocode").to_path_buf(),
    ]
    .into_iter()
    .filter(|d| d.is_dir())
    .collect();
    if dirs.is_empty() {
        vec![Path::new("/usr/share/gocode").to_path_buf()]
    } else {
        dirs
    }
}

/// Whether `sources` (a package's directory in GOPATH layout) is under [`debian_gopath`].
fn has_go_sources(sources: &str) -> bool {
    debian_gopath().iter().any(|d| d.join(sources).is_dir())
}

/// [`debian_gopath`] as the message of a failed check shows it.
fn gopath_shown() -> String {
    std::env::join_paths(debian_gopath())
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// pgx v4's sources under a GOPATH.
const PGX: &str = "src/github.com/jackc/pgx/v4";

/// `go` in GOPATH mode against Debian's packaged sources, fetching nothing; its build cache
/// under the target directory.
fn go(dir: &Path) -> Command {
    let mut command = Command::new("go");
    command
        .current_dir(dir)
        .env("GO111MODULE", "off")
        .env("GOPATH", std::env::join_paths(debian_gopath()).unwrap())
        .env("GOPROXY", "off")
        .env("GOCACHE", target_dir().join("go").join("cache"));
    command
}

#[tokio::test(flavor = "multi_thread")]
async fn go_pgx() {
    require("go", "apt-get install golang-go");
    assert!(
        has_go_sources(PGX),
        "pgx v4 under {}: apt-get install golang-github-jackc-pgx-v4-dev (`make test` does it, \
         or unpacks it under the target directory)",
        gopath_shown()
    );
    // Built before the database exists, so that a build that fails keeps none.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("go-pgx-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(snippet("enqueue.go"), dir.join("main.go")).unwrap();
    let build = go(&dir)
        .args(["build", "-o", "enqueue", "main.go"])
        .output()
        .unwrap();
    assert!(
        build.status.success(),
        "go build of examples/producers/enqueue.go: {}",
        String::from_utf8_lossy(&build.stderr)
    );
    let db = TestDb::new().await;
    enqueues_directly_and_through_a_pooler(&db, || Command::new(dir.join("enqueue"))).await;
    db.finish().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// OpenTelemetry Go's sources under a GOPATH (Debian's golang-opentelemetry-otel-dev).
const OTEL_GO: &str = "src/go.opentelemetry.io/otel/sdk/trace";

/// The README's Go trace context snippet, with a span of the OpenTelemetry Go SDK.
#[tokio::test(flavor = "multi_thread")]
async fn go_trace_context() {
    require("go", "apt-get install golang-go");
    for (sources, package) in [
        (PGX, "golang-github-jackc-pgx-v4-dev"),
        (OTEL_GO, "golang-opentelemetry-otel-dev"),
    ] {
        assert!(
            has_go_sources(sources),
            "{sources} under {}: apt-get install {package} (`make test` does it, or unpacks it \
             under the target directory)",
            gopath_shown()
        );
    }
    // Built before the database exists, so that a build that fails keeps none.
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("go-trace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(snippet("trace.go"), dir.join("main.go")).unwrap();
    let build = go(&dir)
        .args(["build", "-o", "trace", "main.go"])
        .output()
        .unwrap();
    assert!(
        build.status.success(),
        "go build of examples/producers/trace.go: {}",
        String::from_utf8_lossy(&build.stderr)
    );
    let db = TestDb::new().await;
    carries_the_span_context(&db, || Command::new(dir.join("trace"))).await;
    db.finish().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_readme_shows_each_snippet_as_it_is() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    for file in [
        "enqueue.sql",
        "enqueue.py",
        "enqueue.js",
        "enqueue.go",
        "trace.py",
        "trace.js",
        "trace.go",
    ] {
        let text = std::fs::read_to_string(snippet(file)).unwrap();
        assert!(
            readme.contains(&text),
            "README.md shows examples/producers/{file} word for word"
        );
    }
}

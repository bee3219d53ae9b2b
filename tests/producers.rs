//! The producer snippets of the README (`examples/producers/`), each run with its own
//! language against a fresh database: psql, Python (psycopg), Node (pg), Go (pgx). Each
//! must enqueue the order message inside its transaction and print its outbox_id; the
//! README must show each file as it is. A toolchain or driver that is missing fails its
//! test, naming what is missing and what installs it: `make test` (scripts/test-services.sh)
//! installs Go with apt-get, psycopg into the virtual environment `target/venv` and pg into
//! `target/node_modules`; the Go test fetches pgx (the newest release the machine's Go can
//! build) from the module proxy the environment names (`GOPROXY`, by default
//! proxy.golang.org) into `target/go`, its own module cache, so nothing goes to the
//! machine's.

mod common;

use std::path::Path;
use std::process::Command;

use common::TestDb;
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

/// Runs `command` with DATABASE_URL set and returns the outbox_id it printed.
fn printed_id(db: &TestDb, command: &mut Command) -> Uuid {
    let out = command.env("DATABASE_URL", &db.url).output().unwrap();
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
    let id = printed_id(
        &db,
        Command::new("sh").args([
            "-c",
            "psql \"$DATABASE_URL\" -Atq -v ON_ERROR_STOP=1 -f \"$0\"",
            &snippet("enqueue.sql"),
        ]),
    );
    check_enqueued(&db, id).await;
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
    let id = printed_id(&db, Command::new(python).arg(snippet("enqueue.py")));
    check_enqueued(&db, id).await;
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
    let id = printed_id(
        &db,
        Command::new("node")
            .env("NODE_PATH", &modules)
            .arg(snippet("enqueue.js")),
    );
    check_enqueued(&db, id).await;
    db.finish().await;
}

/// Go's module cache and build cache under the target directory; the module proxy is the
/// environment's (`GOPROXY`).
fn go(dir: &Path) -> Command {
    let cache = target_dir().join("go");
    let mut command = Command::new("go");
    command
        .current_dir(dir)
        .env("GOPATH", &cache)
        .env("GOMODCACHE", cache.join("mod"))
        .env("GOCACHE", cache.join("cache"))
        // Writable, so that removing the target directory removes it.
        .env("GOFLAGS", "-modcacherw");
    command
}

#[tokio::test(flavor = "multi_thread")]
async fn go_pgx() {
    require("go", "apt-get install golang-go");
    // The module is set up before the database, so that a fetch that fails keeps none.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("go-pgx-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(snippet("enqueue.go"), dir.join("main.go")).unwrap();
    let init = go(&dir)
        .args(["mod", "init", "example.com/enqueue"])
        .output()
        .unwrap();
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );
    // The newest pgx v5 that the Go of the machine can build (Debian 12's is 1.19).
    let get = go(&dir)
        .args([
            "get",
            &format!("github.com/jackc/pgx/v5@{}", pgx_for(go_version())),
        ])
        .output()
        .unwrap();
    assert!(
        get.status.success(),
        "go could not fetch pgx v5 (from the module proxy, GOPROXY={}): {}",
        std::env::var("GOPROXY").unwrap_or_else(|_| "its default, proxy.golang.org".into()),
        String::from_utf8_lossy(&get.stderr)
    );
    let build = go(&dir)
        .args(["build", "-o", "enqueue", "."])
        .output()
        .unwrap();
    assert!(
        build.status.success(),
        "{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let db = TestDb::new().await;
    let id = printed_id(&db, &mut Command::new(dir.join("enqueue")));
    check_enqueued(&db, id).await;
    db.finish().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `go version`'s minor version: 19 for `go version go1.19.8 linux/amd64`.
fn go_version() -> u32 {
    let out = Command::new("go").arg("version").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .nth(2)
        .and_then(|v| v.strip_prefix("go1."))
        .and_then(|v| v.split('.').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("cannot read the Go version from {text:?}"))
}

/// The pgx v5 release to fetch for Go 1.`minor`: the last one whose go.mod that Go accepts.
fn pgx_for(minor: u32) -> &'static str {
    match minor {
        ..=19 => "v5.5.5",
        20 => "v5.6.0",
        21..=22 => "v5.7.4",
        23 => "v5.7.6",
        24 => "v5.8.0",
        _ => "v5",
    }
}

#[test]
fn the_readme_shows_each_snippet_as_it_is() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    for file in ["enqueue.sql", "enqueue.py", "enqueue.js", "enqueue.go"] {
        let text = std::fs::read_to_string(snippet(file)).unwrap();
        assert!(
            readme.contains(&text),
            "README.md shows examples/producers/{file} word for word"
        );
    }
}

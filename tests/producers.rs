//! The producer snippets of the README (`examples/producers/`), each run with its own
//! language against a fresh database: psql, Python (psycopg), Node (pg), Go (pgx). Each
//! must enqueue the order message inside its transaction and print its outbox_id; the
//! README must show each file as it is. A language that is not on this machine is named
//! and skipped; `scripts/test-services.sh` installs the drivers (psycopg from PyPI, pg from
//! npm under target/).

mod common;

use std::path::Path;
use std::process::Command;

use common::TestDb;
use uuid::Uuid;

const SNIPPETS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/producers");

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
    if !on_path("python3") {
        return eprintln!("python3 is not on this machine: skipped");
    }
    let db = TestDb::new().await;
    let id = printed_id(&db, Command::new("python3").arg(snippet("enqueue.py")));
    check_enqueued(&db, id).await;
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn node_pg() {
    if !on_path("node") {
        return eprintln!("node is not on this machine: skipped");
    }
    let modules = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("node_modules");
    assert!(
        modules.join("pg").exists(),
        "the pg module under {} (scripts/test-services.sh installs it)",
        modules.display()
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

#[tokio::test(flavor = "multi_thread")]
async fn go_pgx() {
    if !on_path("go") {
        return eprintln!("go is not on this machine: examples/producers/enqueue.go not run");
    }
    let db = TestDb::new().await;
    let dir = db.scratch_dir().join("go");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(snippet("enqueue.go"), dir.join("main.go")).unwrap();
    let setup = Command::new("sh")
        .current_dir(&dir)
        .args([
            "-c",
            "go mod init example.com/enqueue && go get github.com/jackc/pgx/v5",
        ])
        .output()
        .unwrap();
    assert!(
        setup.status.success(),
        "{}",
        String::from_utf8_lossy(&setup.stderr)
    );
    let id = printed_id(&db, Command::new("go").current_dir(&dir).args(["run", "."]));
    check_enqueued(&db, id).await;
    db.finish().await;
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

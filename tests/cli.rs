//! The operator verbs as processes: `enqueue` from a file or standard input with headers,
//! content type, delay and id; its errors; `completions` and `man`, generated from the same
//! definitions as the parser.

mod common;

use std::io::Write;
use std::process::{Command, Output, Stdio};

use common::TestDb;
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// `outbox-relay ARGS` against `db`, with `stdin` written to its standard input.
fn relay(db: &TestDb, args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .env("DATABASE_URL", &db.url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    // The process may exit before reading all of it (an argument error): not this test's
    // concern, the exit status is.
    let _ = input.write_all(stdin);
    drop(input);
    child.wait_with_output().unwrap()
}

fn printed_id(out: &Output) -> Uuid {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn enqueue_takes_a_payload_larger_than_an_argument_list_from_stdin() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // 2 MiB: far past the 128 KiB a single argument may have.
    let big = serde_json::json!({ "blob": "x".repeat(2 << 20) }).to_string();
    let id = Uuid::now_v7();
    let out = relay(
        &db,
        &[
            "enqueue",
            "--topic",
            "orders",
            "--payload-file",
            "-",
            "--key",
            "order-1",
            "--header",
            "traceparent=00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "--header",
            "x-tenant=a=b",
            "--delay",
            "5m",
            "--id",
            &id.to_string(),
            "--max-attempts",
            "3",
        ],
        big.as_bytes(),
    );
    assert_eq!(printed_id(&out), id);
    let row = c
        .query_one(
            "SELECT topic, message_key, length(payload), content_type, headers, max_attempts, \
             extract(epoch FROM available_at - now())::float8 \
             FROM outbox.messages WHERE outbox_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "orders");
    assert_eq!(row.get::<_, Option<String>>(1).as_deref(), Some("order-1"));
    assert!(row.get::<_, i32>(2) > 2 << 20, "the whole payload");
    assert_eq!(row.get::<_, String>(3), "application/json");
    assert_eq!(
        row.get::<_, serde_json::Value>(4),
        serde_json::json!({
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "x-tenant": "a=b"
        })
    );
    assert_eq!(row.get::<_, i32>(5), 3);
    let delay = row.get::<_, f64>(6);
    assert!(
        (240.0..=300.0).contains(&delay),
        "delayed about 5 min: {delay}"
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn enqueue_stores_other_content_types_as_the_bytes_given() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let bytes: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
    let file = db.scratch_dir().join("payload.bin");
    std::fs::write(&file, &bytes).unwrap();
    let id = printed_id(&relay(
        &db,
        &[
            "enqueue",
            "--topic",
            "blobs",
            "--payload-file",
            file.to_str().unwrap(),
            "--content-type",
            "application/octet-stream",
        ],
        b"",
    ));
    let vnd = printed_id(&relay(
        &db,
        &[
            "enqueue",
            "--topic",
            "blobs",
            "--payload",
            "{\"a\":  1}",
            "--content-type",
            "application/vnd.acme+json; charset=utf-8",
        ],
        b"",
    ));
    let stored = |id: Uuid| {
        let c = &c;
        async move {
            let r = c
                .query_one(
                    "SELECT payload, content_type FROM outbox.messages WHERE outbox_id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            (r.get::<_, Vec<u8>>(0), r.get::<_, String>(1))
        }
    };
    assert_eq!(
        stored(id).await,
        (bytes, "application/octet-stream".to_owned())
    );
    assert_eq!(
        stored(vnd).await,
        (
            b"{\"a\":  1}".to_vec(),
            "application/vnd.acme+json; charset=utf-8".to_owned()
        ),
        "a JSON type other than application/json keeps its bytes and its type"
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn enqueue_refuses_bad_input_naming_it_and_stores_nothing() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let cases: [(&[&str], &[u8], &str); 5] = [
        (
            &["--payload-file", "-"],
            b"{not json",
            "the payload is not valid JSON",
        ),
        (
            &["--payload", "{}", "--header", "no-equals-sign"],
            b"",
            "--header \"no-equals-sign\": expected NAME=VALUE",
        ),
        (&["--payload", "{}", "--delay", "soon"], b"", "--delay"),
        (
            &["--payload-file", "/nonexistent/payload.json"],
            b"",
            "read the payload from /nonexistent/payload.json",
        ),
        (
            &["--payload", "{}", "--payload-file", "-"],
            b"",
            "cannot be used with",
        ),
    ];
    for (args, stdin, expected) in cases {
        let args: Vec<&str> = ["enqueue", "--topic", "t"]
            .iter()
            .chain(args)
            .copied()
            .collect();
        let out = relay(&db, &args, stdin);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} must fail");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    assert_eq!(common::pending(&c).await, 0, "nothing was enqueued");
    db.finish().await;
}

#[test]
fn completions_are_generated_from_the_parser() {
    let script = Command::new(BIN)
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert!(script.status.success());
    let path = std::env::temp_dir().join(format!("outbox-relay-{}.bash", std::process::id()));
    std::fs::write(&path, &script.stdout).unwrap();
    // Loaded into bash, it completes the verbs.
    let probe = format!(
        "source {}; COMP_WORDS=(outbox-relay en); COMP_CWORD=1; _outbox__relay outbox-relay en outbox-relay; echo \"${{COMPREPLY[@]}}\"",
        path.display()
    );
    let out = Command::new("bash").args(["-c", &probe]).output().unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "enqueue");
    for shell in ["zsh", "fish"] {
        let out = Command::new(BIN)
            .args(["completions", shell])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("payload-file"),
            "{shell}"
        );
    }
}

#[test]
fn the_man_page_lists_every_verb() {
    let out = Command::new(BIN).arg("man").output().unwrap();
    assert!(out.status.success());
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(page.contains(".TH outbox-relay 1"), "a roff page: {page}");
    let help = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let verbs: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|v| *v != "help")
        .collect();
    assert!(
        verbs.contains(&"enqueue") && verbs.contains(&"man"),
        "{verbs:?}"
    );
    for verb in verbs {
        assert!(
            page.contains(&format!("outbox\\-relay\\-{}", verb.replace('-', "\\-"))),
            "{verb} in the man page"
        );
    }
}

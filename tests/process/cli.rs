//! The operator verbs as processes: `enqueue` from a file or standard input with headers,
//! content type, delay, id and trace context; its errors; `completions` as bash, fish and zsh run them
//! (each shell's own completion engine; a broken script fails each) and
//! `man` pages for every verb, generated from the same definitions as the parser; `replay` with filters, a dry run and its audit row; the
//! hot-key shape of `bench`, round by round; a verb whose reader goes away (`| head -1`);
//! the verbs that write refusing the default database; `status` counting every dead letter;
//! a refused privilege naming the role to grant; a misspelt config key or URL naming the fix;
//! `make run`'s script relaying its samples.

use crate::common;

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

/// `--traceparent`/`--tracestate` become the message's creation context (its headers, in
/// place of a `--header traceparent=…`); a malformed one is refused naming the argument and
/// the value, and nothing is enqueued.
#[tokio::test(flavor = "multi_thread")]
async fn enqueue_takes_a_trace_context_and_refuses_a_malformed_one_naming_it() {
    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let db = TestDb::new().await;
    let c = db.client().await;
    // The JSON form and the bytes form of enqueue.
    for content_type in ["application/json", "text/plain"] {
        let out = relay(
            &db,
            &[
                "enqueue",
                "--topic",
                "orders",
                "--payload",
                "{}",
                "--content-type",
                content_type,
                "--header",
                "traceparent=00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "--traceparent",
                TRACEPARENT,
                "--tracestate",
                "congo=t61rcWkgMzE",
            ],
            b"",
        );
        let id = printed_id(&out);
        let row = c
            .query_one(
                "SELECT headers, content_type FROM outbox.messages WHERE outbox_id = $1",
                &[&id],
            )
            .await
            .unwrap();
        assert_eq!(
            row.get::<_, serde_json::Value>(0),
            serde_json::json!({"traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE"})
        );
        assert_eq!(row.get::<_, String>(1), content_type);
    }

    let out = relay(
        &db,
        &[
            "enqueue",
            "--topic",
            "orders",
            "--payload",
            "{}",
            "--traceparent",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        ],
        b"",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("invalid argument p_traceparent: '00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01' is not a W3C traceparent"),
        "{stderr}"
    );
    let out = relay(
        &db,
        &[
            "enqueue",
            "--topic",
            "orders",
            "--payload",
            "{}",
            "--tracestate",
            "a=b",
        ],
        b"",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--traceparent"),
        "{stderr}"
    );
    assert_eq!(
        common::pending(&c).await,
        2,
        "only the first two were enqueued"
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

/// Runs `command` to its end; a process still running after `deadline` (a relayer that
/// accepted what it should have refused) is killed and fails the test.
fn exited_within(command: &mut Command, deadline: std::time::Duration) -> Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let until = std::time::Instant::now() + deadline;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > until {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after {deadline:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn run_refuses_a_topic_pattern_naming_the_rule() {
    // Refused while reading the settings: no database is asked.
    let out = exited_within(
        Command::new(BIN)
            .args(["run", "--topics", "orders,x.*"])
            .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none"),
        std::time::Duration::from_secs(10),
    );
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("topics")
            && stderr.contains("\"x.*\" is a pattern, and topics are exact names"),
        "{stderr}"
    );
}

#[test]
fn run_refuses_broker_urls_that_cannot_work_naming_the_setting() {
    let dir = std::env::temp_dir().join(format!("outbox-relay-urls-{}", Uuid::new_v4()));
    std::fs::create_dir(&dir).unwrap();
    for (destination, problem) in [
        (
            "type = \"nats\"\nurl = \"nats//127.0.0.1:4222\"",
            "invalid setting destinations.d.url: \"nats//127.0.0.1:4222\" is not a NATS server address: it has a path",
        ),
        (
            "type = \"amqp\"\nurl = \"amqp://rabbit.internal:5672/%2f\"",
            "invalid setting destinations.d.url: \"amqp://rabbit.internal:5672/%2f\" has no credentials",
        ),
        (
            "type = \"amqp\"\nurl = \"amqp://app@rabbit.internal/%2f\"",
            "names a user without a password",
        ),
        (
            "type = \"amqp\"\nurl = \"amqp://app:pw@[::1\"",
            "invalid setting destinations.d.url: \"amqp://app:***@[::1\" is not a valid AMQP URL",
        ),
    ] {
        let config = dir.join("relay.toml");
        std::fs::write(
            &config,
            format!(
                "[destinations.d]\n{destination}\n[[routes]]\ntopic = \"*\"\ndestination = \"d\"\n"
            ),
        )
        .unwrap();
        // Refused while reading the settings: neither the database nor the broker is asked.
        let out = exited_within(
            Command::new(BIN)
                .arg("run")
                .arg("--config")
                .arg(&config)
                .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none"),
            std::time::Duration::from_secs(10),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{destination}: {stderr}");
        assert!(stderr.contains(problem), "{destination}: {stderr}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `outbox-relay ARGS` with no database named anywhere: no URL, URL file, config file,
/// sources or libpq variable, so that the default is all it has.
fn without_a_database(args: &[&str]) -> Output {
    let mut command = Command::new(BIN);
    for (name, _) in std::env::vars() {
        if name.starts_with("PG") || name.starts_with("OUTBOX_") || name.starts_with("DATABASE_URL")
        {
            command.env_remove(name);
        }
    }
    exited_within(command.args(args), std::time::Duration::from_secs(20))
}

#[test]
fn the_verbs_that_write_refuse_the_default_database_and_name_the_fix() {
    // enqueue first: were it not refused, it would fail on the default database without
    // writing (no outbox there), before migrate could create one.
    for args in [
        &["enqueue", "--topic", "t", "--payload", "{}"][..],
        &["repair"],
        &["replay", "--all"],
        &["migrate"],
        &[
            "run",
            "--migrate",
            "--sink",
            "null",
            "--all-topics",
            "--no-telemetry",
        ],
        &["run", "--sink", "null", "--all-topics", "--no-telemetry"],
    ] {
        let out = without_a_database(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let verb = if args.starts_with(&["run", "--migrate"]) {
            "run --migrate"
        } else {
            args[0]
        };
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with(&format!(
                "error: {verb} needs a database: set DATABASE_URL or --database-url"
            )) && stderr.contains("the default connects to the server's postgres database"),
            "{args:?}: {stderr}"
        );
    }
    // A verb that only reads goes to the default, and does not send its user to migrate it
    // when no outbox is there (when no server answers there, it says so instead).
    let out = without_a_database(&["status"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("run `outbox-relay migrate` (as the schema owner)")
            && (!stderr.contains("does not exist")
                || stderr.contains("set DATABASE_URL or --database-url to the outbox's database")),
        "{stderr}"
    );
}

#[test]
fn a_database_url_naming_postgres_is_taken_as_asked_for() {
    // Named explicitly, the postgres database is the user's choice: migrate tries it (here
    // a port nobody listens on, so that nothing is written).
    let out = without_a_database(&[
        "migrate",
        "--database-url",
        "postgres://postgres@127.0.0.1:1/postgres",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        !stderr.contains("needs a database") && stderr.contains("127.0.0.1:1"),
        "{stderr}"
    );
}

/// The completion script for `shell`, written to a scratch file.
fn completion_script(shell: &str) -> std::path::PathBuf {
    let script = Command::new(BIN)
        .args(["completions", shell])
        .output()
        .unwrap();
    assert!(script.status.success(), "completions {shell}");
    let path = std::env::temp_dir().join(format!(
        "outbox-relay-{}-{}.{shell}",
        std::process::id(),
        Uuid::new_v4()
    ));
    std::fs::write(&path, &script.stdout).unwrap();
    path
}

/// What bash offers for the command line `words` (the last one being completed), the way
/// bash runs a completion function: COMP_WORDS, COMP_CWORD and the arguments command,
/// word, previous word.
fn bash_completes(script: &std::path::Path, words: &[&str]) -> Vec<String> {
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let cword = words.len() - 1;
    let previous = words[cword - 1];
    let probe = format!(
        "source '{}'; COMP_WORDS=({}); COMP_CWORD={cword}; \
         _outbox__relay outbox-relay '{}' '{previous}'; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script.display(),
        quoted.join(" "),
        words[cword],
    );
    let out = Command::new("bash").args(["-c", &probe]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

#[test]
fn bash_completes_verbs_nested_verbs_and_each_verbs_flags() {
    let script = completion_script("bash");
    let offered = |words: &[&str]| bash_completes(&script, words);
    assert_eq!(offered(&["outbox-relay", "en"]), ["enqueue"]);
    // Below the top level: the nested verbs, not the files of the current directory.
    let nested = offered(&["outbox-relay", "dead-letters", ""]);
    for verb in ["list", "show", "count"] {
        assert!(nested.iter().any(|w| w == verb), "{verb} in {nested:?}");
    }
    assert!(
        nested.iter().all(|w| !std::path::Path::new(w).exists()),
        "no file names: {nested:?}"
    );
    // A verb's own flags, then the global ones; once each.
    let replay = offered(&["outbox-relay", "replay", "--"]);
    for flag in ["--id", "--dry-run", "--reason", "--all", "--database-url"] {
        assert!(replay.iter().any(|w| w == flag), "{flag} in {replay:?}");
    }
    let mut unique = replay.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), replay.len(), "listed once: {replay:?}");
    assert_eq!(
        offered(&["outbox-relay", "dead-letters", "list", "--li"]),
        ["--limit"]
    );
    assert_eq!(offered(&["outbox-relay", "completions", "fi"]), ["fish"]);
    assert_eq!(
        offered(&["outbox-relay", "run", "--sink", ""]),
        ["stdout", "file", "null"]
    );
    std::fs::remove_file(&script).unwrap();
}

/// Fails naming the package when `shell` is not installed: scripts/test-services.sh
/// installs it (`make test` runs that script), and a shell that is missing must not pass
/// its test unexercised.
fn require(shell: &str) {
    let found = Command::new(shell).arg("--version").output();
    assert!(
        found.is_ok_and(|o| o.status.success()),
        "{shell} is not installed: scripts/test-services.sh installs it (apt-get install {shell})"
    );
}

/// What fish offers for `line`, by its own completion engine (`complete -C`), after
/// sourcing `script`.
fn fish_completes(script: &std::path::Path, line: &str) -> Vec<String> {
    let probe = format!("source '{}'; complete -C '{line}'", script.display());
    let out = Command::new("fish").args(["-c", &probe]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split('\t').next().unwrap_or_default().to_owned())
        .collect()
}

#[test]
fn fish_completes_nested_verbs_and_flags() {
    require("fish");
    let script = completion_script("fish");
    let nested = fish_completes(&script, "outbox-relay dead-letters ");
    for verb in ["list", "show", "count"] {
        assert!(nested.iter().any(|w| w == verb), "{verb} in {nested:?}");
    }
    let replay = fish_completes(&script, "outbox-relay replay --");
    for flag in ["--id", "--dry-run", "--reason", "--database-url"] {
        assert!(replay.iter().any(|w| w == flag), "{flag} in {replay:?}");
    }
    assert!(
        !replay.iter().any(|w| w == "--limit"),
        "another verb's flag: {replay:?}"
    );
    // The check can fail: the same script with the nested verbs' conditions broken offers
    // none of them.
    let text = std::fs::read_to_string(&script).unwrap();
    let broken_text = text.replace("dead-letters; and not", "dead-letter; and not");
    assert_ne!(text, broken_text, "the script has the pattern broken here");
    std::fs::write(&script, broken_text).unwrap();
    let broken = fish_completes(&script, "outbox-relay dead-letters ");
    assert!(!broken.iter().any(|w| w == "list"), "{broken:?}");
    std::fs::remove_file(&script).unwrap();
}

/// What zsh offers for `line` with `script` loaded, the way zsh completes for a user: an
/// interactive zsh in a pseudo-terminal, compinit, the line and a TAB
/// (tests/support/zsh-complete.zsh); each match it added, and what the completion functions
/// wrote to standard error.
fn zsh_completes(script: &std::path::Path, line: &str) -> (Vec<String>, String) {
    let driver = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/support/zsh-complete.zsh"
    );
    let out = Command::new("zsh")
        .args(["-f", driver])
        .arg(script)
        .arg(line)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "zsh completing {line:?}: {stderr}");
    let offered = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    (offered, stderr)
}

#[test]
fn zsh_completes_nested_verbs_and_flags() {
    require("zsh");
    let script = completion_script("zsh");
    let (top, errors) = zsh_completes(&script, "outbox-relay en");
    assert_eq!(top, ["enqueue"], "{errors}");
    let (nested, errors) = zsh_completes(&script, "outbox-relay dead-letters ");
    assert!(errors.is_empty(), "{errors}");
    for verb in ["list", "show", "count"] {
        assert!(nested.iter().any(|w| w == verb), "{verb} in {nested:?}");
    }
    let (replay, errors) = zsh_completes(&script, "outbox-relay replay --");
    assert!(errors.is_empty(), "{errors}");
    for flag in ["--id", "--dry-run", "--reason", "--database-url"] {
        assert!(replay.iter().any(|w| w == flag), "{flag} in {replay:?}");
    }
    assert!(
        !replay.iter().any(|w| w == "--limit"),
        "another verb's flag: {replay:?}"
    );
    let (limit, _) = zsh_completes(&script, "outbox-relay dead-letters list --li");
    assert_eq!(limit, ["--limit"]);
    // The check can fail: the script with a nested verb's function named two ways (the way
    // bash's script broke) offers none of its verbs, and zsh says why.
    let text = std::fs::read_to_string(&script).unwrap();
    let broken_text = text.replace(
        "\n_outbox-relay__subcmd__dead-letters_commands() {",
        "\n_outbox-relay__dead-letters_commands() {",
    );
    assert_ne!(
        text, broken_text,
        "the script has the function renamed here"
    );
    std::fs::write(&script, broken_text).unwrap();
    let (broken, errors) = zsh_completes(&script, "outbox-relay dead-letters ");
    assert!(!broken.iter().any(|w| w == "list"), "{broken:?}");
    assert!(errors.contains("command not found"), "{errors}");
    std::fs::remove_file(&script).unwrap();
}

/// The verbs `--help` lists, nested ones included (`dead-letters list`).
fn verbs() -> Vec<Vec<String>> {
    let listed = |args: &[String]| -> Vec<String> {
        let help = Command::new(BIN).args(args).arg("--help").output().unwrap();
        String::from_utf8_lossy(&help.stdout)
            .lines()
            .skip_while(|l| !l.starts_with("Commands:"))
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .filter_map(|l| l.split_whitespace().next())
            .filter(|v| *v != "help")
            .map(str::to_owned)
            .collect()
    };
    let mut all = Vec::new();
    for verb in listed(&[]) {
        for nested in listed(std::slice::from_ref(&verb)) {
            all.push(vec![verb.clone(), nested]);
        }
        all.push(vec![verb]);
    }
    all
}

#[test]
fn every_verb_has_a_manual_page_naming_its_flags() {
    let verbs = verbs();
    assert!(
        verbs.contains(&vec!["replay".to_owned()])
            && verbs.contains(&vec!["dead-letters".to_owned(), "list".to_owned()]),
        "{verbs:?}"
    );
    for verb in verbs {
        let out = Command::new(BIN).arg("man").args(&verb).output().unwrap();
        assert!(
            out.status.success(),
            "man {verb:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let page = String::from_utf8_lossy(&out.stdout);
        assert!(
            page.contains(&format!(".TH outbox-relay-{} 1", verb.join("-"))),
            "{verb:?}: {page}"
        );
        let help = Command::new(BIN)
            .args(&verb)
            .arg("--help")
            .output()
            .unwrap();
        // The flag each option line of the help starts with.
        for flag in String::from_utf8_lossy(&help.stdout)
            .lines()
            .filter_map(|l| {
                l.split_whitespace()
                    .find(|w| w.starts_with("--"))
                    .filter(|_| l.trim_start().starts_with('-'))
            })
        {
            let flag = flag.replace('-', "\\-");
            assert!(
                page.contains(&format!("\\fB{flag}\\fR")),
                "{verb:?}: {flag}"
            );
        }
    }
    let out = Command::new(BIN)
        .args(["man", "dead-letters", "nope"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(
            "no manual page for `dead-letters nope`: outbox-relay dead-letters has the verbs list, show, count"
        ),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_top_manual_page_has_the_config_file_environment_and_exit_statuses() {
    let out = Command::new(BIN).arg("man").output().unwrap();
    assert!(out.status.success());
    let page = String::from_utf8_lossy(&out.stdout);
    for section in [
        ".SH FILES",
        ".SH ENVIRONMENT",
        ".SH \"EXIT STATUS\"",
        ".SH \"SEE ALSO\"",
    ] {
        assert!(page.contains(section), "{section}: {page}");
    }
    // Every variable `run` reads, and the ones read outside the flags.
    let help = Command::new(BIN).args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let vars: Vec<&str> = help
        .split("[env: ")
        .skip(1)
        .filter_map(|rest| rest.split(['=', ']']).next())
        .collect();
    assert!(vars.contains(&"OUTBOX_BATCH_SIZE"), "{vars:?}");
    for var in vars.iter().chain(&["OUTBOX_DATABASE_URL_FILE", "RUST_LOG"]) {
        assert!(page.contains(&format!("\\fB{}\\fR", var)), "{var}");
    }
    for status in ["0", "2", "130", "141"] {
        assert!(
            page.contains(&format!(".TP\n\\fB{status}\\fR\n")),
            "exit {status}"
        );
    }
    // Every page at once, for packaging.
    let dir = std::env::temp_dir().join(format!("outbox-relay-man-{}", Uuid::new_v4()));
    std::fs::create_dir(&dir).unwrap();
    let out = Command::new(BIN)
        .arg("man")
        .arg("--out-dir")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(
        written,
        verbs().len() + 1,
        "a page per verb and the top page"
    );
    assert!(dir.join("outbox-relay-dead-letters-list.1").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Claims the one ready message and completes it with `state` and `error`.
async fn settle(c: &tokio_postgres::Client, state: &str, error: &str) {
    c.execute(
        &format!(
            "SELECT outbox.complete_outbox_attempt(outbox_id, lease_token, 'w', '{state}', $1, \
             CASE WHEN '{state}' = 'RETRYABLE' THEN now() END) \
             FROM outbox.claim_outbox_batch_seq(1, 'w', 30)"
        ),
        &[&error],
    )
    .await
    .unwrap();
}

fn stdout_of(db: &TestDb, args: &[&str]) -> String {
    let out = relay(db, args, b"");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn status_shows_a_few_dead_letters_a_minute_as_a_count_not_zero_per_second() {
    let db = TestDb::new().await;
    let c = db.client().await;
    common::fill(&c, "orders", 5, None).await;
    for _ in 0..5 {
        settle(&c, "FAILED", "HTTP 400").await;
    }
    let shown = stdout_of(&db, &["status"]);
    assert!(
        shown.contains("fleet, last minute: 0/min delivered, 0/min retried, 5/min dead-lettered"),
        "{shown}"
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn status_counts_the_messages_out_of_attempts_as_dead_lettered_in_the_text_and_the_json() {
    let db = TestDb::new().await;
    let c = db.client().await;
    // Three messages out of attempts (their last one RETRYABLE), one refused for good, one
    // retried and one delivered.
    for _ in 0..3 {
        c.execute(
            "SELECT outbox.enqueue('orders', '{}'::jsonb, p_max_attempts => 1)",
            &[],
        )
        .await
        .unwrap();
    }
    for _ in 0..3 {
        settle(&c, "RETRYABLE", "HTTP 503").await;
    }
    common::fill(&c, "orders", 1, None).await;
    settle(&c, "FAILED", "HTTP 400").await;
    c.execute(
        "SELECT outbox.enqueue('later', '{}'::jsonb, p_max_attempts => 2)",
        &[],
    )
    .await
    .unwrap();
    settle(&c, "RETRYABLE", "HTTP 503").await;
    common::fill(&c, "done", 1, None).await;
    // The retried message is due again at once: claim the other by its topic.
    c.execute(
        "SELECT outbox.complete_outbox_attempt(outbox_id, lease_token, 'w', 'DISPATCHED') \
           FROM outbox.claim_outbox_batch_seq(1, 'w', 30, ARRAY['done'])",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(common::dead_letters(&c).await.len(), 4);

    let expected = "fleet, last minute: 1/min delivered, 1/min retried, 4/min dead-lettered, \
                    0/min zombie requeues";
    let shown = stdout_of(&db, &["status"]);
    assert!(shown.contains(expected), "{shown}");
    let json: serde_json::Value =
        serde_json::from_str(&stdout_of(&db, &["status", "--json"])).unwrap();
    assert_eq!(
        json["last_minute"],
        serde_json::json!({"delivered": 1, "retried": 1, "dead_lettered": 4, "zombie_requeues": 0}),
        "{json}"
    );

    // A login that may read the views only counts them too.
    let reader = db.login("reader", Some("outbox_reader")).await;
    let out = common::verb(&["status"], &reader);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && shown.contains(expected),
        "{shown}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_verb_refused_a_privilege_names_the_role_to_grant() {
    let db = TestDb::new().await;
    let reader = db.login("reader", Some("outbox_reader")).await;
    // (login, verb, the role the hint must name)
    for (login, args, role) in [
        (
            &reader,
            &["replay", "--all", "--reason", "r"][..],
            "outbox_relay",
        ),
        (&reader, &["repair"], "outbox_relay"),
        (
            &reader,
            &["enqueue", "--topic", "t", "--payload", "{}"],
            "outbox_producer",
        ),
        (&reader, &["dead-letters", "list"], "outbox_relay"),
    ] {
        let out = common::verb(args, login);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "hint: this verb needs a login that is a member of {role}: as the database \
                 owner, `GRANT {role} TO <this login>;`"
            )),
            "{args:?}: {stderr}"
        );
    }
    // A refusal that is not about privileges gets no such hint.
    let out = common::verb(&["replay", "--id", "not-a-uuid"], &reader);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("hint: this verb needs"));
    db.finish().await;
}

/// `make run`'s script as the README has it, with the binary of this build given instead of
/// the demo build (`make check` builds that one): it migrates the demo database it is
/// given, enqueues the four samples and relays them to standard output.
#[tokio::test(flavor = "multi_thread")]
async fn make_runs_script_migrates_its_database_and_relays_the_samples_to_stdout() {
    use std::io::BufRead;
    let db = TestDb::new().await;
    let demo = db.sibling("demo").await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/run-local.sh");
    let mut child = Command::new("bash")
        .args([script, "--no-telemetry"])
        .env("DATABASE_URL", &db.base)
        .env("DEMO_DATABASE", &demo)
        .env("OUTBOX_RELAY_BIN", BIN)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let (lines, reading) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stdout.lines() {
            if lines.send(line.unwrap()).is_err() {
                break;
            }
        }
    });
    let mut relayed = Vec::new();
    while relayed.len() < 4 {
        match reading.recv_timeout(std::time::Duration::from_secs(60)) {
            Ok(line) => relayed.push(serde_json::from_str::<serde_json::Value>(&line).unwrap()),
            Err(e) => {
                let _ = child.kill();
                let out = child.wait_with_output().unwrap();
                panic!(
                    "{e}: relayed {relayed:?}; {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
    // `run` was exec'd in place of the script: the same process stops on SIGTERM.
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("run-local: using database {demo}"))
            && stderr.contains("migrations applied now")
            && stderr.contains("enqueued 4 sample messages"),
        "{stderr}"
    );
    let mut topics: Vec<&str> = relayed
        .iter()
        .map(|m| m["topic"].as_str().unwrap())
        .collect();
    topics.sort_unstable();
    assert_eq!(
        topics,
        [
            "orders.created",
            "orders.created",
            "orders.created",
            "orders.paid"
        ],
        "{relayed:?}"
    );
    db.finish().await;
}

#[test]
fn a_misspelt_config_key_or_database_url_is_named_with_the_fix() {
    let dir = std::env::temp_dir().join(format!("outbox-relay-typo-{}", Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let top = dir.join("top.toml");
    std::fs::write(&top, "batchsize = 5\n").unwrap();
    let nested = dir.join("nested.toml");
    std::fs::write(
        &nested,
        "[destinations.d]\ntype = \"file\"\npaht = \"/tmp/x\"\n[[routes]]\ntopic = \"*\"\n\
         destination = \"d\"\n",
    )
    .unwrap();
    for (config, expected) in [
        (
            &top,
            "unknown field `batchsize`: did you mean `batch_size`?",
        ),
        (&nested, "unknown field `paht`: did you mean `path`?"),
    ] {
        let out = exited_within(
            Command::new(BIN).args([
                "run",
                "--no-telemetry",
                "--database-url",
                "postgres://postgres@127.0.0.1/postgres",
                "--config",
                config.to_str().unwrap(),
            ]),
            std::time::Duration::from_secs(20),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(expected), "{stderr}");
    }
    for (url, expected) in [
        (
            "postgress://postgres@127.0.0.1/x",
            "unknown URL scheme \"postgress://\"",
        ),
        (
            "orders",
            "the database URL \"orders\" is neither a URL nor key=value words",
        ),
    ] {
        let out = exited_within(
            Command::new(BIN).args(["status", "--database-url", url]),
            std::time::Duration::from_secs(20),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(expected), "{stderr}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_are_listed_counted_and_shown_with_their_attempts() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let enqueue = |sql: &'static str| {
        let c = &c;
        async move { c.query_one(sql, &[]).await.unwrap().get::<_, Uuid>(0) }
    };
    let order = enqueue(
        "SELECT outbox.enqueue('orders', '{\"order_id\": 7}'::jsonb, p_headers => '{\"x-tenant\": \"acme\"}')",
    )
    .await;
    settle(&c, "RETRYABLE", "timeout after 30 s").await;
    settle(&c, "FAILED", "HTTP 422: invalid order").await;
    let blob = enqueue(
        "SELECT outbox.enqueue('orders', '\\x009fff41'::bytea, p_content_type => 'application/octet-stream')",
    )
    .await;
    settle(&c, "FAILED", "schema mismatch").await;
    let payment = enqueue("SELECT outbox.enqueue('payments', '{\"amount\": 5}'::jsonb)").await;
    settle(&c, "FAILED", "http 422: unknown customer").await;

    let count = |args: &[&str]| {
        let mut all = vec!["dead-letters", "count"];
        all.extend_from_slice(args);
        stdout_of(&db, &all).trim().parse::<i64>().unwrap()
    };
    assert_eq!(count(&[]), 3);
    assert_eq!(count(&["--topic", "orders"]), 2);
    assert_eq!(count(&["--error-contains", "HTTP 422"]), 2, "any case");
    assert_eq!(count(&["--since", "1h"]), 3);
    assert_eq!(count(&["--since", "2999-01-01T00:00:00Z"]), 0);

    let newest = stdout_of(
        &db,
        &["dead-letters", "list", "--topic", "orders", "--limit", "1"],
    );
    assert_eq!(newest.lines().count(), 1, "{newest}");
    assert!(
        newest.contains(&blob.to_string()) && newest.contains("schema mismatch"),
        "{newest}"
    );
    let listed: Vec<serde_json::Value> = stdout_of(&db, &["dead-letters", "list", "--json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids: Vec<&str> = listed
        .iter()
        .map(|v| v["outbox_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [payment.to_string(), blob.to_string(), order.to_string()],
        "newest first"
    );

    let shown = stdout_of(&db, &["dead-letters", "show", &order.to_string()]);
    for expected in [
        "\"order_id\": 7",
        "x-tenant",
        "after 2 of 10 attempts",
        "RETRYABLE",
        "timeout after 30 s",
        "HTTP 422: invalid order",
    ] {
        assert!(shown.contains(expected), "{expected} in {shown}");
    }
    let shown = stdout_of(&db, &["dead-letters", "show", &blob.to_string()]);
    assert!(
        shown.contains("00000000  00 9f ff 41"),
        "a hex dump: {shown}"
    );
    let shown: serde_json::Value = serde_json::from_str(&stdout_of(
        &db,
        &["dead-letters", "show", "--json", &payment.to_string()],
    ))
    .unwrap();
    assert_eq!(shown["payload"], serde_json::json!({"amount": 5}));
    assert_eq!(shown["attempts"][0]["state"], "FAILED");

    let missing = relay(
        &db,
        &["dead-letters", "show", &Uuid::nil().to_string()],
        b"",
    );
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no dead letter"));
    db.finish().await;
}

/// Dead letters made directly: `n` on `topic` whose last error is `error`.
async fn dead(c: &tokio_postgres::Client, topic: &str, n: i32, error: &str) {
    c.execute(
        "INSERT INTO outbox.dead_letters (outbox_id, topic, payload, content_type, headers, \
                                          created_at, attempt_count, max_attempts, last_error) \
         SELECT gen_random_uuid(), $1, '\\x7b7d', 'application/json', '{}', \
                clock_timestamp(), 3, 3, $3 \
           FROM generate_series(1, $2)",
        &[&topic, &n, &error],
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_previews_with_dry_run_moves_only_what_matches_and_is_audited() {
    let db = TestDb::new().await;
    let c = db.client().await;
    dead(&c, "orders", 3, "HTTP 503: upstream timeout").await;
    dead(&c, "orders", 2, "HTTP 400: bad field").await;
    dead(&c, "emails", 4, "connect timeout").await;
    let pending = || async {
        c.query_one("SELECT count(*) FROM outbox.messages", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };

    let out = relay(&db, &["replay"], b"");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("replay needs a filter"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let preview = stdout_of(
        &db,
        &[
            "replay",
            "--topic",
            "orders",
            "--error-contains",
            "TIMEOUT",
            "--dry-run",
        ],
    );
    assert!(preview.starts_with("would replay 3\n"), "{preview}");
    assert_eq!(
        preview
            .lines()
            .filter(|l| l.contains("upstream timeout"))
            .count(),
        3
    );
    assert_eq!(pending().await, 0, "a dry run moves nothing");

    // In steps of 1: one audit row all the same.
    let done = stdout_of(
        &db,
        &[
            "replay",
            "--topic",
            "orders",
            "--error-contains",
            "timeout",
            "--since",
            "1h",
            "--reason",
            "INC-42 upstream fixed",
            "--step",
            "1",
        ],
    );
    assert!(done.starts_with("replayed 3 (replay "), "{done}");
    assert_eq!(pending().await, 3);
    let left: Vec<(String, String)> = c
        .query(
            "SELECT topic, last_error FROM outbox.dead_letters ORDER BY topic",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(left.len(), 6);
    assert!(
        left.iter().all(|(t, e)| t == "emails" || e.contains("400")),
        "{left:?}"
    );

    let audit = c
        .query(
            "SELECT replayed_by, reason, replayed, filter ->> 'topic', filter ->> 'error_contains', \
                    filter ->> 'since' IS NOT NULL, finished_at IS NOT NULL \
             FROM outbox.replay_log",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        audit.len(),
        1,
        "one audit row per replay, whatever its steps"
    );
    let row = &audit[0];
    assert_eq!(row.get::<_, String>(0), "postgres");
    assert_eq!(row.get::<_, String>(1), "INC-42 upstream fixed");
    assert_eq!(row.get::<_, i64>(2), 3);
    assert_eq!(row.get::<_, String>(3), "orders");
    assert_eq!(row.get::<_, String>(4), "timeout");
    assert!(row.get::<_, bool>(5));
    assert!(row.get::<_, bool>(6), "finished");

    let all = stdout_of(&db, &["replay", "--all"]);
    assert!(all.starts_with("replayed 6 "), "{all}");
    assert_eq!(pending().await, 9);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_of_ids_that_are_not_dead_letters_fails_naming_them_and_moves_nothing() {
    let db = TestDb::new().await;
    let c = db.client().await;
    dead(&c, "orders", 1, "HTTP 503").await;
    let known: Uuid = c
        .query_one("SELECT outbox_id FROM outbox.dead_letters", &[])
        .await
        .unwrap()
        .get(0);
    let unknown = Uuid::now_v7();
    let (known, unknown) = (known.to_string(), unknown.to_string());
    for args in [
        vec!["replay", "--id", &unknown],
        vec!["replay", "--id", &known, "--id", &unknown],
        vec!["replay", "--id", &unknown, "--dry-run"],
    ] {
        let out = relay(&db, &args, b"");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("not dead letters, nothing replayed: {unknown}")),
            "{args:?}: {stderr}"
        );
        assert!(
            !stderr.contains(&known),
            "only the unknown id is named: {stderr}"
        );
    }
    let count = |sql: &'static str| {
        let c = &c;
        async move { c.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(count("SELECT count(*) FROM outbox.dead_letters").await, 1);
    assert_eq!(
        count("SELECT count(*) FROM outbox.replay_log").await,
        0,
        "no audit row"
    );

    // A filter that matches nothing replays nothing and records nothing.
    let none = stdout_of(&db, &["replay", "--topic", "nothing-here"]);
    assert_eq!(none.trim(), "replayed 0 (no dead letter matches)");
    assert_eq!(
        count("SELECT count(*) FROM outbox.replay_log").await,
        0,
        "no audit row"
    );

    let done = stdout_of(&db, &["replay", "--id", &known]);
    assert!(done.starts_with("replayed 1 (replay "), "{done}");
    assert_eq!(count("SELECT count(*) FROM outbox.replay_log").await, 1);
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_hot_key_shape_drains_every_round_and_prints_the_medians() {
    // The bench makes and drops a database of its own beside this one.
    let db = TestDb::new().await;
    let out = relay(&db, &["bench", "--hot-key", "2000", "--rounds", "2"], b"");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printed}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for round in 1..=2 {
        for line in [
            "unkeyed alone: 2000 messages",
            "unkeyed beside the hot key: 2000 messages",
            "the hot key (one key, in order): 2000 messages",
        ] {
            assert!(
                printed.contains(&format!("round {round}: {line}")),
                "round {round} reports {line:?}:\n{printed}"
            );
        }
    }
    assert!(
        printed.contains("hot key, median of 2 rounds: unkeyed beside the hot key / alone = "),
        "{printed}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_stall_shape_delivers_everything_and_records_the_unanswered_calls() {
    // The bench makes and drops a database of its own beside this one. Its receiver answers
    // nothing for 3 s against a 500 ms timeout: the calls of the stall go out and get no
    // answer, so they are attempts (RETRYABLE rows); every message still arrives.
    let db = TestDb::new().await;
    let out = relay(
        &db,
        &[
            "bench",
            "--stall-secs",
            "3",
            "--stall-steady-secs",
            "2",
            "--stall-rate",
            "50",
            "--stall-timeout-ms",
            "500",
            "--workers",
            "1",
        ],
        b"",
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printed}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (phase, n) in [("before", 100), ("during", 150), ("after", 100)] {
        let line = printed
            .lines()
            .find(|l| l.contains(&format!("enqueued {phase} the stall: ")))
            .unwrap_or_else(|| panic!("no line for {phase}:\n{printed}"));
        assert!(
            line.contains(&format!(": {n} messages, {n} arrived, ")),
            "every message enqueued {phase} the stall arrives: {line}"
        );
    }
    let attempts = printed
        .lines()
        .find(|l| l.contains("attempts recorded: "))
        .unwrap_or_else(|| panic!("no attempts line:\n{printed}"));
    assert!(
        attempts.contains("DISPATCHED 350 ") && attempts.contains("RETRYABLE "),
        "the unanswered calls of the stall are recorded as attempts: {attempts}"
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sources_shape_prints_the_drain_and_the_wal_it_wrote() {
    // The bench makes and drops databases of its own beside this one.
    let db = TestDb::new().await;
    let out = relay(
        &db,
        &[
            "bench",
            "--sources",
            "2",
            "--messages",
            "400",
            "--workers",
            "1",
        ],
        b"",
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printed}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        printed.contains("sources 2: 200 messages each: 400 messages in "),
        "{printed}"
    );
    // What the server wrote, read from its own counters: some WAL for every message (the
    // counters are the server's, which other tests write to as well: this checks that the
    // figures are read and printed, not their size).
    let wal = printed
        .lines()
        .find_map(|l| l.trim().strip_prefix("WAL: "))
        .unwrap_or_else(|| panic!("no WAL line:\n{printed}"));
    let bytes: f64 = wal
        .split(' ')
        .next()
        .and_then(|b| b.parse().ok())
        .unwrap_or_else(|| panic!("no bytes a message: {wal}"));
    assert!(bytes > 100.0, "{wal}");
    assert!(
        wal.contains("full-page images a message; ")
            && wal.contains("checkpoint(s) during the drain (max_wal_size "),
        "{wal}"
    );
    db.finish().await;
}

/// Runs a verb whose standard output is a pipe that its reader closed before the verb wrote
/// (`outbox-relay … | head -c0`); returns its status and standard error.
fn with_reader_gone(db: &TestDb, args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(args)
        .env("DATABASE_URL", &db.url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    (out.status.code(), common::text(&out.stderr))
}

/// `status --json | head -1` and the other verbs: a reader that goes away ends the verb
/// quietly with status 141, as `cat` killed by SIGPIPE does, instead of a panic (101).
#[tokio::test]
async fn a_verb_whose_reader_goes_away_ends_quietly() {
    let db = TestDb::new().await;
    for args in [
        &["status", "--json"][..],
        &["status"],
        &["dead-letters", "count"],
        &["completions", "bash"],
        &["man"],
    ] {
        let (code, stderr) = with_reader_gone(&db, args);
        assert_eq!(code, Some(141), "outbox-relay {args:?}: stderr {stderr}");
        assert!(
            !stderr.contains("panicked"),
            "outbox-relay {args:?} panicked: {stderr}"
        );
    }
    db.finish().await;
}

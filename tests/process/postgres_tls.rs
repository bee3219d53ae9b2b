//! TLS to Postgres and connection errors, against a real cluster that accepts TLS only
//! (`tests/support/tls-cluster.sh`: its own CA and server certificate, a client certificate
//! for `certuser`, a password for `pwuser`). Each case runs the built binary as a user would
//! and asserts what it prints, word for word where the message is the point.

use crate::common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use common::{ClosedPort, eventually, free_port, text, verb, verb_env};

struct Cluster {
    dir: PathBuf,
    port: u16,
}

/// One TLS-only cluster per test process, migrated once; stopped when the process exits
/// (under cargo nextest, each test starts one of its own).
fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("outbox-tls-{}-{port}", std::process::id()));
        let out = Command::new("bash")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/support/tls-cluster.sh"
            ))
            .args([
                dir.display().to_string(),
                port.to_string(),
                std::process::id().to_string(),
            ])
            .output()
            .expect("run tls-cluster.sh");
        assert!(
            out.status.success(),
            "tls-cluster.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Cluster { dir, port };
        let migrated = verb(
            &["migrate"],
            &cluster.url("localhost", "sslmode=verify-full&sslrootcert=", "ca.crt"),
        );
        assert!(
            migrated.status.success(),
            "migrate: {}",
            text(&migrated.stderr)
        );
        cluster
    })
}

impl Cluster {
    fn file(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// `postgres://postgres@HOST:PORT/postgres?PARAMS` where PARAMS ends with a file of the
    /// cluster's directory (empty for none).
    fn url(&self, host: &str, params: &str, file: &str) -> String {
        self.url_as("postgres", host, "postgres", params, file)
    }

    fn url_as(&self, user: &str, host: &str, db: &str, params: &str, file: &str) -> String {
        let file = if file.is_empty() {
            String::new()
        } else {
            self.file(file)
        };
        format!("postgres://{user}@{host}:{}/{db}?{params}{file}", self.port)
    }
}

/// Asserts that `status` succeeded (so the connection was made, over TLS: the cluster takes
/// nothing else).
fn assert_connects(url: &str, env: &[(&str, &str)]) {
    let out = verb_env(&["status", "--json"], url, env);
    assert!(out.status.success(), "{url}: {}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("\"ready\""),
        "{}",
        text(&out.stdout)
    );
}

/// Asserts that `status` fails with exactly `message` on stderr.
fn assert_refused(url: &str, env: &[(&str, &str)], message: &str) {
    let out = verb_env(&["status"], url, env);
    assert_eq!(out.status.code(), Some(2), "{url} should be refused");
    assert_eq!(text(&out.stderr), format!("error: {message}\n"), "{url}");
}

/// Asserts that `status` fails with an error containing `reason`.
fn assert_refused_because(url: &str, env: &[(&str, &str)], reason: &str) {
    let out = verb_env(&["status"], url, env);
    assert_eq!(out.status.code(), Some(2), "{url} should be refused");
    assert!(
        text(&out.stderr).contains(reason),
        "{url}: {}",
        text(&out.stderr)
    );
}

#[test]
fn require_encrypts_without_a_root_certificate() {
    let c = cluster();
    assert_connects(&c.url("127.0.0.1", "sslmode=require", ""), &[]);
}

#[test]
fn verify_full_checks_the_ca_and_the_host_name() {
    let c = cluster();
    let p = c.port;
    assert_connects(
        &c.url("localhost", "sslmode=verify-full&sslrootcert=", "ca.crt"),
        &[],
    );
    assert_refused(
        &c.url("127.0.0.1", "sslmode=verify-full&sslrootcert=", "ca.crt"),
        &[],
        &format!(
            "cannot connect to 127.0.0.1:{p} as \"postgres\", database \"postgres\": the \
             server's certificate does not name the host 127.0.0.1:{p} (sslmode=verify-full \
             checks the host name: connect by a name the certificate lists) (invalid peer \
             certificate: certificate not valid for name \"127.0.0.1\"; certificate is only \
             valid for DnsName(\"localhost\"))"
        ),
    );
    assert_refused(
        &c.url(
            "localhost",
            "sslmode=verify-full&sslrootcert=",
            "other-ca.crt",
        ),
        &[],
        &format!(
            "cannot connect to localhost:{p} as \"postgres\", database \"postgres\": the \
             server's certificate is not signed by a trusted CA (check sslrootcert) (invalid \
             peer certificate: UnknownIssuer)"
        ),
    );
}

#[test]
fn verify_ca_checks_the_chain_but_not_the_name() {
    let c = cluster();
    assert_connects(
        &c.url("127.0.0.1", "sslmode=verify-ca&sslrootcert=", "ca.crt"),
        &[],
    );
    assert_refused_because(
        &c.url(
            "127.0.0.1",
            "sslmode=verify-ca&sslrootcert=",
            "other-ca.crt",
        ),
        &[],
        "not signed by a trusted CA",
    );
}

#[test]
fn require_with_a_root_certificate_checks_the_chain_like_libpq() {
    let c = cluster();
    assert_refused_because(
        &c.url("127.0.0.1", "sslmode=require&sslrootcert=", "other-ca.crt"),
        &[],
        "not signed by a trusted CA",
    );
}

#[test]
fn a_client_certificate_authenticates() {
    let c = cluster();
    let p = c.port;
    let with_cert = format!(
        "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey=",
        c.file("ca.crt"),
        c.file("client.crt")
    );
    assert_connects(
        &c.url_as(
            "certuser",
            "localhost",
            "postgres",
            &with_cert,
            "client.key",
        ),
        &[],
    );
    assert_refused(
        &c.url_as("certuser", "127.0.0.1", "postgres", "sslmode=require", ""),
        &[],
        &format!(
            "cannot connect to 127.0.0.1:{p} as \"certuser\", database \"postgres\": \
             connection requires a valid client certificate (SQLSTATE 28000)"
        ),
    );
}

#[test]
fn sslmode_disable_against_a_tls_only_server_says_tls_is_required() {
    let c = cluster();
    let p = c.port;
    assert_refused(
        &c.url("127.0.0.1", "sslmode=disable", ""),
        &[],
        &format!(
            "cannot connect to 127.0.0.1:{p} as \"postgres\", database \"postgres\": the server \
             requires TLS (it says: no pg_hba.conf entry for host \"127.0.0.1\", user \
             \"postgres\", database \"postgres\", no encryption (SQLSTATE 28000)); sslmode is \
             disable: set sslmode=require or stronger"
        ),
    );
}

#[test]
fn libpq_environment_variables_set_tls_and_the_password() {
    let c = cluster();
    let base = c.url("localhost", "", "");
    let ca = c.file("ca.crt");
    let other = c.file("other-ca.crt");
    assert_connects(
        &base,
        &[("PGSSLMODE", "verify-full"), ("PGSSLROOTCERT", ca.as_str())],
    );
    // PGSSLROOTCERT is honoured: the wrong CA is refused.
    assert_refused_because(
        &base,
        &[
            ("PGSSLMODE", "verify-full"),
            ("PGSSLROOTCERT", other.as_str()),
        ],
        "not signed by a trusted CA",
    );
    // The URL wins over the environment, as with libpq.
    assert_connects(
        &c.url("localhost", "sslmode=verify-full&sslrootcert=", "ca.crt"),
        &[("PGSSLROOTCERT", other.as_str())],
    );
    let pw = c.url_as("pwuser", "127.0.0.1", "postgres", "sslmode=require", "");
    assert_connects(&pw, &[("PGPASSWORD", "right-password")]);
}

#[test]
fn a_wrong_password_a_missing_database_role_or_server_are_named() {
    let c = cluster();
    let p = c.port;
    assert_refused(
        &c.url_as("pwuser", "127.0.0.1", "postgres", "sslmode=require", ""),
        &[("PGPASSWORD", "wrong")],
        &format!(
            "cannot connect to 127.0.0.1:{p} as \"pwuser\", database \"postgres\": password \
             authentication failed for user \"pwuser\" (SQLSTATE 28P01)"
        ),
    );
    assert_refused(
        &c.url_as("postgres", "127.0.0.1", "app", "sslmode=require", ""),
        &[],
        &format!(
            "cannot connect to 127.0.0.1:{p} as \"postgres\", database \"app\": database \"app\" \
             does not exist (SQLSTATE 3D000)"
        ),
    );
    assert_refused(
        &c.url_as("relay", "127.0.0.1", "postgres", "sslmode=require", ""),
        &[],
        &format!(
            "cannot connect to 127.0.0.1:{p} as \"relay\", database \"postgres\": role \"relay\" \
             does not exist (SQLSTATE 28000)"
        ),
    );
    let held = ClosedPort::new();
    let closed = held.port;
    assert_refused(
        &format!("postgres://relay:s3cret@127.0.0.1:{closed}/app?sslmode=require"),
        &[],
        &format!(
            "cannot connect to 127.0.0.1:{closed} as \"relay\", database \"app\": connection \
             refused (127.0.0.1:{closed})"
        ),
    );
}

#[test]
fn a_password_from_database_url_file_is_used_and_never_printed() {
    let c = cluster();
    let dir = tempdir("url-file");
    let file = dir.join("database-url");
    std::fs::write(
        &file,
        format!(
            "postgres://pwuser:right-password@127.0.0.1:{}/postgres?sslmode=require\n",
            c.port
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["status", "--json"])
        .env_remove("DATABASE_URL")
        .env("DATABASE_URL_FILE", &file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    std::fs::write(
        &file,
        format!(
            "postgres://pwuser:wrong-s3cret@127.0.0.1:{}/postgres?sslmode=require",
            c.port
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["status"])
        .env_remove("DATABASE_URL")
        .env("OUTBOX_DATABASE_URL_FILE", &file)
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("password authentication failed"),
        "{stderr}"
    );
    assert!(!stderr.contains("wrong-s3cret"), "{stderr}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn every_verb_works_over_verify_full() {
    let c = cluster();
    let db = format!("tls_verbs_{}", std::process::id());
    let admin_url = c.url("localhost", "sslmode=verify-full&sslrootcert=", "ca.crt");
    let admin = outbox_relay::connection::Target::parse(&admin_url)
        .unwrap()
        .connect()
        .await
        .expect("admin connection over TLS");
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await
        .unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let url = c.url_as(
        "postgres",
        "localhost",
        &db,
        "sslmode=verify-full&sslrootcert=",
        "ca.crt",
    );
    let run = |args: &[&str]| {
        let out = verb(args, &url);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        text(&out.stdout)
    };
    assert!(run(&["migrate"]).contains("applied V5__schema_version"));
    let id = run(&["enqueue", "--topic", "tls", "--payload", "{\"n\":1}"]);
    let id = id.trim();
    assert!(run(&["status", "--json"]).contains("\"ready\":1"));
    assert_eq!(run(&["repair"]), "requeued 0 dead_lettered 0\n");
    assert!(run(&["replay", "--all"]).starts_with("replayed 0 "));

    let dir = tempdir("verbs");
    let out = dir.join("out.jsonl");
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["run", "--no-telemetry", "--sink", "file", "--sink-file"])
        .arg(&out)
        .env("DATABASE_URL", &url)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    eventually(Duration::from_secs(30), "the message to arrive", || async {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .contains(id)
    })
    .await;
    child.kill().unwrap();
    child.wait().unwrap();
    let ssl: bool = admin
        .query_one(
            "SELECT bool_and(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
              WHERE a.datname = $1",
            &[&db],
        )
        .await
        .unwrap()
        .get::<_, Option<bool>>(0)
        .unwrap_or(true);
    assert!(ssl, "every connection to the test database is encrypted");

    let bench = run(&[
        "bench",
        "--messages",
        "2000",
        "--big-backlog",
        "0",
        "--latency-secs",
        "1",
        "--rate",
        "200",
    ]);
    assert!(bench.contains("msg/s"), "{bench}");
    admin
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await
        .unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

fn tempdir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tls-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

//! Test harness: every test gets its own freshly migrated database on the Postgres named by
//! `DATABASE_URL` (default: the local one on 127.0.0.1:5432), so tests run in parallel and
//! never see each other's rows. Under `make check` and `make test` (which set
//! `OUTBOX_TEST_TEMPLATE` and drop that database when the run ends) the database is a clone
//! of a template migrated once per run, a tenth of the time of migrating it; without the
//! variable each database is migrated itself. A [`TestDb`] is a guard: when it goes out of scope in a test
//! that passes, it drops its database, the databases made beside it ([`TestDb::sibling`]) and
//! the login roles made for it ([`TestDb::login`]); when the test fails (the thread is
//! panicking), it keeps them all and prints their names under the test's failure output.
//! Nothing has to remember to clean up: `finish` is only an explicit way of saying "done".
//! A test that needs a server of its own starts a throwaway one ([`cluster::Cluster`]) and
//! makes its database there with [`TestDb::new_in`]; what it makes there goes with the
//! cluster.

#![allow(dead_code)] // each test binary uses a different part of the harness

pub mod cluster;
mod kit;
pub mod pgbouncer;
pub mod quarkus;
pub mod sql;

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

#[allow(unused_imports)] // not every test binary waits
pub use kit::eventually;

use outbox_relay::store::{Store, with_database};
use tokio_postgres::{Client, NoTls};

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

static COUNTER: AtomicU32 = AtomicU32::new(0);

pub fn base_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// A test's database; dropped with what was made for it when the test passes, kept (and
/// named) when it fails. See the module docs.
pub struct TestDb {
    pub name: String,
    pub url: String,
    /// The server's URL (database `postgres`): [`base_url`], or the one given to
    /// [`TestDb::new_on`].
    pub base: String,
    /// On a throwaway cluster ([`TestDb::new_in`]): nothing to drop, the cluster goes.
    throwaway: bool,
    /// Databases made beside this one ([`TestDb::sibling`]).
    siblings: Mutex<Vec<String>>,
    /// Login roles made for this database ([`TestDb::login`]).
    logins: Mutex<Vec<String>>,
}

impl TestDb {
    /// Creates and migrates a new database.
    pub async fn new() -> TestDb {
        TestDb::new_on(&base_url()).await
    }

    /// [`TestDb::new`] on a throwaway cluster, which removes the database, its siblings and
    /// its logins with itself (dropping each database would cost a checkpoint).
    pub async fn new_in(cluster: &cluster::Cluster) -> TestDb {
        TestDb::migrated(&cluster.url(), true).await
    }

    /// [`TestDb::new`] on the server of `base` (a URL of its database `postgres`, say), which
    /// its siblings share.
    pub async fn new_on(base: &str) -> TestDb {
        TestDb::migrated(base, false).await
    }

    async fn migrated(base: &str, throwaway: bool) -> TestDb {
        if !throwaway
            && base == base_url()
            && let Some(template) = run_template(base).await
        {
            let db = TestDb::create_from(base, false, Some(&template)).await;
            // The copy's clocks start now, as a database migrated now would have them: the
            // rows the migrations seed with a time are the slots' (each opened when
            // migrated).
            db.client()
                .await
                .batch_execute(
                    "UPDATE outbox.message_slots SET opened_at = clock_timestamp(); \
                     UPDATE outbox.attempt_slots SET opened_at = clock_timestamp();",
                )
                .await
                .expect("restamp the copy's slots");
            return db;
        }
        let db = TestDb::create(base, throwaway).await;
        let store = Store::connect(&db.url, 2).expect("store");
        store.migrate().await.expect("migrate test database");
        db
    }

    /// Creates a new database migrated to `version` only, as an earlier release left it
    /// (refinery's target version; the migrations of this build up to that one).
    pub async fn at_version(version: i32) -> TestDb {
        let db = TestDb::create(&base_url(), false).await;
        let mut client = db.client().await;
        outbox_relay::schema::runner()
            .set_target(refinery::Target::Version(version))
            .run_async(&mut client)
            .await
            .unwrap_or_else(|e| panic!("migrate test database to version {version}: {e}"));
        db
    }

    /// Creates a new database that no migration has touched.
    pub async fn empty() -> TestDb {
        TestDb::create(&base_url(), false).await
    }

    /// Creates a new, empty database on the server of `base` (a throwaway cluster's, which
    /// removes it, or not).
    async fn create(base: &str, throwaway: bool) -> TestDb {
        TestDb::create_from(base, throwaway, None).await
    }

    /// [`TestDb::create`] as a copy of `template` when given.
    async fn create_from(base: &str, throwaway: bool, template: Option<&str>) -> TestDb {
        let name = format!(
            "outbox_test_{}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            rand_suffix()
        );
        let admin = connect(base).await.unwrap_or_else(|e| {
            panic!(
                "cannot connect to Postgres at {base} ({e}); set DATABASE_URL or run `make \
                 test`, which starts one"
            )
        });
        let copy = template.map_or(String::new(), |t| format!(" TEMPLATE {t}"));
        admin
            .batch_execute(&format!("CREATE DATABASE {name}{copy}"))
            .await
            .expect("create test database");
        if throwaway {
            eprintln!("test database {name} (on the throwaway cluster, removed with it)");
        } else {
            eprintln!("test database {name} (kept if the test fails)");
        }
        let url = with_database(base, &name);
        TestDb {
            name,
            url,
            base: base.to_owned(),
            throwaway,
            siblings: Mutex::default(),
            logins: Mutex::default(),
        }
    }

    /// Creates another, empty database named `<database>_<suffix>` (not migrated), dropped
    /// and kept with this one; returns its name.
    pub async fn sibling(&self, suffix: &str) -> String {
        let name = format!("{}_{suffix}", self.name);
        self.siblings.lock().unwrap().push(name.clone());
        connect(&self.base)
            .await
            .expect("connect admin")
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create sibling database");
        name
    }

    /// A sibling database migrated as a source of a many-source fleet, to copy sources from
    /// with [`TestDb::sibling_from`].
    pub async fn migrated_template(&self) -> String {
        let template = self.sibling("tmpl").await;
        let mut t = connect(&outbox_relay::store::with_database(&self.base, &template))
            .await
            .expect("connect to the template");
        outbox_relay::schema::runner()
            .run_async(&mut t)
            .await
            .expect("migrate the template");
        template
    }

    /// [`TestDb::sibling`] copied from the database `template` (which nobody may be
    /// connected to); returns its name.
    pub async fn sibling_from(&self, suffix: &str, template: &str) -> String {
        let name = format!("{}_{suffix}", self.name);
        self.siblings.lock().unwrap().push(name.clone());
        let admin = connect(&self.base).await.expect("connect admin");
        // A session of the template's last user may still be closing.
        once_unused(
            &admin,
            &format!("CREATE DATABASE {name} TEMPLATE {template}"),
        )
        .await
        .unwrap_or_else(|e| panic!("create {name} from {template}: {e}"));
        name
    }

    pub async fn client(&self) -> Client {
        connect(&self.url).await.expect("connect to test database")
    }

    /// Creates a login role `<database>_<suffix>`, a member of `member_of` when given, and
    /// returns a URL that connects to this database as it. It is dropped with the database
    /// (or earlier with `drop_login`).
    pub async fn login(&self, suffix: &str, member_of: Option<&str>) -> String {
        let login = format!("{}_{suffix}", self.name);
        self.logins.lock().unwrap().push(login.clone());
        let membership = member_of.map_or(String::new(), |r| format!(" IN ROLE {r}"));
        self.client()
            .await
            .batch_execute(&format!("CREATE ROLE {login} LOGIN{membership}"))
            .await
            .expect("create login");
        let config: tokio_postgres::Config = self.url.parse().unwrap();
        let port = config.get_ports().first().copied().unwrap_or(5432);
        with_database(
            &format!("postgres://{login}@127.0.0.1:{port}/x"),
            &self.name,
        )
    }

    pub async fn drop_login(&self, suffix: &str) {
        let login = format!("{}_{suffix}", self.name);
        self.client()
            .await
            .batch_execute(&format!("DROP ROLE IF EXISTS {login}"))
            .await
            .expect("drop login");
        self.logins.lock().unwrap().retain(|l| *l != login);
    }

    pub fn store(&self) -> Store {
        Store::connect(&self.url, 8).expect("store")
    }

    /// Drops the database now, as the guard would at the end of a passing test; for a test
    /// that wants to say where it is done.
    pub async fn finish(self) {
        drop(self);
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let siblings = std::mem::take(&mut *self.siblings.lock().unwrap());
        let logins = std::mem::take(&mut *self.logins.lock().unwrap());
        let scratch = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(&self.name);
        if std::thread::panicking() {
            if self.throwaway {
                return;
            }
            let mut kept = format!(
                "test failed: database {} kept for inspection (psql {})",
                self.name, self.url
            );
            if scratch.exists() {
                kept.push_str(&format!(", with its files in {}", scratch.display()));
            }
            if !siblings.is_empty() {
                kept.push_str(&format!(", with the databases {}", siblings.join(", ")));
            }
            if !logins.is_empty() {
                kept.push_str(&format!(", and the login roles {}", logins.join(", ")));
            }
            eprintln!(
                "{kept}; drop it with DROP DATABASE {} WITH (FORCE)",
                self.name
            );
            return;
        }
        // A passed test leaves nothing behind: its files go with its database.
        let _ = std::fs::remove_dir_all(&scratch);
        if self.throwaway {
            return;
        }
        let mut databases = siblings;
        databases.push(self.name.clone());
        let base = self.base.clone();
        // Drop is synchronous and may run inside a runtime: clean up on a thread of its own
        // with a runtime of its own.
        let cleaned = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime to drop the test database")
                .block_on(drop_all(&base, databases, logins))
        })
        .join();
        match cleaned {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("cannot drop test database {}: {e}", self.name),
            Err(_) => panic!("cannot drop test database {}", self.name),
        }
    }
}

/// Drops `databases` on the server of `base`, then the `logins` (a role is dropped once no
/// database grants it anything).
async fn drop_all(
    base: &str,
    databases: Vec<String>,
    logins: Vec<String>,
) -> Result<(), tokio_postgres::Error> {
    let (admin, connection) = tokio_postgres::connect(base, NoTls).await?;
    let connection = tokio::spawn(connection);
    for name in databases {
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await?;
    }
    for login in logins {
        admin
            .batch_execute(&format!("DROP ROLE IF EXISTS {login}"))
            .await?;
    }
    drop(admin);
    let _ = connection.await;
    Ok(())
}

/// Runs `statement` (one that needs its database unused: a copy, a rename), tried again
/// every 50 ms for 5 s while another session is still leaving that database (55006).
async fn once_unused(admin: &Client, statement: &str) -> Result<(), tokio_postgres::Error> {
    let mut tries = 0;
    loop {
        match admin.batch_execute(statement).await {
            Err(e) if tries < 100 && e.code().is_some_and(|c| c.code() == "55006") => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            done => return done,
        }
    }
}

/// The run's template database, `OUTBOX_TEST_TEMPLATE` on the server of `base`, migrated by
/// the first test that needs it (the others wait on an advisory lock) and then closed to
/// connections, so that no relayer serves it and every copy starts from the same state;
/// `None` when the variable is not set. The run drops it (scripts/run-tests.sh).
async fn run_template(base: &str) -> Option<String> {
    let name = std::env::var("OUTBOX_TEST_TEMPLATE").ok()?;
    if name.is_empty() {
        return None;
    }
    assert!(
        name.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
        "OUTBOX_TEST_TEMPLATE={name:?}: a database name of lower-case letters, digits and _"
    );
    let admin = connect(base).await.expect("connect admin");
    admin
        .execute("SELECT pg_advisory_lock(hashtext($1))", &[&name])
        .await
        .expect("lock the template's creation");
    let exists = admin
        .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&name])
        .await
        .expect("look the template up")
        .is_some();
    if !exists {
        // Built under another name and renamed when complete: a creator killed half-way
        // leaves no half-migrated template behind under the real name.
        let building = format!("{name}_building");
        for statement in [
            format!("DROP DATABASE IF EXISTS {building} WITH (FORCE)"),
            format!("CREATE DATABASE {building}"),
        ] {
            admin
                .batch_execute(&statement)
                .await
                .expect("create the template");
        }
        {
            // As every test database was migrated before templates: `Store::migrate`.
            let store = Store::connect(&with_database(base, &building), 1).expect("store");
            store.migrate().await.expect("migrate the template");
        }
        // The migrating session may still be closing.
        once_unused(
            &admin,
            &format!("ALTER DATABASE {building} RENAME TO {name}"),
        )
        .await
        .unwrap_or_else(|e| panic!("rename {building} to {name}: {e}"));
        admin
            .batch_execute(&format!(
                "ALTER DATABASE {name} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false"
            ))
            .await
            .expect("close the template");
        eprintln!("test template {name} migrated");
    }
    admin
        .execute("SELECT pg_advisory_unlock(hashtext($1))", &[&name])
        .await
        .expect("unlock the template's creation");
    Some(name)
}

pub async fn connect(url: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

fn rand_suffix() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    u32::try_from(RandomState::new().hash_one(std::time::SystemTime::now()) % 100_000).unwrap()
}

/// The SQLSTATE of a database error, or a panic naming what came back instead.
pub fn sqlstate(result: Result<impl std::fmt::Debug, tokio_postgres::Error>) -> (String, String) {
    match result {
        Ok(v) => panic!("expected a database error, got {v:?}"),
        Err(e) => {
            let db = e
                .as_db_error()
                .unwrap_or_else(|| panic!("not a database error: {e}"));
            (db.code().code().to_owned(), db.message().to_owned())
        }
    }
}

/// A relayer process started from the built binary; killed if the test ends early.
pub struct Relayer {
    pub child: std::process::Child,
    pub worker_id: String,
    pub log: std::path::PathBuf,
    /// The `--telemetry-addr` it was given, if any: where [`Relayer::metric`] reads.
    pub telemetry: Option<String>,
}

impl Relayer {
    /// `outbox-relay run --worker-id <id> <args>` against `db`, logs to a file.
    pub fn start(db: &TestDb, worker_id: &str, args: &[&str]) -> Relayer {
        Relayer::start_with_url(db, &db.url, worker_id, args)
    }

    /// [`Relayer::start`] with another database URL (another login, or no database at all);
    /// `db` gives the scratch directory for the log.
    pub fn start_with_url(db: &TestDb, url: &str, worker_id: &str, args: &[&str]) -> Relayer {
        Relayer::spawn(db, url, worker_id, args, std::process::Stdio::null())
    }

    /// [`Relayer::start_with_url`] with the process's standard output going to `stdout`.
    pub fn spawn(
        db: &TestDb,
        url: &str,
        worker_id: &str,
        args: &[&str],
        stdout: std::process::Stdio,
    ) -> Relayer {
        let dir = db.scratch_dir();
        let log = dir.join(format!("{worker_id}.log"));
        let stderr = std::fs::File::create(&log).expect("log file");
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
            .arg("run")
            .args(["--worker-id", worker_id])
            .args(args)
            .env("DATABASE_URL", url)
            // TEST_RUST_LOG=outbox_relay=debug (say) gives the relayers' logs more detail.
            .env(
                "RUST_LOG",
                std::env::var("TEST_RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .expect("spawn outbox-relay");
        let telemetry = args
            .iter()
            .position(|a| *a == "--telemetry-addr")
            .and_then(|i| args.get(i + 1))
            .map(|a| (*a).to_owned());
        Relayer {
            child,
            worker_id: worker_id.to_owned(),
            log,
            telemetry,
        }
    }

    /// The sum of the samples of metric `name` (over its labels) on the relayer's /metrics;
    /// `None` while the listener does not answer. The relayer must have been started with
    /// `--telemetry-addr`.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let addr = self
            .telemetry
            .as_deref()
            .expect("a relayer started with --telemetry-addr");
        metric(addr, name).await
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (`TERM`, `KILL`, `STOP`, `CONT`) with kill(1).
    pub fn signal(&self, name: &str) {
        let ok = std::process::Command::new("kill")
            .args([format!("-{name}"), self.pid().to_string()])
            .status()
            .expect("kill(1)")
            .success();
        assert!(ok, "kill -{name} {}", self.pid());
    }

    /// Waits up to `limit` for the process to exit; returns its exit code.
    pub async fn exit_code(&mut self, limit: std::time::Duration) -> Option<i32> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.code();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} did not exit within {limit:?}; log:\n{}",
                self.worker_id,
                self.log_text()
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Relayer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A child process killed when the test that started it ends, failed or not: a relayer left
/// running after a failed assertion would go on serving what it discovers on the server.
pub struct KillOnDrop(pub std::process::Child);

impl std::ops::Deref for KillOnDrop {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl TestDb {
    /// A directory for this test's files (sink output, logs), next to the target dir.
    pub fn scratch_dir(&self) -> std::path::PathBuf {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(&self.name);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }
}

/// Inserts `n` messages on `topic` with payload `{"n": i}`; with `keyed_every = Some(k)`
/// every k-th message gets one of 50 keys. Returns their ids in enqueue order.
pub async fn fill(c: &Client, topic: &str, n: i64, keyed_every: Option<i64>) -> Vec<uuid::Uuid> {
    kit::fill_messages_returning_ids(c, topic, n, keyed_every, 50, 0)
        .await
        .unwrap()
}

/// Every dead letter: (outbox_id, last_error).
pub async fn dead_letters(c: &Client) -> Vec<(uuid::Uuid, String)> {
    c.query("SELECT outbox_id, last_error FROM outbox.dead_letters", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// The `bigint` that `sql` (a `SELECT count(*) …`, say) answers.
pub async fn count(c: &Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).await.unwrap().get(0)
}

/// Messages still in `outbox.messages` (ready, delayed or leased).
pub async fn pending(c: &Client) -> i64 {
    count(c, "SELECT count(*) FROM outbox.messages").await
}

/// The sum of the samples of metric `name` (over its labels) on the /metrics of the
/// telemetry listener at `addr`; `None` while it does not answer.
pub async fn metric(addr: &str, name: &str) -> Option<f64> {
    let (status, body) = outbox_relay::probes::probe(addr, "/metrics").await.ok()?;
    assert_eq!(status, 200, "/metrics on {addr}: {body}");
    Some(
        body.lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}

/// A free TCP port on 127.0.0.1, for a server a test starts itself, reserved for this test
/// process's life.
///
/// The port comes from 20000–32767, below the kernel's ephemeral range (32768 and up), so
/// no `bind(0)` of another test (a proxy, a client socket) can be handed it between the
/// choice and the server's own bind: when that happened, the server failed to bind, the
/// readiness check found the other test's listener on the port, and the two tests shared
/// one server. A lock file per port under the target directory keeps concurrent test
/// processes from choosing the same port; the lock is held until this process exits.
pub fn free_port() -> u16 {
    static HELD: Mutex<Vec<std::fs::File>> = Mutex::new(Vec::new());
    const LOW: u16 = 20_000;
    const HIGH: u16 = 32_767;
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("ports");
    std::fs::create_dir_all(&dir).expect("create the port lock directory");
    let start = u16::try_from(uuid::Uuid::new_v4().as_u128() % u128::from(HIGH - LOW + 1))
        .expect("below HIGH - LOW + 1");
    for step in 0..=(HIGH - LOW) {
        let port = LOW + (start + step) % (HIGH - LOW + 1);
        let path = dir.join(format!("{port}.lock"));
        let Ok(file) = std::fs::File::create(&path) else {
            continue;
        };
        if file.try_lock().is_err() {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            HELD.lock().unwrap().push(file);
            return port;
        }
    }
    panic!("no free port in {LOW}–{HIGH} on 127.0.0.1");
}

/// A port on 127.0.0.1 that refuses every connection for as long as this value lives: the
/// socket is bound, so no other process or test can take the port, and never listens, so
/// a connection gets a refusal at once. A port from [`free_port`] is only free when it is
/// chosen; a test that needs "nothing listens here" for its whole run uses this instead.
pub struct ClosedPort {
    socket: tokio::net::TcpSocket,
    pub port: u16,
}

impl ClosedPort {
    pub fn new() -> ClosedPort {
        let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
        socket
            .bind("127.0.0.1:0".parse().unwrap())
            .expect("bind an ephemeral port");
        let port = socket.local_addr().expect("its address").port();
        ClosedPort { socket, port }
    }

    /// Starts listening on the port: from now on connections are accepted (by whoever
    /// accepts on the listener), with no moment in which another could take the port.
    /// Called inside a Tokio runtime (the listener registers with it).
    pub fn listen(self) -> tokio::net::TcpListener {
        self.socket.listen(128).expect("listen on the held port")
    }
}

/// `outbox-relay ARGS` run to completion with DATABASE_URL = `url` and none of the caller's
/// libpq `PG*` variables (so they cannot change what a test means).
pub fn verb(args: &[&str], url: &str) -> std::process::Output {
    verb_env(args, url, &[])
}

/// [`verb`] with extra environment variables.
pub fn verb_env(args: &[&str], url: &str, env: &[(&str, &str)]) -> std::process::Output {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    for (name, _) in std::env::vars() {
        if name.starts_with("PG") {
            command.env_remove(name);
        }
    }
    let mut child = command
        .args(args)
        .env("DATABASE_URL", url)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run outbox-relay");
    let read = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = read(Box::new(child.stdout.take().expect("piped stdout")));
    let stderr = read(Box::new(child.stderr.take().expect("piped stderr")));
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for outbox-relay") {
            break status;
        }
        if started.elapsed() >= VERB_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "outbox-relay {args:?} still running after {} s, killed; stdout: {} stderr: {}",
                VERB_LIMIT.as_secs(),
                text(&stdout.join().unwrap_or_default()),
                text(&stderr.join().unwrap_or_default())
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: stdout.join().expect("read stdout"),
        stderr: stderr.join().expect("read stderr"),
    }
}

/// The longest a verb run by [`verb`] may take: a verb that hangs fails its test with what it
/// printed, instead of holding up the whole run.
const VERB_LIMIT: std::time::Duration = std::time::Duration::from_secs(300);

/// A process's output as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

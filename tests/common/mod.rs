//! Test harness: every test gets its own freshly migrated database on the Postgres named by
//! `DATABASE_URL` (default: the local one on 127.0.0.1:5432), so tests run in parallel and
//! never see each other's rows. The database is dropped when the test calls `finish`; a
//! failing test never gets there, and its database is kept for inspection (the name is
//! printed when it is created).

#![allow(dead_code)] // each test binary uses a different part of the harness

use std::sync::atomic::{AtomicU32, Ordering};

use outbox_relay::store::Store;
use tokio_postgres::{Client, NoTls};

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

static COUNTER: AtomicU32 = AtomicU32::new(0);

pub fn base_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// `url` with its database name replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
    let (main, query) = match url.split_once('?') {
        Some((m, q)) => (m, Some(q)),
        None => (url, None),
    };
    let scheme_end = main.find("://").map_or(0, |i| i + 3);
    let base = match main[scheme_end..].find('/') {
        Some(i) => &main[..scheme_end + i],
        None => main,
    };
    match query {
        Some(q) => format!("{base}/{db}?{q}"),
        None => format!("{base}/{db}"),
    }
}

pub struct TestDb {
    pub name: String,
    pub url: String,
}

impl TestDb {
    /// Creates and migrates a new database.
    pub async fn new() -> TestDb {
        let name = format!(
            "outbox_test_{}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            rand_suffix()
        );
        let admin = connect(&base_url()).await.unwrap_or_else(|e| {
            panic!(
                "cannot connect to Postgres at {} ({e}); set DATABASE_URL or run `make test`, \
                 which starts one",
                base_url()
            )
        });
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create test database");
        eprintln!("test database {name} (kept if the test fails)");
        let url = with_database(&base_url(), &name);
        let store = Store::connect(&url, 2).expect("store");
        store.migrate().await.expect("migrate test database");
        TestDb { name, url }
    }

    pub async fn client(&self) -> Client {
        connect(&self.url).await.expect("connect to test database")
    }

    pub fn store(&self) -> Store {
        Store::connect(&self.url, 8).expect("store")
    }

    /// Drops the database; call at the end of a passing test.
    pub async fn finish(self) {
        let admin = connect(&base_url()).await.expect("connect admin");
        admin
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .await
            .expect("drop test database");
    }
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

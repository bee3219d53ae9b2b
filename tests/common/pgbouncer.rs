//! PgBouncers of a test's own in front of the test Postgres (tests/process/poolers.rs, and the
//! producer snippets through a pooler in tests/process/producers.rs).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{TestDb, eventually, text};

/// A PgBouncer of this test's own, in front of the test Postgres, killed when dropped.
pub struct PgBouncer {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl PgBouncer {
    /// Starts PgBouncer with `pool_mode = mode` in `dir`, and waits until it answers.
    pub async fn start(dir: &Path, mode: &str) -> PgBouncer {
        let binary = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .unwrap_or_else(|| {
                panic!(
                    "pgbouncer is not installed: apt-get install pgbouncer (make test installs \
                     it, see scripts/test-services.sh)"
                )
            });
        let port = super::free_port();
        let upstream: tokio_postgres::Config = super::base_url().parse().expect("DATABASE_URL");
        let host = match upstream.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
            _ => "127.0.0.1".to_owned(),
        };
        let upstream_port = upstream.get_ports().first().copied().unwrap_or(5432);
        let dir = dir.join(format!("pgbouncer-{mode}-{port}"));
        std::fs::create_dir_all(&dir).expect("pgbouncer dir");
        let users = dir.join("users.txt");
        std::fs::write(&users, "\"postgres\" \"\"\n").expect("users.txt");
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(
            &ini,
            format!(
                "[databases]\n* = host={} port={}\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
                 unix_socket_dir =\nauth_type = trust\nauth_file = {}\n\
                 pool_mode = {mode}\ndefault_pool_size = 10\nmax_client_conn = 200\n\
                 ignore_startup_parameters = extra_float_digits,options\n",
                host,
                upstream_port,
                users.display()
            ),
        )
        .expect("pgbouncer.ini");
        let log = dir.join("pgbouncer.log");
        let mut command = Command::new(binary);
        // PgBouncer refuses to run as root; -u switches to another user after start.
        if is_root() {
            command.args(["-u", "postgres"]);
        }
        let child = command
            .arg(&ini)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("pgbouncer log"))
            .spawn()
            .expect("start pgbouncer");
        let bouncer = PgBouncer { child, port, log };
        eventually(Duration::from_secs(20), "pgbouncer to listen", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
        bouncer
    }

    /// A URL reaching `db` through this PgBouncer.
    pub fn url(&self, db: &TestDb) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{}", self.port, db.name)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| text(&o.stdout).trim() == "0")
}

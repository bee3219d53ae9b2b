//! A throwaway PostgreSQL cluster of a test's own, for a test that needs what the shared
//! server cannot give it (hundreds of connections, say): `initdb` into a fresh directory,
//! started on a free port with fsync off, and stopped and removed when the [`Cluster`]
//! guard drops, also when the test panics. A watcher process does the same if the test
//! process dies without dropping it (SIGKILL, an abort), so nothing is left behind either
//! way. The directory is in `/dev/shm` when that memory file system has room, else in the
//! system's temporary directory (making and dropping tens of databases is several times
//! faster in memory); `TEST_CLUSTER_DIR` names another parent.
//!
//! It needs the PostgreSQL server binaries (`initdb`, `pg_ctl`): the newest under
//! `/usr/lib/postgresql/*/bin` (Debian's layout), else the directory `pg_config --bindir`
//! names, else those on `PATH`. Run as root (as CI does), it runs them as the user `postgres`
//! with `runuser`, since initdb and postgres refuse to run as root.

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A running throwaway cluster; see the module docs.
pub struct Cluster {
    dir: PathBuf,
    port: u16,
    bindir: PathBuf,
    /// Whether the binaries run as `postgres` (this process is root).
    as_postgres: bool,
    /// The watcher ([`Cluster::watch`]), ended when the guard has done its work.
    watcher: Option<std::process::Child>,
}

impl Cluster {
    /// Starts a cluster with `settings` (`name`, `value` pairs for `postgresql.conf`, after
    /// the defaults of this harness: fsync, synchronous_commit and full_page_writes off) and
    /// waits until it accepts connections.
    pub fn start(settings: &[(&str, &str)]) -> Cluster {
        let bindir = bindir();
        let dir = parent_dir().join(format!(
            "outbox-cluster-{}-{}",
            std::process::id(),
            super::free_port()
        ));
        std::fs::create_dir(&dir)
            .unwrap_or_else(|e| panic!("create the cluster directory {}: {e}", dir.display()));
        let as_postgres = std::fs::metadata(&dir).expect("stat the cluster dir").uid() == 0;
        let mut cluster = Cluster {
            dir,
            port: 0,
            bindir,
            as_postgres,
            watcher: None,
        };
        cluster.watcher = Some(cluster.watch());
        if as_postgres {
            let chowned = Command::new("chown")
                .arg("postgres")
                .arg(&cluster.dir)
                .status()
                .is_ok_and(|s| s.success());
            assert!(
                chowned,
                "running as root, the throwaway cluster runs as the user postgres, but \
                 `chown postgres {}` failed: is there a user postgres (the PostgreSQL \
                 packages create it)?",
                cluster.dir.display()
            );
        }
        cluster.run(
            "initdb",
            &[
                "-D",
                &cluster.data(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        );
        let mut conf = format!(
            "listen_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nfsync = off\n\
             synchronous_commit = off\nfull_page_writes = off\n",
            cluster.dir.display()
        );
        for (name, value) in settings {
            conf.push_str(&format!("{name} = '{value}'\n"));
        }
        let conf_file = Path::new(&cluster.data()).join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf_file).expect("read postgresql.conf");
        text.push_str(&conf);
        std::fs::write(&conf_file, text).expect("write postgresql.conf");
        // A port found free may be taken before the server binds it: try another.
        for tries in 1.. {
            cluster.port = super::free_port();
            let log = cluster.log().display().to_string();
            let port = format!("-p {}", cluster.port);
            let data = cluster.data();
            let started = cluster.try_run(
                "pg_ctl",
                &[
                    "-D", &data, "-l", &log, "-o", &port, "-w", "-t", "60", "start",
                ],
            );
            match started {
                Ok(()) => break,
                Err(e) if tries < 3 => eprintln!("throwaway cluster: {e}; trying another port"),
                Err(e) => panic!("{e}"),
            }
        }
        eprintln!(
            "throwaway cluster on 127.0.0.1:{} ({}), removed when the test ends",
            cluster.port,
            cluster.dir.display()
        );
        cluster
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The server's log.
    pub fn log(&self) -> PathBuf {
        self.dir.join("postgres.log")
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    /// `program args`, from the server binaries, as `postgres` when this process is root.
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let path = self.bindir.join(program);
        let mut command = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        };
        command.args(args);
        command
    }

    fn try_run(&self, program: &str, args: &[&str]) -> Result<(), String> {
        let mut command = self.command(program, args);
        let out = command.stdin(Stdio::null()).output().map_err(|e| {
            format!(
                "cannot run {} {program}: {e}",
                command.get_program().to_string_lossy()
            )
        })?;
        if out.status.success() {
            return Ok(());
        }
        Err(format!(
            "{program} {} failed ({}): {}{}\nserver log:\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(self.log()).unwrap_or_default()
        ))
    }

    fn run(&self, program: &str, args: &[&str]) {
        if let Err(e) = self.try_run(program, args) {
            panic!("throwaway cluster: {e}");
        }
    }

    /// A process of its own (its own process group, so that a Ctrl-C to the test does not
    /// stop it) that stops the cluster and removes its directory once this process is gone.
    fn watch(&self) -> std::process::Child {
        let data = self.data();
        let stop = self.command("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]);
        let stop = std::iter::once(stop.get_program())
            .chain(stop.get_args())
            .map(|a| quoted(&a.to_string_lossy()))
            .collect::<Vec<_>>()
            .join(" ");
        let script = format!(
            "while kill -0 {owner} 2>/dev/null; do sleep 1; done; {stop} >/dev/null 2>&1; \
             rm -rf {dir}",
            owner = std::process::id(),
            dir = quoted(&self.dir.to_string_lossy())
        );
        Command::new("bash")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start the throwaway cluster's watcher (bash)")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The databases go with the cluster; its log is what is left to read.
            let kept = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
                "outbox-cluster-{}-{}.log",
                std::process::id(),
                self.port
            ));
            let copied = std::fs::copy(self.log(), &kept).is_ok();
            eprintln!(
                "test failed: the throwaway cluster on 127.0.0.1:{} is removed with its \
                 databases{}",
                self.port,
                if copied {
                    format!("; its server log is kept at {}", kept.display())
                } else {
                    String::new()
                }
            );
        }
        let data = self.data();
        let _ = self
            .command("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
        if let Some(mut watcher) = self.watcher.take() {
            let _ = watcher.kill();
            let _ = watcher.wait();
        }
    }
}

/// Where the cluster's directory goes; see the module docs.
fn parent_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TEST_CLUSTER_DIR") {
        return dir.into();
    }
    let shm_room = Command::new("df")
        .args(["-B1", "--output=avail", "/dev/shm"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .last()?
                .trim()
                .parse::<u64>()
                .ok()
        });
    if shm_room.is_some_and(|bytes| bytes >= SHM_ROOM) {
        return PathBuf::from("/dev/shm");
    }
    std::env::temp_dir()
}

/// The room `/dev/shm` must have for a cluster to go there: the 62 databases of
/// `tests/sources/fleet.rs` filled 0.9 GB.
const SHM_ROOM: u64 = 4 << 30;

/// The directory of the server binaries; a panic saying what to install when there is none.
fn bindir() -> PathBuf {
    let debian = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let version: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .max();
    if let Some((_, bin)) = debian {
        return bin;
    }
    let configured = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    if let Some(bin) = configured.filter(|b| b.join("initdb").is_file()) {
        return bin;
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .find(|d| d.join("initdb").is_file());
    on_path.unwrap_or_else(|| {
        panic!(
            "this test starts a PostgreSQL cluster of its own and needs the server binaries \
             (initdb, pg_ctl), found in none of /usr/lib/postgresql/*/bin, `pg_config \
             --bindir` and PATH: install PostgreSQL (apt-get install postgresql)"
        )
    })
}

/// `s` as one word of a shell command.
fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

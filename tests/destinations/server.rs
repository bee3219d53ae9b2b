//! A server process a harness starts for one test (redis-server, nats-server, tansu):
//! started again with the same arguments after a stop, signalled to freeze, killed however
//! the test ends.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crate::MINUTE;
use crate::common::eventually;

pub struct Server {
    program: OsString,
    args: Vec<OsString>,
    port: u16,
    dir: Option<PathBuf>,
    child: Option<Child>,
}

impl Server {
    /// Runs `program args` and waits until it accepts connections on `port`.
    pub async fn start(program: &'static str, args: Vec<OsString>, port: u16) -> Server {
        Server::start_in(program.into(), args, port, None).await
    }

    /// [`Server::start`] with `program` run in `dir`.
    pub async fn start_in(
        program: OsString,
        args: Vec<OsString>,
        port: u16,
        dir: Option<PathBuf>,
    ) -> Server {
        let mut server = Server {
            program,
            args,
            port,
            dir,
            child: None,
        };
        server.restart().await;
        server
    }

    /// Starts it again (after [`Server::kill`]) and waits until it accepts connections.
    pub async fn restart(&mut self) {
        let mut command = Command::new(&self.program);
        if let Some(dir) = &self.dir {
            command.current_dir(dir);
        }
        let child = command
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{:?} must be installed ({e})", self.program));
        self.child = Some(child);
        eventually(
            MINUTE,
            "the test's server to accept connections",
            || async {
                tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                    .await
                    .is_ok()
            },
        )
        .await;
    }

    /// Sends a signal (`-STOP`, `-CONT`) with kill(1).
    pub fn signal(&self, name: &str) {
        let pid = self
            .child
            .as_ref()
            .expect("the server runs")
            .id()
            .to_string();
        assert!(
            Command::new("kill")
                .args([name, &pid])
                .status()
                .unwrap()
                .success()
        );
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

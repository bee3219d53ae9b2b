//! A server process a harness starts for one test (redis-server, nats-server): started
//! again with the same arguments after a stop, signalled to freeze, killed however the test
//! ends.

use std::ffi::OsString;
use std::process::{Child, Command, Stdio};

use crate::MINUTE;
use crate::common::eventually;

pub struct Server {
    program: &'static str,
    args: Vec<OsString>,
    port: u16,
    child: Option<Child>,
}

impl Server {
    /// Runs `program args` and waits until it accepts connections on `port`.
    pub async fn start(program: &'static str, args: Vec<OsString>, port: u16) -> Server {
        let mut server = Server {
            program,
            args,
            port,
            child: None,
        };
        server.restart().await;
        server
    }

    /// Starts it again (after [`Server::kill`]) and waits until it accepts connections.
    pub async fn restart(&mut self) {
        let child = Command::new(self.program)
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{} must be installed ({e})", self.program));
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

//! A TCP proxy in front of a shared server, so that a test can break the connection to it,
//! take it away, or freeze it (connections accepted, nothing answered) without touching the
//! server other tests use. A recording proxy ([`Proxy::recording`]) also keeps the body of
//! each HTTP/1.1 request that goes through it (or, [`Proxy::recording_kafka`], each Kafka
//! protocol request), so that a test can see what each request the relayer made carried.

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The bodies of the requests a recording proxy forwarded, in the order they came.
pub type Bodies = Arc<Mutex<Vec<Vec<u8>>>>;

/// How a recording proxy finds the requests in what a client sends.
#[derive(Clone, Copy)]
pub enum Framing {
    /// HTTP/1.1 requests with a `Content-Length`: each body.
    Http,
    /// Kafka protocol requests (a 4-byte big-endian size, then the request: API key,
    /// version, correlation id, …): each request after its size.
    Kafka,
}

pub struct Proxy {
    pub port: u16,
    upstream: String,
    /// With [`Proxy::recording`], the bodies of the requests forwarded so far.
    recorded: Option<(Bodies, Framing)>,
    frozen: watch::Sender<bool>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    listener: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Listens on a free port and forwards every connection to `upstream`.
    pub async fn start(upstream: &str) -> Proxy {
        let mut proxy = Proxy {
            port: crate::common::free_port(),
            upstream: upstream.to_owned(),
            frozen: watch::channel(false).0,
            connections: Arc::default(),
            listener: None,
            recorded: None,
        };
        proxy.listen().await;
        proxy
    }

    /// A proxy to an HTTP/1.1 server (requests with a `Content-Length`) that also keeps
    /// each request's body ([`Proxy::bodies`]).
    pub async fn recording(upstream: &str) -> Proxy {
        Self::recording_as(upstream, Framing::Http).await
    }

    /// A proxy to a Kafka-protocol broker that also keeps each request
    /// ([`Proxy::bodies`]: its API key in the first two bytes).
    pub async fn recording_kafka(upstream: &str) -> Proxy {
        Self::recording_as(upstream, Framing::Kafka).await
    }

    async fn recording_as(upstream: &str, framing: Framing) -> Proxy {
        let mut proxy = Proxy {
            port: crate::common::free_port(),
            upstream: upstream.to_owned(),
            frozen: watch::channel(false).0,
            connections: Arc::default(),
            listener: None,
            recorded: Some((Bodies::default(), framing)),
        };
        proxy.listen().await;
        proxy
    }

    /// The bodies of the requests forwarded so far (a recording proxy's; none otherwise).
    pub fn bodies(&self) -> Vec<Vec<u8>> {
        self.recorded
            .as_ref()
            .map(|(r, _)| r.lock().unwrap().clone())
            .unwrap_or_default()
    }

    /// Accepts again on the same port.
    pub async fn listen(&mut self) {
        let listener = TcpListener::bind(("127.0.0.1", self.port))
            .await
            .expect("bind the proxy port");
        let (upstream, frozen, connections, recorded) = (
            self.upstream.clone(),
            self.frozen.clone(),
            self.connections.clone(),
            self.recorded.clone(),
        );
        self.listener = Some(tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let task = tokio::spawn(forward(
                    client,
                    upstream.clone(),
                    frozen.subscribe(),
                    recorded.clone(),
                ));
                connections.lock().unwrap().push(task);
            }
        }));
    }

    /// Closes every forwarded connection (the server side hangs up).
    pub fn kill_connections(&self) {
        for task in self.connections.lock().unwrap().drain(..) {
            task.abort();
        }
    }

    /// Stops listening and closes every connection: the server is down.
    pub async fn stop(&mut self) {
        if let Some(listener) = self.listener.take() {
            listener.abort();
            let _ = listener.await;
        }
        self.kill_connections();
    }

    /// Connections are accepted and kept, but nothing is forwarded either way.
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Drops what was held while frozen and forwards again.
    pub fn thaw(&self) {
        self.kill_connections();
        self.frozen.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(listener) = self.listener.take() {
            listener.abort();
        }
        self.kill_connections();
    }
}

async fn forward(
    client: TcpStream,
    upstream: String,
    mut frozen: watch::Receiver<bool>,
    recorded: Option<(Bodies, Framing)>,
) {
    if thawed(&mut frozen).await.is_err() {
        return;
    }
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    let (client_in, client_out) = client.into_split();
    let (server_in, server_out) = server.into_split();
    tokio::join!(
        pump(client_in, server_out, frozen.clone(), recorded),
        pump(server_in, client_out, frozen, None)
    );
}

async fn thawed(frozen: &mut watch::Receiver<bool>) -> Result<(), watch::error::RecvError> {
    while *frozen.borrow_and_update() {
        frozen.changed().await?;
    }
    Ok(())
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: watch::Receiver<bool>,
    recorded: Option<(Bodies, Framing)>,
) {
    let mut buf = vec![0; 16 * 1024];
    let mut requests = Vec::new();
    loop {
        if thawed(&mut frozen).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some((recorded, framing)) = &recorded {
            requests.extend_from_slice(&buf[..n]);
            loop {
                let body = match framing {
                    Framing::Http => next_body(&mut requests),
                    Framing::Kafka => next_kafka_request(&mut requests),
                };
                let Some(body) = body else { break };
                recorded.lock().unwrap().push(body);
            }
        }
        // Frozen while this was read: hold it, as a server that stopped answering would.
        if thawed(&mut frozen).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// The body of the first complete request in `stream` (an HTTP/1.1 request line, headers
/// with a `Content-Length`, the body), taken out of it; `None` until one is complete.
fn next_body(stream: &mut Vec<u8>) -> Option<Vec<u8>> {
    let end = stream.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&stream[..end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap_or(0));
    if stream.len() < end + length {
        return None;
    }
    let body = stream[end..end + length].to_vec();
    stream.drain(..end + length);
    Some(body)
}

/// The first complete Kafka protocol request in `stream` (a 4-byte big-endian size, then
/// that many bytes), without its size, taken out of it; `None` until one is complete.
/// Plaintext connections only (the harness's): TLS records would not frame.
fn next_kafka_request(stream: &mut Vec<u8>) -> Option<Vec<u8>> {
    let size: [u8; 4] = stream.get(..4)?.try_into().ok()?;
    let size = usize::try_from(u32::from_be_bytes(size)).ok()?;
    if stream.len() < 4 + size {
        return None;
    }
    let request = stream[4..4 + size].to_vec();
    stream.drain(..4 + size);
    Some(request)
}
